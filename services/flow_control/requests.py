"""What a caller hands flow control for one request, and the llm-d headers it comes from.

The frontend and the EPP each build a `FlowRequest` from what they parse: the flow (fairness id)
from the `x-llm-d-inference-fairness-id` header or else the API key's id; the priority from the
body's `priority` field, a header or the InferencePool's objective; the TTFT deadline from
`x-llm-d-slo-ttft-ms`. Parsing is theirs; these names are here so both read the same headers.
"""

from __future__ import annotations

from dataclasses import dataclass

FAIRNESS_ID_HEADER = "x-llm-d-inference-fairness-id"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
TTFT_SLO_HEADER = "x-llm-d-slo-ttft-ms"


@dataclass(slots=True, frozen=True)
class FlowRequest:
    """One request as flow control sees it.

    flow_id: the tenant it is fair between (fairness id or API key id); any string.
    priority: vLLM's sense: lower is dispatched first (config.py). A priority no band has goes to
      the default band.
    ttft_deadline_s: seconds from arrival by which it must be dispatched, or None (no deadline).
    request_id: for log lines only.
    """

    flow_id: str
    priority: int = 0
    ttft_deadline_s: float | None = None
    request_id: str = ""
