"""The vLLM engine (services/engine/ is the built-in one): vLLM behind the engine contract; its KV
events republished with splitserve's block hashes (kv_events.py, kv_hash_translation.py)."""
