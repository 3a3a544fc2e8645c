"""A pinned rank's compute threads while other processes use its cores (core_sharing.py), and the
whole placement decision: which cores, how many threads, whether they follow the machine's load."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.core_sharing import (CoreSharing, CoreTimes, foreign_cores, read_core_times,
                                                     yielded_cores)
from splitserve.services.engine.cpu_placement import adapts_threads, plan_cores
from splitserve.testing.waiting import wait_until


@pytest.mark.parametrize("foreign, yielded, num_cores, expected", [
    (0.05, 0, 2, 0),     # the frontend and a light client: both cores compute
    (0.34, 0, 2, 0),
    (0.5, 0, 2, 1),      # a client taking half a core: a thread there would stall every operator
    (0.9, 0, 2, 1),      # AIPerf on a 2-core laptop
    (1.1, 0, 2, 1),      # never every core: the rank keeps one thread
    (1.2, 0, 2, 0),      # others contend for both cores anyway (an oversubscribed machine): keep both
    (1.9, 0, 2, 0),
    (1.25, 1, 2, 1),     # AIPerf's bursts once it has its core: still given up
    (1.4, 1, 2, 0),      # the machine got oversubscribed: take it back
    (6.5, 0, 8, 7),
    (7.5, 0, 8, 0),
    (0.25, 1, 2, 1),     # between the two thresholds the count stays as it is
    (0.1, 1, 2, 0),      # the client left: the thread comes back
    (0.25, 0, 2, 0),
    (1.4, 0, 8, 2),      # a core and a half taken costs two threads
    (1.3, 2, 8, 2),
    (1.1, 2, 8, 1),
    (0.9, 1, 1, 0),      # one core: nothing to give up
])
def test_threads_are_given_up_per_core_other_processes_use(foreign, yielded, num_cores, expected):
    assert yielded_cores(foreign, yielded, num_cores) == expected


class _Script:
    """CoreTimes readings that advance by `busy`/`own` CPU seconds per second of a fake clock."""

    def __init__(self):
        self.now, self.busy, self.own = 0.0, 0.0, 0.0

    def advance(self, seconds: float, busy: float, own: float) -> None:
        self.now += seconds
        self.busy += busy * seconds
        self.own += own * seconds

    def read(self, cores) -> CoreTimes:
        return CoreTimes(self.busy, self.own)


def test_the_thread_count_follows_what_other_processes_use():
    script, applied = _Script(), []
    sharing = CoreSharing((0, 1), 2, read=script.read, set_threads=applied.append, clock=lambda: script.now)
    script.advance(0.5, busy=2.0, own=1.1)      # a client takes 0.9 of a core
    sharing.before_step()                       # under a second: not measured yet
    assert applied == [] and sharing.threads == 2
    script.advance(0.5, busy=2.0, own=1.1)
    sharing.before_step()
    assert (applied, sharing.threads, round(sharing.foreign, 2)) == ([1], 1, 0.9)
    script.advance(1.0, busy=1.95, own=1.0)     # it still runs: the count stays
    sharing.before_step()
    script.advance(1.0, busy=1.05, own=1.0)     # it is gone
    sharing.before_step()
    assert applied == [1, 2] and sharing.threads == 2
    script.advance(30.0, busy=1.0, own=0.0)     # an idle spell (someone else's work): not averaged in
    sharing.before_step()
    script.advance(1.0, busy=1.0, own=1.0)      # the last second is what counts
    sharing.before_step()
    assert applied == [1, 2] and sharing.foreign == pytest.approx(0.0, abs=1e-9)


def test_the_count_is_set_for_the_thread_that_steps():
    # OpenMP keeps the thread count per thread: set from another thread it would not reach the
    # thread that runs the steps (which is why before_step runs on that thread).
    import torch

    script = _Script()
    sharing = CoreSharing((0, 1), 2, read=script.read, clock=lambda: script.now)
    seen = []

    def step_thread():
        torch.set_num_threads(2)
        torch.ones(64, 64) @ torch.ones(64, 64)
        script.advance(1.0, busy=2.0, own=1.0)
        sharing.before_step()
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    t = threading.Thread(target=step_thread)
    t.start()
    t.join()
    assert seen == [1] and sharing.threads == 1
    assert torch.get_num_threads() == before        # this thread's own count is untouched


def _burner(core: int) -> subprocess.Popen:
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.alone      # the busy process must get a share of its core to be seen
def test_another_process_on_the_core_is_measured_and_this_ones_own_time_is_not():
    core = max(os.sched_getaffinity(0))
    burner = _burner(core)
    try:
        start, t0 = read_core_times((core,)), _now()
        wait_until(lambda: _now() - t0 > 0.5 and foreign_cores(start, read_core_times((core,)), _now() - t0) > 0.25,
                   timeout=20, what="a busy process counted as foreign use of its core")
    finally:
        burner.kill()
        burner.wait()
    # This process burning its own core: its time is not foreign (at most what it left of the core).
    code = (
        "import os, time\n"
        f"os.sched_setaffinity(0, {{{core}}})\n"
        "from splitserve.services.engine.core_sharing import read_core_times, foreign_cores\n"
        f"a, t0 = read_core_times(({core},)), time.monotonic()\n"
        "while time.monotonic() - t0 < 1.0: pass\n"
        f"b, dt = read_core_times(({core},)), time.monotonic() - t0\n"
        "print((b.own_s - a.own_s) / dt, foreign_cores(a, b, dt))\n")
    own, foreign = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.split())
    assert own > 0.1 and foreign <= 1.0 - own + 0.1, (own, foreign)


def _now() -> float:
    import time

    return time.monotonic()


@pytest.mark.alone      # another test on the cores too would oversubscribe them: then nothing is given up
def test_a_pinned_engine_steps_with_one_thread_fewer_while_a_process_shares_its_cores(llama_dir):
    # A real engine pinned to this machine's first two cores, stepped on a thread of its own as
    # the worker's engine loop does, with a busy process on the second core.
    cores = sorted(os.sched_getaffinity(0))[:2]
    code = (
        "import os, sys, threading, time, torch\n"
        "from splitserve.services.engine.config import EngineConfig\n"
        "from splitserve.services.engine.engine import LLMEngine\n"
        "from splitserve.services.worker_protocol.sampling_params import SamplingParams\n"
        f"engine = LLMEngine(EngineConfig(model={str(llama_dir)!r}, cpu_cores={tuple(cores)!r}, kv_cache_gib=0.05,\n"
        "                                 cpu_yield=True))\n"
        "print('sharing', engine._core_sharing is not None, flush=True)\n"
        "seen = []\n"
        "def loop():\n"
        "    seen.append(torch.get_num_threads())\n"
        "    deadline = time.monotonic() + 60\n"
        "    while time.monotonic() < deadline:\n"
        "        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "        seen.append(torch.get_num_threads())\n"
        "        if seen[-1] == 1: return\n"
        "t = threading.Thread(target=loop); t.start(); t.join()\n"
        "print('threads', seen[0], seen[-1], flush=True)\n"
    )
    burner = _burner(cores[-1])
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    finally:
        burner.kill()
        burner.wait()
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("sharing", "threads")))
    if len(cores) < 2:            # one core: one thread, nothing to give up
        assert lines["sharing"] == "False"
        return
    assert lines["sharing"] == "True"
    assert lines["threads"] == "2 1", out.stdout       # placed with two, stepping with one


@pytest.mark.parametrize("available, ranks, reserved, cpu_yield, expected", [
    # (reserved cores, per worker: (cores, threads, adapts))
    (2, [1], None, True, ((), [((0, 1), 2, True)])),              # a laptop: both cores, given up on demand
    (2, [1], None, False, ((), [((0, 1), 2, False)])),
    (2, [1], 1, False, ((0,), [((1,), 1, False)])),               # vLLM's placement
    (2, [1, 1], None, True, ((), [((0,), 1, False), ((1,), 1, False)])),
    (4, [1], None, True, ((), [((0, 1, 2, 3), 4, True)])),
    (8, [1, 1], None, True, ((0,), [((1, 2, 3, 4), 4, True), ((5, 6, 7), 3, True)])),
    (1, [1], None, True, ((), [((0,), 1, False)])),
])
def test_the_placement_decision(available, ranks, reserved, cpu_yield, expected):
    plan = plan_cores(list(range(available)), ranks, reserved)
    got = []
    for cores in plan.workers:
        cfg = EngineConfig(cpu_cores=cores, cpu_yield=cpu_yield)
        c, threads = cfg.rank_threads(0)
        got.append((c, threads, adapts_threads(c, threads, cfg.cpu_yield)))
    assert (plan.reserved, got) == expected
