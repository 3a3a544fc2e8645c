"""One generation request as the frontend runs it: token ids, worker sampling parameters, and what
only the frontend needs (the API for metrics, the arrival time, how to render the text)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.tracing import TraceContext


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    api: str                        # chat | completions | grpc (metrics label)
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    skip_special_tokens: bool = True      # the text of the output (workers see token ids only)
    # params.max_tokens is a cap the client set (or its API's default), not the rest of the context.
    max_tokens_from_client: bool = False
    trace_context: TraceContext | None = None   # the client's, read only when the frontend traces
    # Gateway mode: the prefill worker the endpoint picker chose (`x-prefiller-host-port`, its gRPC
    # host:port); "" lets the decode worker prefill locally.
    prefill_address: str = ""
