"""vLLM as an engine behind the engine contract (services/engine_api/): `VllmEngine` (engine.py)
over an in-process vLLM `LLMEngine`, started by `VllmEngineLauncher` (launcher.py) in the vLLM
engine's own environment (environment.py); splitserve's sampling parameters as vLLM's
(sampling.py). Nothing here imports vLLM at import time: `serve` reads environment.py from
splitserve's own environment."""
