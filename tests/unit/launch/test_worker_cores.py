"""The --cpu-cores `serve` gives each worker it starts."""

from __future__ import annotations

import argparse
from unittest import mock

import pytest

from splitserve.services.launch.children import worker_argv
from splitserve.services.launch.topology import PlannedWorker, worker_cores

PLAN_1P1D = [PlannedWorker("prefill-0", "prefill"), PlannedWorker("decode-0", "decode")]


def _args(**kw) -> argparse.Namespace:
    base = dict(cpu_bind="auto", cpu_cores=None, device="cpu", tp=1, reserved_cores=None)
    return argparse.Namespace(**{**base, **kw})


def test_auto_binds_each_worker_to_its_own_cores():
    with mock.patch("splitserve.services.engine.cpu_placement.available_cores", return_value=[0, 1, 2, 3]):
        assert worker_cores(_args(), PLAN_1P1D) == ["0,1", "2,3"]
        assert worker_cores(_args(reserved_cores=1), PLAN_1P1D) == ["1,2", "3"]


def test_vllm_workers_are_not_pinned_unless_asked():
    one = [PlannedWorker("worker-0", "both")]
    with mock.patch("splitserve.services.engine.cpu_placement.available_cores", return_value=[0, 1]):
        assert worker_cores(_args(engine="vllm"), one) == [None]          # vLLM's one torch thread, placed by the OS
        assert worker_cores(_args(engine="builtin"), one) == ["0,1"]
        assert worker_cores(_args(engine="vllm", reserved_cores=1), one) == ["1"]
        assert worker_cores(_args(engine="vllm", cpu_cores="0"), one) == ["0"]


def test_none_cuda_or_an_explicit_list_leave_placement_to_the_user():
    assert worker_cores(_args(cpu_bind="none"), PLAN_1P1D) == [None, None]
    assert worker_cores(_args(device="cuda"), PLAN_1P1D) == [None, None]
    assert worker_cores(_args(cpu_cores="0-1"), PLAN_1P1D) == ["0-1", "0-1"]


def test_the_worker_command_line_carries_its_cores():
    args = argparse.Namespace(device="cpu", dtype="auto", tp=1, block_size=16, kv_cache_gib=1.0,
                              max_num_batched_tokens=2048, max_num_seqs=64, max_logprobs=20, threads=None,
                              attention_backend="auto",
                              transfer="auto", cpu_yield="auto",
                              remote_prefill_threshold=64, prefill_timeout=30.0, tls_ca=None,
                              tls_internal_cert=None, kv_host_gib=0.0, kv_disk_gib=0.0, kv_disk_path=None,
                              otlp_traces_endpoint=None)
    argv = worker_argv(args, "decode-0", "decode", 5000, "m", "3")
    assert argv[argv.index("--cpu-cores") + 1] == "3"
    assert "--cpu-cores" not in worker_argv(args, "decode-0", "decode", 5000, "m")


def test_the_attention_backend_reaches_every_worker():
    args = argparse.Namespace(device="cpu", dtype="auto", tp=1, block_size=16, kv_cache_gib=1.0,
                              max_num_batched_tokens=2048, max_num_seqs=64, max_logprobs=20, threads=None,
                              cpu_yield="auto",
                              attention_backend="gather", transfer="auto", remote_prefill_threshold=64,
                              prefill_timeout=30.0, tls_ca=None, tls_internal_cert=None,
                              kv_host_gib=0.0, kv_disk_gib=0.0, kv_disk_path=None, otlp_traces_endpoint=None)
    for role in ("prefill", "decode", "both"):
        argv = worker_argv(args, "w", role, 5000, "m")
        assert argv[argv.index("--attention-backend") + 1] == "gather"


def test_kv_tiers_reach_every_worker_each_with_its_own_disk_folder():
    from splitserve.services.cli.parsers import build_parser

    args = build_parser().parse_args(["serve", "--kv-host-gib", "2", "--kv-disk-gib", "8",
                                      "--kv-disk-path", "/var/kv"])
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        argv = worker_argv(args, name, role, 5000, "m")
        assert argv[argv.index("--kv-host-gib") + 1] == "2.0"
        assert argv[argv.index("--kv-disk-gib") + 1] == "8.0"
        assert argv[argv.index("--kv-disk-path") + 1] == f"/var/kv/{name}"
    off = worker_argv(build_parser().parse_args(["serve"]), "w", "both", 5000, "m")
    assert "--kv-host-gib" not in off and "--kv-disk-path" not in off


def test_tier_credit_reaches_the_frontend_and_bad_values_are_refused(capsys):
    import pytest

    from splitserve.services.cli.parsers import build_parser
    from splitserve.services.launch.children import frontend_argv
    from splitserve.services.launch.topology import PlannedWorker

    plan = [PlannedWorker("w", "both")]
    args = build_parser().parse_args(["serve", "--kv-tier-credit", "host=0.8,disk=0.3"])
    argv = frontend_argv(args, "m", "127.0.0.1", 8000, 0, ["127.0.0.1:1"], plan)
    assert argv[argv.index("--kv-tier-credit") + 1] == "host=0.8,disk=0.3"
    assert build_parser().parse_args(["frontend", *argv]).kv_tier_credit == {"host": 0.8, "disk": 0.3}
    plain = frontend_argv(build_parser().parse_args(["serve"]), "m", "127.0.0.1", 8000, 0, ["127.0.0.1:1"], plan)
    assert "--kv-tier-credit" not in plain
    for bad in ("host=1.5", "device=0.5", "host"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--kv-tier-credit", bad])
        assert "want TIER=SHARE" in capsys.readouterr().err


def test_max_logprobs_reaches_every_worker():
    from splitserve.services.cli.parsers import build_parser

    args = build_parser().parse_args(["serve", "--max-logprobs", "-1"])
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("worker-0", "both")):
        argv = worker_argv(args, name, role, 5000, "m")
        assert argv[argv.index("--max-logprobs") + 1] == "-1"


def test_cpu_yield_reaches_every_worker_and_its_engine():
    from splitserve.services.cli.commands import _engine_config
    from splitserve.services.cli.parsers import build_parser

    parser = build_parser()
    for given, expected in ((["--cpu-yield", "auto"], True), ([], False)):    # off by default (bench/README.md)
        argv = worker_argv(parser.parse_args(["serve", *given]), "w", "both", 5000, "m", "0,1")
        worker = parser.parse_args(argv)
        assert worker.cpu_yield == ("auto" if given else "off")
        assert _engine_config(worker).cpu_yield is expected
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--cpu-yield", "sometimes"])
