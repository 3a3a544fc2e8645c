"""When a request stops, as far as the engine can tell: on token ids and counts only.

The engine stops a request on EOS (unless `ignore_eos`), on one of its
`stop_token_ids`, or at `max_tokens` (the context limit is the engine's own
check). Stop strings are text, and text is the frontend's work (vLLM's split):
the frontend detokenizes, judges stop strings on the text it shows, and ends the
worker's request by closing its stream (services/text/stop_checker.py,
services/frontend/core.py). So the engine keeps no per-request stop state and
never decodes a token.
"""

from __future__ import annotations

from splitserve.services.wire.outputs import FinishReason
from splitserve.services.wire.sampling_params import SamplingParams


def token_stop_reason(params: SamplingParams, eos_token_ids: set[int], token_id: int,
                      num_output_tokens: int) -> FinishReason | None:
    """Why the request ends with `token_id`, its `num_output_tokens`-th token; None: it goes on."""
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None
