"""`VllmEngineLauncher`: a worker's vLLM engine, from splitserve's worker flags and vLLM's own.

`splitserve worker --engine vllm [worker flags] -- [vLLM engine flags]`: splitserve's engine
flags (`WorkerEngineFlags`) become `EngineArgs` defaults (`--tp` → tensor_parallel_size and
so on), and the flags after `--` are parsed by vLLM's own `EngineArgs` parser over them, so
every vLLM flag works and overrides what splitserve derived. Defaults for CPU: float32 (bf16
answers garbage on AVX2-only CPUs), `enforce_eager` (compiling takes minutes), the KV cache
from `--kv-cache-gib` (vLLM's `VLLM_CPU_KVCACHE_SPACE`, whole GiB).

`launch()` runs on a thread of the worker (it serves health meanwhile). vLLM's in-process
engine installs no signal handlers (only its engine-core *process* does), so that is safe;
the worker's own SIGTERM handling stays in charge.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from splitserve.errors import SplitserveError
from splitserve.services.engine_vllm.environment import BASE_ENV, resolve_vllm_model

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerEngineFlags:
    """splitserve's engine flags that mean something to vLLM."""

    model: str
    device: str = "cpu"
    dtype: str = "auto"
    tp: int = 1
    block_size: int | None = None      # None: vLLM's own choice (its CPU attention wants multiples of 32)
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_logprobs: int = 20
    cpu_cores: str | None = None       # VLLM_CPU_OMP_THREADS_BIND's syntax (a list per rank, '|' between)
    pinned_cores: tuple[int, ...] = ()  # the worker process's cores (--cpu-cores), all ranks'
    served_model_name: str | None = None


def engine_arg_defaults(flags: WorkerEngineFlags) -> dict[str, Any]:
    """`EngineArgs` fields splitserve derives from its own flags (vLLM flags after `--` win)."""
    on_cpu = flags.device.startswith("cpu")
    dtype = flags.dtype
    if dtype == "auto" and on_cpu:
        dtype = "float32"
    defaults: dict[str, Any] = {
        "model": resolve_vllm_model(flags.model), "dtype": dtype, "tensor_parallel_size": flags.tp,
        "max_num_batched_tokens": flags.max_num_batched_tokens,
        "max_num_seqs": flags.max_num_seqs, "max_logprobs": flags.max_logprobs,
        "enable_prefix_caching": True, "served_model_name": [flags.served_model_name or flags.model],
    }
    if flags.block_size is not None:
        defaults["block_size"] = flags.block_size
    if on_cpu:
        defaults["enforce_eager"] = True
    return defaults


def process_env(flags: WorkerEngineFlags, environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The variables vLLM reads at start-up (what the environment already sets wins)."""
    env = dict(BASE_ENV)
    if flags.device.startswith("cpu"):
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(flags.kv_cache_gib)))
        env["VLLM_CPU_OMP_THREADS_BIND"] = flags.cpu_cores or "nobind"
        if flags.pinned_cores and flags.tp == 1:
            # vLLM binds threads only in the processes of its multiprocess executor; in this
            # process it runs torch with OMP_NUM_THREADS threads (1 when unset): one per core.
            env["OMP_NUM_THREADS"] = str(len(flags.pinned_cores))
    return {k: v for k, v in env.items() if k not in environ}


def pin_process(cores: tuple[int, ...]) -> None:
    """Every thread of this process, and those it starts later, on `cores` (the worker's
    --cpu-cores): vLLM's engine, its torch threads, the worker's gRPC threads."""
    import torch

    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass                                     # the thread has exited
    if torch.get_num_threads() != len(cores):
        torch.set_num_threads(len(cores))
    log.info("vLLM worker pinned to cores %s, %d torch thread(s)", ",".join(map(str, cores)), len(cores))


def parse_engine_args(flags: WorkerEngineFlags, vllm_argv: list[str]) -> Any:
    """vLLM's `EngineArgs`: splitserve's defaults, then `vllm_argv` through vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="splitserve worker --engine vllm ... --"))
    parser.set_defaults(**engine_arg_defaults(flags))
    try:
        namespace = parser.parse_args(vllm_argv)
    except SystemExit:
        raise SplitserveError(f"vLLM refused the engine flags after --: {' '.join(vllm_argv)}") from None
    return EngineArgs.from_cli_args(namespace)


@dataclass(frozen=True, slots=True)
class VllmEngineLauncher:
    """Starts vLLM in this process (the worker's `EngineLauncher`)."""

    flags: WorkerEngineFlags
    vllm_argv: list[str] = field(default_factory=list)
    kv_events: bool = True       # republish vLLM's KV events to routers (kv_events.py)
    # A prefill or decode worker's KV connector inside vLLM: "splitserve" (kv_connector.py) or
    # "nixl-vllm" (vLLM's NixlConnector, KV handed off: services/worker/kv/handoff.py); "": none.
    kv_connector: str = ""
    side_channel_host: str = "127.0.0.1"   # nixl-vllm: where decode workers reach this one's NIXL handshake

    @property
    def model(self) -> str:
        return self.flags.model

    def launch(self):
        os.environ.update(process_env(self.flags, os.environ))
        if self.flags.pinned_cores and self.flags.device.startswith("cpu"):
            pin_process(self.flags.pinned_cores)
        from vllm.v1.engine.llm_engine import LLMEngine

        from splitserve.services.engine_vllm.engine import VllmEngine

        engine_args = parse_engine_args(self.flags, self.vllm_argv)
        endpoint = None
        if self.kv_events:
            from vllm.config import KVEventsConfig

            from splitserve.services.engine_vllm.kv_events import events_config, new_ipc_endpoint

            if engine_args.kv_events_config is not None:
                log.warning("--kv-events-config after -- is replaced: the worker subscribes to vLLM's KV events "
                            "itself and republishes them to routers")
            endpoint = new_ipc_endpoint()
            engine_args.kv_events_config = KVEventsConfig(**events_config(endpoint))
        transfers = None
        if self.kv_connector:
            if engine_args.kv_transfer_config is not None:
                log.warning("--kv-transfer-config after -- is replaced: a prefill or decode worker runs the KV "
                            "connector --kv-connector names (%s)", self.kv_connector)
            engine_args.kv_transfer_config, transfers = self._kv_transfer_config()
        from splitserve.services.engine_vllm.stat_counts import StepCounts

        log.info("starting vLLM for %s: %s", self.flags.model, engine_args)
        counts = StepCounts()
        llm = LLMEngine.from_engine_args(engine_args, stat_loggers=[counts.logger_factory()])
        name = engine_args.served_model_name
        engine = VllmEngine(llm, name[0] if isinstance(name, list) else (name or self.flags.model), step_counts=counts,
                            transfers=transfers, kv_handoff="nixl-vllm" if self.kv_connector == "nixl-vllm" else "")
        if self.kv_connector == "nixl-vllm" and self.flags.pinned_cores and self.flags.device.startswith("cpu"):
            # vLLM's NIXL worker pinned the thread that built it to the last core of the NUMA node
            # (nixl/base_worker.py); back onto this worker's cores.
            pin_process(self.flags.pinned_cores)
        if endpoint is not None:
            from splitserve.services.engine_vllm.kv_events import VllmKVEvents

            # The hashes the router computes: the block size vLLM chose, the engine's extra key.
            d = engine.describe()
            engine.attach_kv_events(VllmKVEvents(endpoint, d.block_size, d.block_hash_extra_key))
        return engine

    def _kv_transfer_config(self) -> tuple[Any, Any]:
        """(vLLM's KVTransferConfig, the TransferBook of splitserve's connector or None)."""
        from vllm.config import KVTransferConfig

        if self.kv_connector == "nixl-vllm":
            from splitserve.net import free_port
            from splitserve.services.engine_vllm.nixl_progress import give_progress_thread_a_poll_timeout

            give_progress_thread_a_poll_timeout()
            os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", self.side_channel_host)
            os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port(self.side_channel_host)))
            # On CPU the KV is read straight from vLLM's buffer (the only device NIXL allows there);
            # recompute: a read that fails is computed here, never decoded from what did not arrive.
            buffer = {"kv_buffer_device": "cpu"} if self.flags.device.startswith("cpu") else {}
            return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
                                    **buffer), None
        if self.kv_connector != "splitserve":
            raise SplitserveError(f"unknown KV connector {self.kv_connector!r} (splitserve, nixl-vllm)")
        from splitserve.services.engine_vllm import kv_connector as splitserve_connector

        return KVTransferConfig(kv_connector=splitserve_connector.CLASS_NAME,
                                kv_connector_module_path=splitserve_connector.MODULE_PATH,
                                kv_role="kv_both"), splitserve_connector.book()
