"""`splitserve epp`: splitserve's KV-aware router as a Gateway API Inference Extension endpoint picker.

A gateway (Envoy Gateway, kgateway, Istio, GKE; any that speaks the endpoint picker protocol)
calls this process over Envoy's ext_proc for every request to an InferencePool; it answers with
the pod that should serve it. One job per module:

- `protocol.py`   the protocol's names and the ext_proc messages (route, body chunks, refusals);
- `exchange.py`   one request's ext_proc stream: gather the body, admit, pick, pass the response on;
- `picker.py`     the decision: the frontend's parsing and tokenization, the frontend's router;
- `endpoints.py`  a worker's gRPC address -> its pod's OpenAI endpoint;
- `pool_pods.py`  the workers of an InferencePool, from its pods (Kubernetes);
- `health.py`     grpc.health.v1 on the ext_proc port, liveness/readiness on the probe port;
- `metrics.py`    the picker's Prometheus families;
- `server.py`     the process: config, servers, readiness, drain.

The pods it picks run `splitserve frontend --gateway` beside their worker
(services/frontend/gateway.py).
"""
