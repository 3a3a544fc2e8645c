"""Structured outputs over the disaggregated path and across a migration, with real processes.

The first token is sampled on the prefill worker under the grammar; the decode worker
replays it into its own matcher; a request migrated after a SIGKILL replays everything
forwarded so far. So every output must be, token for token, what one unbroken engine
gives, and parse and validate against its schema. The schemas are hypothesis's
(splitserve/testing/json_schemas.py), drawn the same on every run, on the random
Llama: a random model closes nothing by itself, so a broken mask cannot pass.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import jsonschema

from splitserve.testing.json_schemas import draw_schemas
from splitserve.testing.workers import wait_idle

from .conftest import DECODE_FLAGS, FRONTEND_FLAGS, MODEL_NAME, expected_outputs, make_jobs, run_killing, run_load

def _structured_jobs(n: int, seed: int, num_seeded: int):
    jobs = make_jobs(n, seed=seed, min_len=70, max_len=120, max_tokens=300, num_seeded=num_seeded)
    return [replace(j, schema=s, ignore_eos=False) for j, s in zip(jobs, draw_schemas(n))]


def _six_rows_of(schema: dict) -> dict:
    """A longer instance: six rows of `schema` with every property required (so that the
    streams are still running when a worker is killed)."""
    row = {**schema, "required": sorted(schema["properties"])}
    return {"type": "object", "properties": {"rows": {"type": "array", "items": row, "minItems": 6, "maxItems": 6}},
            "required": ["rows"], "additionalProperties": False}


def _check(outcomes, jobs, expected, front) -> None:
    errors = [(i, o.error) for i, o in enumerate(outcomes) if not o.completed]
    assert not errors, (errors, front.proc.tail(80))
    wrong = [(i, o.token_ids, want) for i, (o, want) in enumerate(zip(outcomes, expected)) if o.token_ids != want]
    assert not wrong, wrong[:3]
    for o, j in zip(outcomes, jobs):
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), j.schema)


def test_fifty_schemas_through_1p1d_then_a_sigkill_migration(cluster, llama_dir):
    jobs = _structured_jobs(50, seed=21, num_seeded=20)
    expected = expected_outputs(llama_dir, jobs)
    p0 = cluster.start_worker("p0", "prefill")
    d0 = cluster.start_worker("d0", "decode", *DECODE_FLAGS)
    d1 = cluster.start_worker("d1", "decode", *DECODE_FLAGS)
    cluster.wait_workers()
    one_decode = cluster.start_frontend("--served-model-name", MODEL_NAME, workers=[p0, d0])
    one_decode.wait_ready()
    outcomes = asyncio.run(run_load(one_decode.openai_url, jobs))
    _check(outcomes, jobs, expected, one_decode)
    assert d0.stats().num_remote_prefills == len(jobs) and p0.stats().num_prefills_served == len(jobs)

    # Both decode workers; d0 is SIGKILLed while its streams are mid-JSON. New prompts (no
    # prefix-cache hits) and longer instances.
    front = cluster.start_frontend(*FRONTEND_FLAGS)
    front.wait_ready()
    jobs = [replace(j, prompt=[5] + j.prompt, schema=_six_rows_of(j.schema), max_tokens=1500) for j in jobs[:16]]
    expected = expected_outputs(llama_dir, jobs)
    assert min(len(e) for e in expected) >= 30, [len(e) for e in expected]
    outcomes, served_by_d0 = run_killing(front, jobs, d0)
    _check(outcomes, jobs, expected, front)
    assert served_by_d0 > 0 and front.metric("splitserve_migrations_total", outcome="migrated") >= 1
    wait_idle([p0, d1], 2.0)
