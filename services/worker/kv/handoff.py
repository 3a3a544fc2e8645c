"""Disaggregated prefill where the engines move the KV themselves (`--kv-connector nixl-vllm`).

With vLLM's own NixlConnector (engine_api/contract.py `KVHandoffEngine`) the flow is vLLM's,
not splitserve's push into reserved blocks (remote_prefill.py / prefill_server.py):

1. The decode worker calls Prefill with `kv_handoff` set and no target: nothing is reserved.
2. The prefill worker computes the prompt and one token as a request of its engine's connector
   (`add_handoff_prefill`); vLLM keeps its blocks for the decode worker to read, on a lease, and
   answers with the connector's `kv_transfer_params`, returned as JSON.
3. The decode worker adds the request with those params (`add_handed_off`): vLLM reads the KV
   over NIXL, then computes the last prompt token and samples the first token itself. A read
   that fails is recomputed by vLLM (kv_load_failure_policy recompute), never decoded.

A Prefill call that fails tries the next prefill worker, then the decode worker prefills
locally, within the same deadline as splitserve's own flow (`--prefill-timeout`). What this
flow lacks, by vLLM's design: the KV moves only after the whole prefill; the prefill worker's
blocks are held until the decode worker reads them or the lease runs out (a decode worker
that never reads costs the prefill worker those blocks for the lease); transfer integrity is
not checked beyond NIXL's.

`HandoffTransfer` stands in the worker for kvtransfer's sender and receiver, which such a
worker has none of: it names the connector (Describe's transfer backend and layout, so the
router pairs only workers with the same one) and refuses splitserve's own transfer calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitserve.kvtransfer.sender_receiver import (LayerReady, TransferEndpoint, TransferError, TransferGrant,
                                                   TransferNotWiredError, TransferTarget)
from splitserve.proto.v1 import worker_pb2
from splitserve.services.worker.engine_loop import EngineLoop
from splitserve.services.worker.kv.remote_prefill import (PeerChannels, describe_failure, prompt_logprobs_of,
                                                          send_trace_context, try_prefill_workers)
from splitserve.services.worker_protocol.outputs import FinishReason, RequestOutput, SampledToken
from splitserve.services.worker_protocol.proto_conversion import params_to_proto
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.tracing import Tracer

log = logging.getLogger(__name__)


class HandoffTransfer:
    """A KV-handoff worker's stand-in for kvtransfer's sender and receiver (see the module doc)."""

    def __init__(self, connector: str, model_key: bytes):
        self.backend = connector
        self._layout = f"handoff:{connector}:".encode() + model_key

    def _refuse(self) -> TransferNotWiredError:
        return TransferNotWiredError(f"this worker's engine moves KV itself ({self.backend}); splitserve's "
                                     "KV transfer is not wired")

    def endpoint(self) -> TransferEndpoint:
        return TransferEndpoint("", b"", self._layout)

    def expect(self, request_id: str, block_ids: list[int], ttl_s: float) -> TransferGrant:
        raise self._refuse()

    async def wait_complete(self, request_id: str) -> bytes:
        raise self._refuse()

    def release(self, request_id: str) -> None:
        pass

    def num_open(self) -> int:
        return 0

    def begin(self, request_id: str, target: TransferTarget, num_prompt_tokens: int) -> None:
        raise self._refuse()

    def on_layer_ready(self, ready: LayerReady) -> None:
        pass

    async def finish(self, request_id: str, payload: bytes) -> None:
        raise self._refuse()

    def abandon(self, request_id: str) -> None:
        pass

    async def fence(self, request_id: str, timeout_s: float) -> bool:
        return True                     # splitserve never writes here

    def close(self) -> None:
        pass


async def serve_handoff_prefill(loop: EngineLoop, request_id: str, token_ids: list[int],
                                params: SamplingParams) -> RequestOutput:
    """Prefill side: the PREFILL_DONE output, with the engine's `kv_handoff`."""
    last = None
    async for out in loop.stream(request_id, lambda e: e.add_handoff_prefill(request_id, token_ids, params)):
        last = out
    if last is None or last.finish_reason is not FinishReason.PREFILL_DONE or not last.kv_handoff:
        raise TransferError(f"prefill of {request_id!r} ended without the connector's handoff")
    return last


@dataclass(slots=True)
class HandoffOutcome:
    """How the Prefill calls ended: the connector's handoff, or None (prefill locally)."""

    kv_handoff: dict | None
    num_failures: int
    prompt_logprobs: list[SampledToken] | None = None


@dataclass(slots=True)
class HandoffPrefill:
    """Decode side: a prefill worker's handoff for the prompt, trying each in turn."""

    peers: PeerChannels
    timeout_s: float               # every attempt together
    tracer: Tracer | None = None   # None: tracing is off; else a `remote_prefill` span per attempt

    async def run(self, request_id: str, token_ids: list[int], params: SamplingParams, addresses: list[str],
                  on_retry: Callable[[], None], span=None) -> HandoffOutcome:
        """`span`: the request's span (request_tracing.py), parent of each attempt's."""
        clock = asyncio.get_running_loop().time

        async def attempt(address: str, left: float, index: int) -> HandoffOutcome:
            return await self._attempt(request_id, token_ids, params, address, left, index, span)
        outcome, failures = await try_prefill_workers(request_id, addresses, clock() + self.timeout_s, clock,
                                                      on_retry, attempt,
                                                      (grpc.aio.AioRpcError, TransferError, ValueError))
        if outcome is None:
            return HandoffOutcome(None, failures)
        outcome.num_failures = failures
        return outcome

    async def _attempt(self, request_id: str, token_ids: list[int], params: SamplingParams, address: str,
                       timeout_s: float, index: int, span) -> HandoffOutcome:
        call = None if self.tracer is None else self.tracer.start_span("remote_prefill", span, "client", {
            "splitserve.prefill_worker.address": address, "splitserve.prefill.attempt": index,
            "splitserve.kv_transfer.connector": "handoff"})
        request = worker_pb2.PrefillRequest(request_id=request_id, token_ids=token_ids,
                                            params=params_to_proto(params), cache_salt=params.cache_salt,
                                            kv_handoff=True)
        try:
            send_trace_context(self.tracer, call, request)
            response = await self.peers.stub(address).Prefill(request, timeout=timeout_s)
            handoff = json.loads(response.kv_transfer_params_json)
            if not isinstance(handoff, dict):
                raise TransferError(f"{address} answered a handoff that is not a JSON object")
            if call is not None:
                call.set_attribute("splitserve.prefill_worker.num_cached_tokens", response.num_cached_tokens)
        except BaseException as exc:
            if call is not None:
                self.tracer.fail(call, describe_failure(exc))
            raise
        finally:
            if call is not None:
                call.end()
        return HandoffOutcome(handoff, 0, prompt_logprobs_of(params, response))
