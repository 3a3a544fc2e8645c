"""The frontend's Prometheus metrics (DESIGN section 8), in a registry of its own.

One `FrontendMetrics` per app (no module-global registry), exposed on /metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.services.frontend.fault_metrics import FaultMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# requests_total{status}: how requests ended
STATUS_OK = "ok"
STATUS_INVALID = "invalid"          # refused with a 4xx before or by a worker
STATUS_CANCELLED = "cancelled"      # the client went away
STATUS_UNAVAILABLE = "unavailable"  # no worker, or a worker stopped serving
STATUS_ERROR = "error"


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("splitserve_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("splitserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds",
                             "Time from request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("splitserve_requests", "Requests by API and how they ended",
                                ["api", "status"], registry=r)
        self.in_flight = Gauge("splitserve_requests_in_flight", "Requests being served now",
                               registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens of served requests",
                                     registry=r)
        # Counted when a request is admitted, not when it ends: the planner sees a change in the
        # mix (longer prompts) while those requests still wait, not a TTFT later.
        self.admitted = Counter("splitserve_admitted_requests", "Requests admitted (validated, about to be routed)",
                                registry=r)
        self.admitted_prompt_tokens = Counter("splitserve_admitted_prompt_tokens",
                                              "Prompt tokens of admitted requests", registry=r)
        # The planner's output-length prior until requests end (planner/readings.py). Only caps a
        # client chose: the rest of the context, a request without one, says nothing of its length.
        self.admitted_capped = Counter("splitserve_admitted_capped_requests",
                                       "Admitted requests whose max_tokens the client set (or its API's default)",
                                       registry=r)
        self.admitted_max_tokens = Counter("splitserve_admitted_max_tokens",
                                           "max_tokens of the admitted requests that set one", registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.faults = FaultMetrics(r)     # migrations, cancellations, failures (fault_metrics.py)
        self.rejected = Counter("splitserve_rejected_requests",
                                "Requests refused, by protocol (http, grpc) and reason (auth, rate_limit, "
                                "concurrency, body_too_large, invalid, timeout, shed)", ["protocol", "reason"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
