"""vLLM as an engine behind the engine contract (services/engine_api/): `VllmEngine` (engine.py)
over an in-process vLLM `LLMEngine`, started by `VllmEngineLauncher` (launcher.py) in the vLLM
engine's own environment (environment.py); splitserve's sampling parameters as vLLM's
(sampling.py); vLLM's KV events republished with splitserve's block hashes (kv_events.py over
kv_hash_translation.py). Nothing here imports vLLM at import time: `serve` reads environment.py from
splitserve's own environment."""
