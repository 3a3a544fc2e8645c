"""The worker process: one engine behind the gRPC Worker service.

The worker knows its engine only through the engine contract (services/engine_api/): it
is handed an `EngineLauncher` and never imports an engine. worker/ serves requests, one
job per module: `server` starts it all (`splitserve worker`) and `shutdown` drains it;
`engine_loop` runs the synchronous engine on its own thread; `service` maps the Worker
RPCs onto it; `session` and `session_stream` carry many requests over one call or socket;
`output_messages` maps an engine's outputs and KV events to the wire; `kv_event_hub`
numbers, buffers and replays KV cache events; `stats_metrics` turns Stats into the
Prometheus families /metrics serves.

worker/kv/ is the worker's part of disaggregation, over the engine's KV transfer (the
KVSender/KVReceiver of kvtransfer/sender_receiver.py): `remote_prefill` is the decode side
of a request, `prefill_server` the prefill side, and `write_fences` keeps a given-up
request's blocks out of the pool until no write into them can land.
"""
