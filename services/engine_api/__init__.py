"""What a worker knows about an engine: the `Engine` protocol (contract.py) and the KV events an
engine publishes (kv_events.py). The built-in torch engine (services/engine/) implements it; a
worker (services/worker/) imports nothing else of any engine."""
