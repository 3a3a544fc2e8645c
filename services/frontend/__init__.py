"""The frontend: the OpenAI-compatible HTTP API and the public gRPC API in front of the workers.

`core` is one request's life (tokenize, route, stream, stop strings, migration through
`migration`); `http/` and `grpc/` are the two APIs, `guard` and `limits` admit requests,
`workers/` holds the pool (which alone owns membership) and the session to each worker,
`routing` turns router decisions into worker handles and `router_feeds` feeds the router
the workers' KV events and stats; `server` starts it all (`splitserve frontend`). It never
imports torch, the engine or the worker (docs/architecture.md).
"""
