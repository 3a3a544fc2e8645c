"""Core lists, how `serve` shares cores out among workers, and pinning a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.errors import InvalidRequestError
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.cpu_placement import format_cores, parse_cores, plan_cores, rank_cores


def test_core_lists_parse_like_taskset():
    assert parse_cores("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cores("5, 1,1") == (1, 5)
    assert format_cores(parse_cores("2-4")) == "2,3,4"
    for bad in ("", "a", "3-1", "-1", ","):
        with pytest.raises(InvalidRequestError, match="core list"):
            parse_cores(bad)


def test_one_aggregated_worker_on_two_cores_gets_both():
    plan = plan_cores([0, 1], [1])
    assert plan.reserved == ()
    assert plan.workers == ((0, 1),)


def test_a_big_machine_keeps_one_core_for_the_frontend():
    plan = plan_cores(list(range(8)), [1, 1])
    assert plan.reserved == (0,)
    assert plan.workers == ((1, 2, 3, 4), (5, 6, 7))
    assert plan_cores(list(range(8)), [4, 4]).reserved == ()      # every core is needed by a rank


def test_prefill_and_decode_on_two_cores_get_one_each_and_nothing_is_reserved():
    plan = plan_cores([0, 1], [1, 1])
    assert plan.reserved == ()
    assert plan.workers == ((0,), (1,))


def test_cores_are_shared_in_proportion_to_ranks_and_never_overlap():
    plan = plan_cores(list(range(16)), [2, 1, 1])
    assert plan.reserved == (0,)
    flat = [c for w in plan.workers for c in w]
    assert sorted(flat) == list(range(1, 16)) and len(set(flat)) == len(flat)
    assert len(plan.workers[0]) >= 2 * len(plan.workers[1]) - 1


def test_too_few_cores_pins_nothing():
    plan = plan_cores([0, 1], [2, 1])
    assert plan.workers == (None, None)


def test_reserving_every_core_is_refused():
    with pytest.raises(InvalidRequestError, match="reserve fewer"):
        plan_cores([0, 1], [1], reserved=2)


def test_tensor_parallel_ranks_split_their_workers_cores():
    assert rank_cores((4, 5, 6, 7), 2, 0) == (4, 5)
    assert rank_cores((4, 5, 6, 7), 2, 1) == (6, 7)
    assert rank_cores((3,), 2, 1) == (3,)
    cfg = EngineConfig(cpu_cores=(2, 3, 4, 5), tensor_parallel_size=2)
    assert cfg.rank_threads(1) == ((4, 5), 2)
    assert EngineConfig(num_threads=3).rank_threads(0) == (None, 3)


def test_a_worker_process_pins_every_thread_it_has():
    # A real process whose torch pool exists before it pins: every thread must move (to the
    # highest core this process may use; on a one-core machine the check is weaker, not skipped).
    core = max(os.sched_getaffinity(0))
    code = (
        "import os, torch, threading\n"
        "torch.set_num_threads(2); torch.ones(512, 512) @ torch.ones(512, 512)\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "from splitserve.services.engine.config import EngineConfig\n"
        "from splitserve.services.engine.cpu_placement import apply_rank_threads\n"
        f"apply_rank_threads(EngineConfig(cpu_cores=({core},)), 0)\n"
        "masks = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir('/proc/self/task')}\n"
        "print(masks, torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{{({core},)}} 1"
