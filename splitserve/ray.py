"""`splitserve.ray`: the Ray Serve target (an alias of splitserve.services.ray_serve)."""

from splitserve.services.ray_serve import (EngineSettings, RayServeConfig, app_builder,  # noqa: F401
                                           build_application, config_from_spec, deployment_options, read_spec)
from splitserve.services.ray_serve import __all__  # noqa: F401
