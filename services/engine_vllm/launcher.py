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
    cpu_cores: str | None = None
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
    return {k: v for k, v in env.items() if k not in environ}


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
    kv_events: Any = None        # a kv_events.VllmKVEvents, or None: no KV events

    @property
    def model(self) -> str:
        return self.flags.model

    def launch(self):
        os.environ.update(process_env(self.flags, os.environ))
        from vllm.v1.engine.llm_engine import LLMEngine

        from splitserve.services.engine_vllm.engine import VllmEngine

        engine_args = parse_engine_args(self.flags, self.vllm_argv)
        if self.kv_events is not None:
            from vllm.config import KVEventsConfig

            engine_args.kv_events_config = KVEventsConfig(**self.kv_events.engine_config())
        log.info("starting vLLM for %s: %s", self.flags.model, engine_args)
        llm = LLMEngine.from_engine_args(engine_args)
        name = engine_args.served_model_name
        return VllmEngine(llm, name[0] if isinstance(name, list) else (name or self.flags.model), self.kv_events)
