"""bench/peer_clients.py: AIPerf's results as peers.py reads them, from a real AIPerf export.

The fixture is the `profile_export_aiperf.json` of a real `aiperf profile` run (AIPerf 0.13.0, the
pinned version) against `splitserve serve --aggregated` on the shipped SmolLM2, made with
`aiperf_command`'s flags: 2 requests, 32 prompt tokens, 8 output tokens, concurrency 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import peer_clients  # noqa: E402
import peers  # noqa: E402

EXPORT = Path(__file__).parent / "fixtures" / "aiperf-0.13.0-profile_export_aiperf.json"


def test_a_real_aiperf_export_is_read_in_seconds_and_tokens_per_second():
    s = peer_clients.parse_aiperf_export(EXPORT)
    assert (s.completed, s.errors) == (2, 0)
    assert s.output_tokens_per_s == pytest.approx(2.2320793359888853)
    assert s.duration_s == pytest.approx(7.154084096)
    assert s.ttft_p50_s == pytest.approx(1.602813907)
    assert s.ttft_p99_s == pytest.approx(2.313894557)
    assert s.itl_p50_s == pytest.approx(0.2811367144285714)
    assert s.itl_p99_s == pytest.approx(0.3826964416485714)


def test_the_pinned_version_made_the_fixture_and_the_command_asks_for_the_same_work(tmp_path):
    import json

    export = json.loads(EXPORT.read_text())
    assert export["aiperf_version"] == peer_clients.AIPERF_VERSION
    work = peer_clients.Workload("http://127.0.0.1:8000", "smollm2", "/models/smollm2", 256, 128, 16, 32, 0)
    cmd = peer_clients.aiperf_command(Path("aiperf"), work, tmp_path)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("--concurrency"), flag("--request-count"), flag("--isl"), flag("--prompt-output-tokens-mean"),
            flag("--prompt-input-tokens-stddev"), flag("--prompt-output-tokens-stddev")) == (
        "16", "32", "256", "128", "0", "0")
    assert "--streaming" in cmd and flag("--endpoint-type") == "chat"
    extras = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--extra-inputs"]
    assert extras == ["ignore_eos:true", "min_tokens:128"]
    recorded = export["input_config"]
    assert recorded["endpoint"]["extra"] == {"ignore_eos": True, "min_tokens": 8}
    assert recorded["phases"][0]["concurrency"] == 1 and recorded["endpoint"]["streaming"] is True


def test_an_export_with_errors_counts_them(tmp_path):
    import json

    export = json.loads(EXPORT.read_text())
    export["error_summary"] = [{"error_details": {"code": 400, "message": "bad"}, "count": 3}]
    path = tmp_path / "e.json"
    path.write_text(json.dumps(export))
    assert peer_clients.parse_aiperf_export(path).errors == 3


def _run(server, client, round_, conc, tok_s):
    return peers.RunResult(server=server, client=client, round=round_, input_len=256, output_len=128,
                           concurrency=conc, requests=4, completed=4, errors=0, duration_s=1.0,
                           output_tokens_per_s=tok_s, ttft_p50_s=0.5, ttft_p99_s=0.6, itl_p50_s=0.05,
                           itl_p99_s=0.06, foreign_cores=0.0, server_cores=1.9, client_cores=0.9,
                           loadavg_1m=2.0, attempt=0)


def test_ratios_are_per_client_and_round_and_summarised_over_rounds():
    results = [_run("vllm", "aiperf", 1, 1, 10.0), _run("splitserve-agg", "aiperf", 1, 1, 12.0),
               _run("vllm", "aiperf", 2, 1, 20.0), _run("splitserve-agg", "aiperf", 2, 1, 18.0),
               _run("vllm", "aiperf", 3, 1, 10.0), _run("splitserve-agg", "aiperf", 3, 1, 11.0),
               _run("vllm", "splitserve-bench", 1, 1, 10.0), _run("splitserve-agg", "splitserve-bench", 1, 1, 15.0)]
    ratios = peers.compare(results, "vllm")
    pooled = peers.over_rounds(ratios, ("server", "client", "input_len", "concurrency"), ("tokens_per_s_ratio",))
    aiperf = next(r for r in pooled if r["client"] == "aiperf")["tokens_per_s_ratio"]
    assert (aiperf["min"], aiperf["median"], aiperf["max"], aiperf["n"]) == pytest.approx((0.9, 1.1, 1.2, 3))
    light = next(r for r in pooled if r["client"] == "splitserve-bench")["tokens_per_s_ratio"]
    assert light["median"] == pytest.approx(1.5) and light["n"] == 1
    met = peers.targets(ratios)
    assert met["aiperf_tokens_per_s_c1_ge_1.0"] == {"ratio": pytest.approx(1.1), "met": True}
    assert met["tokens_per_s_c1_ge_1.0"]["met"] is True and met["aiperf_tokens_per_s_c16_ge_1.0"]["met"] is None
