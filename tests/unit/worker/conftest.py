"""A real LLMEngine on the random-weight Llama for the worker's in-process tests.

One engine per module (loading it costs about a second); each test puts its own
EngineLoop or WorkerService over it and must leave it idle (`assert_engine_idle`),
so the next test starts from an empty pool.
"""

from __future__ import annotations

import pytest

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine

NUM_KV_BLOCKS = 64          # 1024 tokens of context: room for every prompt here


@pytest.fixture(scope="module")
def engine(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=NUM_KV_BLOCKS, num_threads=1))
    try:
        yield engine
    finally:
        engine.close()


def assert_engine_idle(engine: LLMEngine) -> None:
    """The leak check: no request left and every block free (cached blocks count as free)."""
    assert not engine.has_unfinished()
    assert engine.pool.num_used_blocks == 0, engine.pool.num_used_blocks
