"""The processes: engine, prefill and decode workers, frontend, CLI."""
