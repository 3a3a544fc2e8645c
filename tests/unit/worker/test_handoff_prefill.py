"""HandoffPrefill, the decode side of `--kv-connector nixl-vllm` (kv/handoff.py): which prefill
worker's handoff the request gets, when it gives up, and the trace it leaves.

The prefill workers are the fakes of conftest.py (a kv_handoff Prefill answers the worker's
`handoff` JSON); the try-each-worker loop and the tracer are the real ones. The end-to-end
path with vLLM's NixlConnector is tests/integration/vllm/test_nixl_vllm_connector.py.
"""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from splitserve.services.worker.kv.handoff import HandoffPrefill
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.tracing import Tracer

PROMPT = list(range(100, 140))


def test_a_refused_prefill_worker_is_skipped_and_the_next_ones_handoff_is_used(peers):
    async def main():
        refusing, good = peers.add("p0"), peers.add("p1")
        refusing.prefill = "refuse"
        retries = []
        outcome = await HandoffPrefill(peers, 30.0).run("r", PROMPT, SamplingParams(max_tokens=2), ["p0", "p1"],
                                                        lambda: retries.append(1))
        assert outcome.kv_handoff == {"remote_engine_id": "p1", "remote_block_ids": [0, 1]}
        assert outcome.num_failures == 1 and retries == [1]
        sent = good.prefill_requests[0]
        assert sent.kv_handoff and not sent.HasField("target") and list(sent.token_ids) == PROMPT
    asyncio.run(main())


def test_a_handoff_that_is_not_a_json_object_counts_as_a_failure(peers):
    async def main():
        peers.add("p0").handoff = [1, 2]
        outcome = await HandoffPrefill(peers, 30.0).run("r", PROMPT, SamplingParams(), ["p0"], lambda: None)
        assert outcome.kv_handoff is None and outcome.num_failures == 1      # the caller prefills locally
    asyncio.run(main())


def test_the_deadline_covers_every_attempt(peers):
    async def main():
        hung, spare = peers.add("p0"), peers.add("p1")
        hung.prefill = "hang"
        outcome = await HandoffPrefill(peers, 0.2).run("r", PROMPT, SamplingParams(), ["p0", "p1"], lambda: None)
        assert outcome.kv_handoff is None and outcome.num_failures == 1
        assert spare.prefill_requests == []           # no time was left to try it
    asyncio.run(main())


def test_each_attempt_is_a_remote_prefill_span_whose_context_reaches_the_prefill_worker(peers):
    async def main():
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = Tracer(provider, provider.get_tracer("test"))
        request_span = tracer.start_span("generate", None, "server")
        peers.add("p0").prefill = "refuse"
        good = peers.add("p1")
        await HandoffPrefill(peers, 30.0, tracer).run("r", PROMPT, SamplingParams(), ["p0", "p1"], lambda: None,
                                                      request_span)
        request_span.end()
        attempts = [s for s in exporter.get_finished_spans() if s.name == "remote_prefill"]
        assert [s.attributes["splitserve.prefill_worker.address"] for s in attempts] == ["p0", "p1"]
        assert [s.status.status_code for s in attempts] == [StatusCode.ERROR, StatusCode.UNSET]
        assert all(s.parent.span_id == request_span.get_span_context().span_id for s in attempts)
        sent = good.prefill_requests[0].trace_context.traceparent
        assert sent.split("-")[2] == format(attempts[1].context.span_id, "016x")
    asyncio.run(main())
