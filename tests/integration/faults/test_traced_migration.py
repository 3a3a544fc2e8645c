"""A migration in the trace (issue 37): a decode worker SIGKILLed mid-stream, and the client's
trace shows the broken worker call, a `migration` span naming the worker and the tokens already
forwarded, and the call that finished the request, all below one `llm_request` whose usage is
the response's; the worker that finished it (aggregated: it prefills itself) adds its `generate`
span with `prefill` and `decode` below that call."""

from __future__ import annotations

import secrets
import signal

import openai

from splitserve.testing.models import random_prompt
from splitserve.testing.otlp_collector import OtlpCollector
from splitserve.testing.waiting import wait_until

from .conftest import FRONTEND_FLAGS

MAX_TOKENS = 200          # a long stream: the kill after 3 tokens lands well before its end
SPAN_STATUS_ERROR = 2


def test_a_migrated_request_shows_its_migration_in_the_clients_trace(cluster):
    collector = OtlpCollector.start()
    try:
        tracing, env = ("--otlp-traces-endpoint", collector.endpoint), {"OTEL_BSP_SCHEDULE_DELAY": "100"}
        workers = [cluster.start_worker(f"w{i}", "both", *tracing, env=env) for i in range(2)]
        cluster.wait_workers()
        front = cluster.start_frontend(*FRONTEND_FLAGS, *tracing, env=env)
        front.wait_ready()
        trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
        client = openai.OpenAI(base_url=front.openai_url, api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(
            model="llama", prompt=random_prompt(9, 40), max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"traceparent": f"00-{trace_id}-{client_span_id}-01"})
        victim, usage, num_seen = None, None, 0
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            num_seen += sum(1 for c in chunk.choices if c.text)
            if victim is None and num_seen >= 3:
                victim = next(w for w in workers if w.stats().num_running)
                victim.proc.process.send_signal(signal.SIGKILL)
        assert victim is not None and usage is not None and usage.completion_tokens == MAX_TOKENS

        def whole():
            spans = collector.trace(trace_id)
            names = [s.name for s in spans]
            return spans if names.count("worker_call") == 2 and {"llm_request", "generate", "decode"} <= set(names) \
                else None
        spans = wait_until(whole, timeout=30, what="the migrated request's trace",
                           details=lambda: [(s.name, s.parent_span_id) for s in collector.trace(trace_id)])
        [root] = [s for s in spans if s.name == "llm_request"]
        [migration] = [s for s in spans if s.name == "migration"]
        broken, finished = sorted((s for s in spans if s.name == "worker_call"),
                                  key=lambda s: s.attributes["splitserve.attempt.id"].count(".m"))
        assert root.parent_span_id == client_span_id
        assert {migration.parent_span_id, broken.parent_span_id, finished.parent_span_id} == {root.span_id}
        assert migration.attributes["splitserve.migration.from_worker_id"] == victim.name
        assert migration.attributes["splitserve.migration.num_forwarded_tokens"] >= 3
        assert broken.attributes["splitserve.worker.id"] == victim.name and broken.status_code == SPAN_STATUS_ERROR
        assert finished.attributes["splitserve.worker.id"] != victim.name and finished.status_code != SPAN_STATUS_ERROR
        assert finished.attributes["splitserve.attempt.id"].endswith(".m1")
        assert root.attributes["splitserve.migrations"] == 1
        assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
        assert root.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        # The killed worker exported nothing more; the other one's spans continue the second call.
        [generate] = [s for s in spans if s.name == "generate"]
        assert generate.instance == finished.attributes["splitserve.worker.id"]
        assert generate.parent_span_id == finished.span_id
        assert generate.attributes["splitserve.prefill.remote"] is False
        phases = {s.name: s for s in spans if s.parent_span_id == generate.span_id}
        assert set(phases) == {"prefill", "decode"}
        forwarded = migration.attributes["splitserve.migration.num_forwarded_tokens"]
        assert generate.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens + forwarded
        assert generate.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS - forwarded
    finally:
        collector.stop()
