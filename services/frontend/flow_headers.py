"""What a client tells flow control (issue 40), read from its request: a `FlowRequest`, or a 400.

- flow (who it is fair between): the header `x-llm-d-inference-fairness-id` (llm-d's and GIE's;
  the older `x-gateway-inference-fairness-id` too), else the API key's id when API keys are on
  (guard.py puts it in the scope), else `DEFAULT_FLOW`: without keys or a header every client is
  one flow, since an IP address says little behind a proxy or gateway.
- priority: the body's `priority`, vLLM's field and direction (lower is served first). vLLM
  accepts a non-zero priority only under `--scheduling-policy priority` and refuses it otherwise;
  here the same rule holds with flow control in its place (`check_priority`).
- TTFT deadline: the header `x-llm-d-slo-ttft-ms` (or `x-slo-ttft-ms`), milliseconds > 0 from
  arrival by which the request must be dispatched, else it is shed.

The objective headers (`x-gateway-inference-objective`, `x-llm-d-inference-objective`) are not
read here: they name an InferenceObjective, whose priority (higher is more important, the opposite
of vLLM's field) lives in the cluster, where the endpoint picker in front of the pool reads it and
orders by it (services/epp/objectives.py); the frontend only sees numbers a client sends. HTTP headers (byte pairs) and gRPC metadata (string pairs) are read alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from splitserve.services.flow_control import FAIRNESS_ID_HEADER, TTFT_SLO_HEADER, FlowRequest

from splitserve.services.frontend.errors import APIError, invalid

FAIRNESS_ID_ALIAS = "x-gateway-inference-fairness-id"     # GIE's name before llm-d's
TTFT_SLO_ALIAS = "x-slo-ttft-ms"
DEFAULT_FLOW = "default"
MAX_FLOW_ID_CHARS = 256
_WANTED = frozenset({FAIRNESS_ID_HEADER, FAIRNESS_ID_ALIAS, TTFT_SLO_HEADER, TTFT_SLO_ALIAS})

PRIORITY_OFF = ("priority scheduling is not enabled: every request has priority 0 (start the frontend with "
                "--flow-control to order requests by their priority)")


def check_priority(priority: int, flow_control_on: bool) -> None:
    """vLLM's rule: a non-zero priority only where requests are scheduled by it (400 otherwise)."""
    if priority != 0 and not flow_control_on:
        raise invalid(PRIORITY_OFF, "priority", "unsupported_parameter")


def flow_request(pairs: Iterable[tuple], priority: int, key_id: str | None, request_id: str) -> FlowRequest:
    """The FlowRequest of a request with these headers (or gRPC metadata), body `priority` and API
    key id (None: keys off); raises the 400 for a header whose value cannot work."""
    headers = _read(pairs)
    flow_id = headers.get(FAIRNESS_ID_HEADER) or headers.get(FAIRNESS_ID_ALIAS) or key_id or DEFAULT_FLOW
    if len(flow_id) > MAX_FLOW_ID_CHARS:
        raise _bad_header(FAIRNESS_ID_HEADER, f"is longer than {MAX_FLOW_ID_CHARS} characters")
    name = TTFT_SLO_HEADER if TTFT_SLO_HEADER in headers else TTFT_SLO_ALIAS
    deadline_s = _deadline_s(name, headers[name]) if name in headers else None
    return FlowRequest(flow_id, priority, deadline_s, request_id)


def _read(pairs: Iterable[tuple]) -> dict[str, str]:
    """The headers flow control reads, by lower-case name, stripped; empty values are absent."""
    found: dict[str, str] = {}
    for key, value in pairs:
        name = (key.decode("latin-1") if isinstance(key, bytes) else key).lower()
        if name in _WANTED:
            text = (value.decode("latin-1") if isinstance(value, bytes) else str(value)).strip()
            if text:
                found.setdefault(name, text)
    return found


def _deadline_s(name: str, text: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0:
        raise _bad_header(name, f"must be a number of milliseconds > 0, not {text[:40]!r}")
    return ms / 1000.0


def _bad_header(name: str, problem: str) -> APIError:
    return invalid(f"the header {name} {problem}", None, "invalid_header")
