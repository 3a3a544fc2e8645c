"""What `splitserve serve` starts: the workers of each role, the model they load, its served name.

Pure functions of `serve`'s flags, shared by the local launcher (local.py) and the
Ray Serve target (services/ray_serve/config.py), so that both deploy the same pools.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from splitserve.errors import SplitserveError


@dataclass(slots=True, frozen=True)
class PlannedWorker:
    name: str          # e.g. prefill-0: the worker id in logs, stats and KV events
    role: str          # prefill | decode | both


def plan_workers(args: argparse.Namespace) -> list[PlannedWorker]:
    """Every worker to start, from `serve`'s flags; raises SplitserveError for contradictory flags."""
    if args.aggregated:
        if args.prefill_workers is not None or args.decode_workers is not None:
            raise SplitserveError("--prefill-workers and --decode-workers are for disaggregated serving; "
                                  "with --aggregated use --workers N")
        workers = 1 if args.workers is None else args.workers
        if workers < 1:
            raise SplitserveError("--workers must be at least 1")
        return [PlannedWorker(f"worker-{i}", "both") for i in range(workers)]
    if args.workers is not None:
        raise SplitserveError("--workers is for --aggregated serving; disaggregated serving takes "
                              "--prefill-workers N --decode-workers M")
    num_prefill = 1 if args.prefill_workers is None else args.prefill_workers
    num_decode = 1 if args.decode_workers is None else args.decode_workers
    if num_prefill < 1 or num_decode < 1:
        raise SplitserveError("--prefill-workers and --decode-workers must be at least 1 "
                              "(or use --aggregated)")
    return ([PlannedWorker(f"prefill-{i}", "prefill") for i in range(num_prefill)]
            + [PlannedWorker(f"decode-{i}", "decode") for i in range(num_decode)])


def default_threads(args: argparse.Namespace, plan: list[PlannedWorker]) -> int | None:
    """torch threads per worker process: --threads, else on CPU this machine's cores shared
    out among every rank `serve` starts (each has its own torch pool: left at torch's default,
    N ranks on C cores run N*C threads, which thrash, and loading takes several times longer)."""
    if args.threads is not None or not str(args.device).startswith("cpu"):
        return args.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, len(plan) * args.tp))


def worker_cores(args: argparse.Namespace, plan: list[PlannedWorker]) -> list[str | None]:
    """Per planned worker, the --cpu-cores `serve` gives it (None: not pinned): on CPU with
    --cpu-bind auto, cpu_placement.plan_cores over the cores this process may use (vLLM workers:
    not pinned unless --cpu-cores or --reserved-cores asks)."""
    if args.cpu_bind == "none" or args.cpu_cores or not str(args.device).startswith("cpu"):
        return [args.cpu_cores] * len(plan)
    if getattr(args, "engine", "builtin") == "vllm" and args.reserved_cores is None:
        # vLLM in the worker's process computes on one torch thread (its serving default) that the
        # OS places; pinning the worker to a core of its own measured worse (docs/engines.md: 50-52
        # against 77-84 tok/s at concurrency 16 on 2 cores): its gRPC threads then share that core.
        return [None] * len(plan)
    from splitserve.services.engine.cpu_placement import available_cores, format_cores, plan_cores

    placed = plan_cores(available_cores(), [args.tp] * len(plan), args.reserved_cores)
    return [format_cores(c) if c else None for c in placed.workers]


def default_served_name(model: str) -> str | None:
    """Clients ask for the model by the name the operator typed: `--model smollm2` serves "smollm2"."""
    if not model.strip().lower().startswith("smollm2"):
        return None          # a folder or file: the workers report its name
    from splitserve.checkpoints.model_source import SMOLLM2_NAMES

    return model.strip() if model.strip().lower() in SMOLLM2_NAMES else None


def resolve_model(name: str, say=lambda line: None) -> str:
    """The folder the workers load: the shipped SmolLM2 is converted once into the cache here, so
    that the workers do not each convert it; anything else is passed on as typed."""
    if not name.strip().lower().startswith("smollm2"):
        return name          # a folder or a file: the workers open it (no torch import here)
    from splitserve.checkpoints.model_source import SMOLLM2_NAMES
    from splitserve.services.engine.loading.smollm2 import resolve_smollm2

    if name.strip().lower() in SMOLLM2_NAMES:
        say("preparing the shipped SmolLM2-135M-Instruct (converted once into the cache)...")
        return str(resolve_smollm2())
    return name


# -- serve --autoscale -------------------------------------------------------------------------

AUTOSCALE_FLAGS = {"max_workers": "--max-workers", "slo_ttft_p90_ms": "--slo-ttft-p90-ms",
                   "slo_itl_p90_ms": "--slo-itl-p90-ms", "autoscale_interval": "--autoscale-interval",
                   "autoscale_cooldown": "--autoscale-cooldown", "autoscale_mode": "--autoscale-mode"}
AUTOSCALE_DEFAULTS = {"max_workers": 4, "slo_ttft_p90_ms": 1000.0, "slo_itl_p90_ms": 100.0,
                      "autoscale_interval": 10.0, "autoscale_cooldown": 120.0, "autoscale_mode": "auto"}
AUTOSCALE_MODES = ("auto", "fixed")


@dataclass(slots=True, frozen=True)
class AutoscaleSettings:
    max_workers: int
    ttft_p90_s: float
    itl_p90_s: float
    interval_s: float
    cooldown_s: float
    switch_modes: bool = True       # --autoscale-mode auto: the planner may switch aggregated <-> disaggregated

    @property
    def may_switch_modes(self) -> bool:
        """The planner may switch modes: `--autoscale-mode auto` with places for two workers."""
        return self.switch_modes and self.max_workers >= 2


def process_role(role: str, settings: AutoscaleSettings | None) -> str:
    """The role a worker's process starts in for a pool `role` (both | prefill | decode).

    Where the planner may switch modes, an aggregated worker starts as a decode worker: one
    whose requests name no prefill worker prefills its own prompts on the same path as an
    aggregated worker (worker/service.py), so a switch moves it between the aggregated and the
    decode pool in place instead of replacing it (local_scaling.py). Its only extra is the KV
    transfer agent, ~0.5 s of its start.
    """
    if role == "both" and settings is not None and settings.may_switch_modes:
        return "decode"
    return role


def autoscale_settings(args: argparse.Namespace, plan: list[PlannedWorker]) -> AutoscaleSettings | None:
    """`serve --autoscale`'s settings (None without --autoscale), defaults filled in; raises
    SplitserveError for an autoscaling flag without --autoscale and for values that contradict."""
    given = {k: getattr(args, k, None) for k in AUTOSCALE_FLAGS}
    if not getattr(args, "autoscale", False):
        stray = [AUTOSCALE_FLAGS[k] for k, v in given.items() if v is not None]
        if stray:
            raise SplitserveError(f"{', '.join(stray)} only appl{'y' if len(stray) > 1 else 'ies'} with --autoscale")
        return None
    v = {k: AUTOSCALE_DEFAULTS[k] if given[k] is None else given[k] for k in AUTOSCALE_FLAGS}
    least = 1 if args.aggregated else 2
    if v["max_workers"] < max(least, len(plan)):
        start = (f"--workers {len(plan)}" if args.aggregated else
                 f"{sum(w.role == 'prefill' for w in plan)} prefill and {sum(w.role == 'decode' for w in plan)} "
                 f"decode workers")
        raise SplitserveError(f"--max-workers {v['max_workers']} is below the workers serve starts with ({start})"
                              + ("" if args.aggregated else "; disaggregated serving needs at least 2"))
    if v["slo_ttft_p90_ms"] <= 0 or v["slo_itl_p90_ms"] <= 0:
        raise SplitserveError("--slo-ttft-p90-ms and --slo-itl-p90-ms must be > 0")
    if v["autoscale_interval"] <= 0 or v["autoscale_cooldown"] < 0:
        raise SplitserveError("--autoscale-interval must be > 0 and --autoscale-cooldown >= 0")
    if v["autoscale_mode"] not in AUTOSCALE_MODES:
        raise SplitserveError(f"--autoscale-mode must be one of {', '.join(AUTOSCALE_MODES)}")
    return AutoscaleSettings(int(v["max_workers"]), v["slo_ttft_p90_ms"] / 1e3, v["slo_itl_p90_ms"] / 1e3,
                             float(v["autoscale_interval"]), float(v["autoscale_cooldown"]),
                             v["autoscale_mode"] == "auto")


def worker_slots(plan: list[PlannedWorker], max_workers: int) -> list[PlannedWorker]:
    """The plan padded to `max_workers` places (`serve --autoscale`): cores and threads are shared
    out over every worker that may run at once, and a worker started later takes a free place's."""
    return plan + [PlannedWorker(f"slot-{i}", "both") for i in range(len(plan), max_workers)]
