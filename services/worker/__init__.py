"""The worker process: one engine behind the gRPC Worker service.

worker/ serves requests, one job per module: `server` starts it all (`splitserve
worker`) and `shutdown` drains it; `engine_loop` runs the synchronous engine on its
own thread; `service` maps the Worker RPCs onto it; `session` and `session_stream`
carry many requests over one call or socket; `convert` maps engine dataclasses to
the wire; `kv_event_hub` numbers, buffers and replays KV cache events;
`metrics_http` serves /metrics.

worker/kv/ moves KV between workers for the disaggregated roles, one job per module:
`transfer` is the seam (the KVSender/KVReceiver protocols the worker calls);
`connector_transfer` implements it over kvtransfer's connector, with
`rank_transfer` (one TP rank's sends and receives) and `tp_fanout` (ranks 1..N-1);
`remote_prefill` is the decode side of a request, `prefill_server` the prefill
side, and `write_fences` keeps a given-up request's blocks out of the pool until
no write into them can land.
"""
