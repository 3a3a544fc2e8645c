"""The worker process: one engine behind the gRPC Worker service (issue 4).

`engine_loop` runs the synchronous engine on its own thread; `service` maps
the Worker RPCs onto it; `kv_event_hub` numbers, buffers and replays KV events;
`transfer` is the seam where kvtransfer's connector plugs in for the
disaggregated roles; `server` starts it all (`splitserve worker`).
"""
