"""The Ray Serve target's tests, run in a network namespace of their own.

The cases (ray_cases.py, which pytest does not collect by itself) run in a child pytest inside
`unshare -n` (splitserve/testing/ray_netns.py). Ray is started once for all cases (about 14 s
and 1.1 GiB here). This test passes when every case passes, shows the child's report, and
checks that no process of that Ray outlives it.
"""

from __future__ import annotations

from pathlib import Path

from splitserve.testing.ray_netns import run_ray_cases

ROOT = Path(__file__).resolve().parents[3]
CASES = Path(__file__).with_name("ray_cases.py")
TIMEOUT_S = 300


def test_ray_serve_cases_in_a_network_namespace():
    run_ray_cases(CASES, ROOT, TIMEOUT_S)
