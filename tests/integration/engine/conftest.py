"""Every test of a module with an `engine` fixture ends with that engine idle: nothing running,
every block back in the pool (a leak shows at the test that made it)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def pool_is_idle_after(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert not eng.has_unfinished()
        assert all(c == 0 for c in eng.pool.ref_counts)
        assert eng.pool.num_free_blocks == eng.pool.num_blocks
