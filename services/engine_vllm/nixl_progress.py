"""NIXL's UCX progress thread, given a poll timeout (vLLM's NixlConnector on CPU).

NIXL's Python API creates every agent with `pthrDelay = 0` (nixl/_api.py) and vLLM's
NixlConnector keeps the progress thread on, so that thread polls with a 0 ms timeout: a busy
core per vLLM process even when idle, which on a 2-core machine halves what the model gets
(measured by bench/nixl_pd.py: decode 5 tok/s against 12-13 with a 1 ms poll). With a delay the
thread sleeps in poll(), woken by UCX's event fd. `give_progress_thread_a_poll_timeout` wraps the
bindings' agent constructor; it must run before vLLM creates its agent. bench/nixl_pd.py runs
the same patch in `vllm serve` processes through a sitecustomize.py.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

DEFAULT_POLL_US = 1000
BINDINGS = ("nixl_cu13._bindings", "nixl_cu12._bindings", "nixl_rocm._bindings")


def give_progress_thread_a_poll_timeout(delay_us: int = DEFAULT_POLL_US) -> list[str]:
    """Patch every importable NIXL binding; the names of those patched."""
    patched = []
    for name in BINDINGS:
        try:
            bindings = importlib.import_module(name)
        except Exception:          # not installed, or not loadable here (no GPU runtime)
            continue
        make = bindings.nixlAgent
        if getattr(make, "splitserve_poll_us", None) is not None:
            patched.append(name)
            continue

        def agent(agent_name, cfg, *rest, _make=make):
            if cfg.useProgThread and cfg.pthrDelay == 0:
                cfg.pthrDelay = delay_us
            return _make(agent_name, cfg, *rest)

        agent.splitserve_poll_us = delay_us
        bindings.nixlAgent = agent
        patched.append(name)
    if not patched:
        log.warning("no NIXL bindings found to patch (%s)", ", ".join(BINDINGS))
    return patched
