"""The endpoint picker's own Prometheus families (beside the router's, on one registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OUTCOMES = ("routed", "refused", "unavailable", "shed", "failed")


class EppMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("splitserve_epp_requests", "Requests the endpoint picker answered, by outcome "
                                "(routed; refused: 4xx; unavailable: 503; shed: 429; failed: 500)",
                                ["outcome"], registry=registry)
        self.pick_seconds = Histogram("splitserve_epp_pick_seconds",
                                      "Time from the request's last body chunk to the routing answer "
                                      "(parse, tokenize, flow control, route)", registry=registry,
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1, 5, 30))
        self.streams = Gauge("splitserve_epp_streams", "ext_proc streams open (requests in flight through the "
                             "gateway)", registry=registry)
        self.objectives = Counter("splitserve_epp_objective_requests", "Requests whose objective header "
                                  "(x-gateway-inference-objective) named a known InferenceObjective (known=true: "
                                  "its priority applied) or none (known=false: the body's priority kept)",
                                  ["known"], registry=registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for known in ("true", "false"):
            self.objectives.labels(known)

    def picked(self, seconds: float) -> None:
        self.requests.labels("routed").inc()
        self.pick_seconds.observe(seconds)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def objective(self, known: bool) -> None:
        self.objectives.labels("true" if known else "false").inc()
