"""bench/vllm_disagg.py: each target ratio pairs runs of the same round on the `long` workload, and a
missing run leaves its ratio unknown rather than met."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import vllm_disagg  # noqa: E402


def _run(server: str, round_: int, ttft: float, itl_p99: float, workload: str = "long",
         exposed: float | None = None, layer: float | None = None) -> dict:
    return {"server": server, "workload": workload, "round": round_, "ttft_p50_s": ttft, "itl_p99_s": itl_p99,
            "exposed_transfer_ms": exposed, "layer_compute_ms": layer}


def test_ratios_pair_the_same_round_of_the_long_workload():
    runs = [_run("splitserve-connector", 1, 4.0, 0.1, exposed=2.0, layer=40.0),
            _run("nixl-connector", 1, 5.0, 0.1), _run("aggregated", 1, 3.0, 1.0),
            _run("splitserve-nixl-vllm", 1, 8.0, 0.1),
            _run("splitserve-connector", 1, 9.0, 9.0, workload="shared-prefix"),     # not a target's workload
            _run("splitserve-connector", 2, 6.0, 0.3, exposed=50.0, layer=40.0),
            _run("aggregated", 2, 3.0, 0.5)]                                        # round 2: no NIXL run
    r = vllm_disagg.ratios(runs, 2)
    assert r["ttft_p50_vs_nixl_connector"] == [0.8, None]
    assert r["ttft_p50_vs_splitserve_nixl_vllm"] == [0.5, None]
    assert r["itl_p99_vs_aggregated"] == [0.1, 0.6]
    assert r["exposed_transfer_vs_layer_compute"] == [0.05, 1.25]
    assert vllm_disagg.spread(r["itl_p99_vs_aggregated"]) == {"min": 0.1, "median": 0.35, "max": 0.6}
    assert vllm_disagg.spread([None]) == {"min": None, "median": None, "max": None}


def test_mean_per_request_comes_from_the_histogram_deltas():
    before = {"exposed_sum": 1.0, "exposed_count": 10.0}
    after = {"exposed_sum": 1.5, "exposed_count": 15.0}
    assert vllm_disagg._mean_ms(before, after, "exposed") == 100.0
    assert vllm_disagg._mean_ms(after, after, "exposed") is None        # no request in the window


def test_each_workload_sends_what_the_docstring_says():
    args = type("Args", (), {"concurrency": 4, "requests": 8})()
    w = vllm_disagg.workloads(args)
    long = w["long"]
    assert long[long.index("--input-len") + 1] == "2048" and long[long.index("--output-len") + 1] == "128"
    shared = w["shared-prefix"]
    assert shared[shared.index("--prefix-len") + 1] == "512" and shared[shared.index("--tenants") + 1] == "4"


def test_the_nixl_baseline_proxy_asks_the_prefill_for_one_token_and_its_kv():
    """bench/nixl_pd.py follows vLLM's P/D proxy: the prefill gets the request cut to one token with
    do_remote_decode, never streamed, without min_tokens (which one token could not satisfy)."""
    import nixl_pd

    body = {"model": "smollm2", "prompt": [1, 2, 3], "max_tokens": 128, "min_tokens": 128, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    pre = nixl_pd.prefill_request(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["ignore_eos"] is True
    assert "min_tokens" not in pre and "stream_options" not in pre
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 128 and body["stream"] is True            # the decode gets the original
