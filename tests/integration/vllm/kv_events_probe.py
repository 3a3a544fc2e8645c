"""Run in the vLLM engine's environment: a real in-process vLLM publishes its KV events, and
`VllmKVEvents` translates them; prints the phases' splitserve events as one JSON document.

Usage: <engine python> kv_events_probe.py MODEL_DIR WORK_DIR. tests/integration/vllm/test_kv_events.py
runs it and checks the hashes against splitserve/block_hashes.py.

Phases (each waits until vLLM's publisher has sent its batches and the subscriber has applied them):
  late     a request runs before the subscriber starts: its batches come back by replay
  shared   two prompts sharing a prefix
  salted   most of the first prompt again, with a cache_salt
  evict    distinct prompts that overflow the small pool: earlier blocks are removed
  reset    reset_prefix_cache(): AllBlocksCleared
  preempt  four long sequences that outgrow the pool together: vLLM preempts, and the worker's
           stat logger (stat_counts.py) counts what vLLM's own Prometheus counter counts
A second subscriber without a replay socket starts after "late": its first batch is past 0, so it
resyncs (an AllCleared first).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def import_this_checkout() -> None:
    """The engine environment's splitserve is an editable install of some checkout; import this
    one's instead (pyproject.toml's package-dir maps the import names to folders)."""
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

    class CheckoutFinder:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name not in dirs:
                return None
            folder = REPO / dirs[name]
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, CheckoutFinder)


import_this_checkout()

from vllm import SamplingParams  # noqa: E402
from vllm.config.kv_events import KVEventsConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.llm_engine import LLMEngine  # noqa: E402

from splitserve.services.engine_api.kv_events import AllCleared, BlockRemoved, BlockStored  # noqa: E402
from splitserve.services.engine_vllm.kv_events import VllmKVEvents  # noqa: E402
from splitserve.services.engine_vllm.stat_counts import StepCounts  # noqa: E402

BLOCK_SIZE = 32
NUM_BLOCKS = 24
EXTRA_KEY = b"smollm2|float32|vllm"
MAX_TOKENS = 4


def as_json(event) -> dict:
    if isinstance(event, BlockStored):
        return {"kind": "stored", "seq": event.seq, "hashes": [h.hex() for h in event.block_hashes],
                "parent": event.parent_hash.hex() if event.parent_hash else None,
                "tokens": list(event.token_ids), "tier": event.tier}
    if isinstance(event, BlockRemoved):
        return {"kind": "removed", "seq": event.seq, "hashes": [h.hex() for h in event.block_hashes],
                "tier": event.tier}
    assert isinstance(event, AllCleared)
    return {"kind": "cleared", "seq": event.seq}


class Probe:
    def __init__(self, model: str, work: Path):
        self.events = VllmKVEvents(f"ipc://{work}/kv-events", BLOCK_SIZE, EXTRA_KEY)
        args = EngineArgs(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
                          enable_prefix_caching=True, max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS,
                          max_num_seqs=4, kv_events_config=KVEventsConfig(**self.events.engine_config()))
        self.counts = StepCounts()
        self.engine = LLMEngine.from_engine_args(args, stat_loggers=[self.counts.logger_factory()])
        self.publisher = self.engine.engine_core.engine_core.scheduler.kv_event_publisher
        self.woken = threading.Event()
        self.taken: list[dict] = []
        self.num_requests = 0

    def generate(self, prompts: list[list[int]], cache_salt: str | None = None,
                 max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=max_tokens > MAX_TOKENS,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        ids = []
        for prompt in prompts:
            self.num_requests += 1
            rid = f"r{self.num_requests}"
            inputs = {"prompt_token_ids": prompt} | ({"cache_salt": cache_salt} if cache_salt else {})
            self.engine.add_request(rid, inputs, params)
            ids.append(rid)
        outputs = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        return [outputs[rid] for rid in ids]

    def drained(self, events: VllmKVEvents) -> bool:
        """vLLM's publisher has sent every batch and `events` has applied the last one."""
        buffer = self.publisher._buffer      # (seq, payload) of what it sent, newest last
        return self.publisher._event_queue.empty() and (not buffer or events._next_seq == buffer[-1][0] + 1)

    def phase(self, *others: VllmKVEvents) -> list[dict]:
        deadline = time.monotonic() + 30
        while not all(self.drained(e) for e in (self.events, *others)):
            assert time.monotonic() < deadline, "the subscriber did not catch up with vLLM's publisher"
            time.sleep(0.01)
        return [as_json(e) for e in self.events.take_events()]


def main() -> None:
    model, work = sys.argv[1], Path(sys.argv[2])
    probe = Probe(model, work)
    prefix = [(7 * i + 11) % 4000 + 100 for i in range(3 * BLOCK_SIZE + 5)]
    prompts = {"late": [(5 * i + 3) % 3000 + 200 for i in range(2 * BLOCK_SIZE + 3)],
               "shared_a": prefix + [901, 902, 903, 904, 905, 906] * 7,
               "shared_b": prefix + [1901, 1902, 1903] * 14}
    result: dict = {"block_size": BLOCK_SIZE, "extra_key": EXTRA_KEY.hex(), "prompts": prompts, "outputs": {},
                    "phases": {}}

    result["outputs"]["late"] = probe.generate([prompts["late"]])[0]
    probe.events.start(probe.woken.set)          # after the first batches: they come back by replay
    no_replay = VllmKVEvents(probe.events.endpoint, BLOCK_SIZE, EXTRA_KEY)
    no_replay.replay_endpoint = None
    no_replay.start(lambda: None)
    result["outputs"]["shared_a"], = probe.generate([prompts["shared_a"]])
    result["phases"]["late"] = probe.phase(no_replay)
    result["woken"] = probe.woken.is_set()
    result["no_replay"] = {"num_resyncs": no_replay.num_resyncs,
                           "events": [as_json(e) for e in no_replay.take_events()]}
    no_replay.close()

    result["outputs"]["shared_b"], = probe.generate([prompts["shared_b"]])
    result["phases"]["shared"] = probe.phase()

    # the salted prompt's last block fills during decoding: a later event continues its chain
    prompts["salted"] = prompts["shared_a"][:4 * BLOCK_SIZE - 2]
    result["outputs"]["salted"], = probe.generate([prompts["salted"]], cache_salt="tenant-7")
    result["phases"]["salted"] = probe.phase()

    fillers = [[(13 * i + 17 * j) % 5000 + 300 for i in range(4 * BLOCK_SIZE)] for j in range(1, 5)]
    result["prompts"]["fillers"] = fillers
    result["outputs"]["fillers"] = probe.generate(fillers[:2]) + probe.generate(fillers[2:])
    result["phases"]["evict"] = probe.phase()

    assert probe.engine.reset_prefix_cache()
    probe.generate([[42] * 5])                   # a step, so that the scheduler publishes the clear
    result["phases"]["reset"] = probe.phase()

    # 4 x (96 + 150 tokens) need 32 blocks of 32 at their longest; the pool has 24.
    long = [[(19 * i + 7 * j) % 5000 + 300 for i in range(3 * BLOCK_SIZE)] for j in range(1, 5)]
    before = probe.counts.preemptions
    outputs = probe.generate(long, max_tokens=150)
    result["phases"]["preempt"] = probe.phase()
    from prometheus_client import REGISTRY

    result["preempt"] = {"counted": probe.counts.preemptions - before, "total": probe.counts.preemptions,
                         "lengths": [len(o) for o in outputs],
                         "vllm_counter": sum(s.value for m in REGISTRY.collect() for s in m.samples
                                             if s.name == "vllm:num_preemptions_total")}

    result["num_dropped_blocks"] = probe.events.translator.num_dropped_blocks
    result["num_resyncs"] = probe.events.num_resyncs
    probe.events.close()
    print("PROBE-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
