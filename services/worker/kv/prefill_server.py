"""Prefill side of a disaggregated request: serve one Prefill call (DESIGN section 2).

A decode worker reserved blocks for a prompt and sends the prompt here with its
grant (`TransferTarget`). `serve_prefill` runs the prompt as a prefill-only
request whose per-layer callback is the sender, so each layer's KV is pushed
while the next layer computes; then it flushes the transfer with the first token
as the completion notification's payload.

The engine leaves a prefill-only request's blocks to the transfer when it
finishes (scheduler.transfer_owned: the sender's writes read them); whatever
the outcome, `serve_prefill` gives them back with `release_transfer` once the
send is over, so a failed or cancelled Prefill leaves no block behind. Its
work is bounded by the receiver's grant (plus GRANT_GRACE_S): past it the
receiver refuses the writes anyway, and a receiver that vanished without
closing the connection cannot keep this worker's blocks held.

The decode half is remote_prefill.py.
"""

from __future__ import annotations

import asyncio
import time

from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.tracing import GenAI, Tracer

from splitserve.services.worker.output_messages import encode_first_token
from splitserve.services.worker.engine_loop import EngineLoop
from splitserve.kvtransfer.sender_receiver import GRANT_GRACE_S, KVSender, TransferError, TransferTarget
from splitserve.services.worker_protocol.outputs import FinishReason, RequestOutput, SampledToken


def grant_time_left(target: TransferTarget) -> float | None:
    """Seconds until the sender must give the request up (None: the grant has no deadline)."""
    grant = target.grant
    if grant is None or grant.deadline_unix <= 0:
        return None
    return grant.deadline_unix - time.time() + GRANT_GRACE_S


async def serve_prefill(loop: EngineLoop, sender: KVSender, request_id: str, token_ids: list[int],
                        params: SamplingParams, target: TransferTarget, tracer: Tracer | None = None,
                        span=None) -> RequestOutput:
    """Compute the prompt, pushing each layer to `target`; returns the first-token output.

    Raises TransferError when the transfer fails or the grant runs out first; the blocks
    are released in every case. `span`: the Prefill call's (request_tracing.py), under which
    the transfer gets a `kv_transfer` span.
    """
    sender.begin(request_id, target, len(token_ids))
    transfer = None if tracer is None else tracer.start_span("kv_transfer", span, attributes={
        "splitserve.kv_transfer.backend": sender.backend,
        "splitserve.kv_transfer.destination": target.endpoint.agent_name,
        "splitserve.kv_transfer.num_blocks": len(target.block_ids) - target.num_cached_blocks,
        "splitserve.kv_transfer.num_cached_blocks": target.num_cached_blocks,
        "splitserve.kv_transfer.num_destination_ranks": 1 + len(target.endpoint.other_ranks)})
    try:
        async with asyncio.timeout(grant_time_left(target)):
            last = None
            start = lambda e: e.add_request(request_id, token_ids, params, prefill_only=True,  # noqa: E731
                                            on_layer_done=sender.on_layer_ready)
            async for out in loop.stream(request_id, start):
                last = out
            if last is None or last.finish_reason is not FinishReason.PREFILL_DONE:
                raise TransferError(f"prefill of {request_id!r} ended without a first token")
            token = last.logprobs[0] if last.logprobs else SampledToken(last.new_token_ids[0])
            await sender.finish(request_id, encode_first_token(token))
        if span is not None:
            span.set_attributes({GenAI.USAGE_OUTPUT_TOKENS: 1, "splitserve.num_cached_tokens": last.num_cached_tokens})
        return last
    except TimeoutError:
        sender.abandon(request_id)
        error = TransferError(f"prefill of {request_id!r}: the receiver's grant expired before the "
                              "transfer completed")
        if transfer is not None:
            tracer.fail(transfer, error)
        raise error from None
    except BaseException as exc:
        sender.abandon(request_id)
        if transfer is not None:
            tracer.fail(transfer, exc)
        raise
    finally:
        loop.post(lambda e: e.release_transfer(request_id))
        if transfer is not None:
            transfer.end()
