"""Generated from proto/splitserve/v1/*.proto by `python -m splitserve.proto.generate`; do not edit."""
