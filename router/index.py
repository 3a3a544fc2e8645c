"""The router's KV index: which workers hold which cached blocks (DESIGN section 4).

block hash -> bitmask of the workers holding it (each worker gets one bit while
it holds anything), plus each worker's own set of hashes (for its count and to
clear it). Because block hashes are chained, "how many leading blocks of this
request does each worker hold" is one walk down the request's hash chain,
narrowing the mask of workers still matching with one integer AND per block
(the shape of SGLang's radix tree and Dynamo's indexer, flattened to a hash map
because the chain already encodes the prefix). Only workers with a non-zero
overlap appear in the answer; the rest hold 0 leading blocks.

Predicted entries. A worker's BlockStored events arrive only after it has
computed a prompt, so for a prefill's duration (plus the event's trip) the
index would not know that a prompt it just routed is about to be cached there,
and a tenant's simultaneous requests would each look uncached everywhere. So
the router `predict()`s the routed prompt's blocks on the chosen worker at
route time (Dynamo's approximate mode, SGLang's insertion into its tree at
routing): a predicted block counts in `overlaps()` exactly like a stored one.
It becomes an ordinary (confirmed) entry when that worker's BlockStored for
it arrives; it goes on the worker's BlockRemoved, AllCleared or removal like
any entry; and if it is never confirmed (the request failed, was cancelled,
or the worker evicted it before publishing) it expires at its deadline,
dropped by `expire(now)`, which the router calls before each walk. Predicting
a block again moves its deadline later. Deadlines are absolute times from the
caller's clock, so tests step time instead of sleeping.

Lower tiers. A worker with KV tiers (engine/kv_tiers/) also reports the blocks it keeps in
host memory and on disk (BlockStored/BlockRemoved with tier "host" or "disk"). Those go to
separate holder maps (`apply_tier`), on the same worker bits: they never count as device
blocks and a host eviction never removes a device entry. `tiered_overlaps` walks the chain
three times, over device, device ∪ host and device ∪ host ∪ disk holders, and returns the
leading run each worker holds on each; the policy credits the blocks beyond the device run at
the tier's discount (policies/kv.py).

The shared store (tier "store", services/kvstore/) is one cache every attached worker can
fetch from: a worker that publishes reports the blocks the store took (BlockStored{store},
an empty one when it attaches) and the ones the store evicted to make room for its offers
(BlockRemoved{store}). So a store block counts for every worker attached to the store
(`_store_workers`), whoever reported it, and a store eviction reported by any worker removes
the block for all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import islice, repeat


STORED, REMOVED, CLEARED = 1, 2, 3      # event kinds for KvIndex.apply
LOWER_TIERS = ("host", "disk", "store")     # below the device pool, nearest first


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, int] = {}          # block hash -> mask of worker bits (stored or predicted)
        self._blocks: dict[str, set[bytes]] = {}      # worker id -> its confirmed (stored) hashes
        self._predicted: dict[str, dict[bytes, float]] = {}   # worker id -> predicted hash -> deadline
        self._deadlines: deque[tuple[float, str, list[bytes]]] = deque()   # predictions, oldest first
        self._bits: dict[str, int] = {}               # worker id -> its bit (1 << position)
        self._names: list[str | None] = []            # position -> worker id
        self._free: list[int] = []                    # released positions, reused first
        # Host and disk: tier -> block hash -> mask of worker bits, and (worker id, tier) -> hashes.
        self._tier_holders: dict[str, dict[bytes, int]] = {t: {} for t in ("host", "disk")}
        self._tier_blocks: dict[tuple[str, str], set[bytes]] = {}
        self._store_workers = 0                       # bits of the workers attached to the shared store
        self._store_blocks: set[bytes] = set()        # what those workers say the store holds

    # -- worker bits ---------------------------------------------------------------
    def _bit(self, worker_id: str) -> int:
        bit = self._bits.get(worker_id)
        if bit is None:
            if self._free:
                pos = self._free.pop()
                self._names[pos] = worker_id
            else:
                pos = len(self._names)
                self._names.append(worker_id)
            bit = self._bits[worker_id] = 1 << pos
        return bit

    def _release(self, worker_id: str) -> None:
        bit = self._bits.pop(worker_id, None)
        if bit is not None:
            pos = bit.bit_length() - 1
            self._names[pos] = None
            self._free.append(pos)

    def _drop(self, h: bytes, keep: int) -> None:
        _narrow(self._holders, h, keep)

    # -- updates from the worker's events --------------------------------------------
    def stored(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        self.apply(worker_id, [(STORED, block_hashes)])

    def removed(self, worker_id: str, block_hashes: Iterable[bytes]) -> None:
        self.apply(worker_id, [(REMOVED, block_hashes)])

    def clear_worker(self, worker_id: str) -> None:
        """AllCleared, a snapshot's reset, or a worker leaving routing: stored and predicted entries
        go, in every tier."""
        mine = self._blocks.pop(worker_id, None)
        predicted = self._predicted.pop(worker_id, None)
        lower = {t: self._tier_blocks.pop((worker_id, t), None) for t in self._tier_holders}
        self._store_workers &= ~self._bits.get(worker_id, 0)
        if not self._store_workers:
            self._store_blocks.clear()              # nobody left to tell us what it evicts
        if mine or predicted or any(lower.values()):
            keep = ~self._bits[worker_id]
            for hashes in (mine or (), predicted or ()):
                for h in hashes:
                    self._drop(h, keep)
            for tier, hashes in lower.items():
                holders = self._tier_holders[tier]
                for h in hashes or ():
                    _narrow(holders, h, keep)
        self._release(worker_id)

    def apply(self, worker_id: str, ops: Iterable[tuple[int, Iterable[bytes]]]) -> None:
        """A run of one worker's events in order: (STORED | REMOVED | CLEARED, block hashes).

        STORED confirms a predicted block (its bit is already set); REMOVED drops a
        block whether stored or predicted. The per-call set-up is done once (the
        subscriber's hot path).
        """
        holders = self._holders
        get = holders.get
        bit = self._bit(worker_id)
        keep = ~bit
        mine = self._blocks.get(worker_id)
        if mine is None:
            mine = self._blocks[worker_id] = set()
        predicted = self._predicted.get(worker_id) or {}
        for kind, hashes in ops:
            if kind == STORED:
                for h in hashes:
                    if h not in mine:
                        mine.add(h)
                        if not predicted or predicted.pop(h, None) is None:     # else: a prediction confirmed
                            holders[h] = get(h, 0) | bit
            elif kind == REMOVED:
                for h in hashes:
                    if h in mine:
                        mine.discard(h)
                    elif predicted.pop(h, None) is None:
                        continue
                    m = holders[h] & keep
                    if m:
                        holders[h] = m
                    else:
                        del holders[h]
            elif kind == CLEARED:
                self.clear_worker(worker_id)
                bit = self._bit(worker_id)
                keep = ~bit
                mine = self._blocks[worker_id] = set()
                predicted = {}

    def apply_tier(self, worker_id: str, tier: str, kind: int, block_hashes: Iterable[bytes]) -> None:
        """A lower tier's BlockStored (STORED) or BlockRemoved (REMOVED); unknown tiers are ignored."""
        holders = self._tier_holders.get(tier)
        if holders is None and tier != "store":
            return
        bit = self._bit(worker_id)
        if worker_id not in self._blocks:
            self._blocks[worker_id] = set()      # the worker is known (its bit stays) even with no device blocks
        if tier == "store":                     # one cache for all: whoever reports, whoever leaves
            self._store_workers |= bit
            if kind == STORED:
                self._store_blocks.update(block_hashes)
            elif kind == REMOVED:
                self._store_blocks.difference_update(block_hashes)
            return
        mine = self._tier_blocks.setdefault((worker_id, tier), set())
        if kind == STORED:
            for h in block_hashes:
                if h not in mine:
                    mine.add(h)
                    holders[h] = holders.get(h, 0) | bit
        elif kind == REMOVED:
            for h in block_hashes:
                if h in mine:
                    mine.discard(h)
                    _narrow(holders, h, ~bit)

    # -- predictions from the router's own decisions -----------------------------------
    def predict(self, worker_id: str, block_hashes: list[bytes], deadline: float) -> None:
        """`worker_id` is about to cache these blocks: count them as held until `deadline` unless
        its events confirm (or remove) them first. Blocks it already holds are left alone.

        Deadlines must not decrease from one call to the next (a constant TTL on a
        monotonic clock): `expire()` stops at the first deadline still ahead."""
        if not block_hashes:
            return
        bit = self._bit(worker_id)
        if worker_id not in self._blocks:
            self._blocks[worker_id] = set()
        predicted = self._predicted.get(worker_id)
        if predicted is None:
            predicted = self._predicted[worker_id] = {}
        holders = self._holders
        get = holders.get
        for h in block_hashes:
            m = get(h, 0)
            if not m & bit:                       # neither stored nor predicted there yet
                holders[h] = m | bit
                predicted[h] = deadline
            elif h in predicted:                  # predicted already: the later deadline holds
                predicted[h] = deadline
        self._deadlines.append((deadline, worker_id, block_hashes))

    def expire(self, now: float, max_runs: int | None = None) -> int:
        """Drop predictions whose deadline is <= `now` (never confirmed); the number dropped.

        With `max_runs`, at most that many predict() calls' blocks are looked at, so
        that a router idle for a while does not pay for all of them in one decision
        (the rest go on later calls; until then they still count as held).
        """
        queue = self._deadlines
        if not queue or queue[0][0] > now:
            return 0
        num = 0
        runs = len(queue) if max_runs is None else max_runs
        while runs > 0 and queue and queue[0][0] <= now:
            runs -= 1
            _, worker_id, hashes = queue.popleft()
            predicted = self._predicted.get(worker_id)
            if not predicted:
                continue                 # confirmed, removed or cleared since
            keep = ~self._bits[worker_id]
            holders = self._holders
            pop = predicted.pop
            for h in hashes:
                d = pop(h, None)
                if d is None:                       # confirmed, removed, or dropped by an earlier run
                    continue
                if d > now:                         # a later predict() moved it: still live
                    predicted[h] = d
                    continue
                m = holders[h] & keep
                if m:
                    holders[h] = m
                else:
                    del holders[h]
                num += 1
        return num

    # -- queries -------------------------------------------------------------------
    def num_blocks(self, worker_id: str) -> int:
        """Blocks the worker's events say it caches (predictions not counted)."""
        return len(self._blocks.get(worker_id, ()))

    def num_predicted(self, worker_id: str) -> int:
        return len(self._predicted.get(worker_id, ()))

    def num_held(self, worker_ids: list[str]) -> list[int]:
        """Blocks each worker caches: stored plus predicted (a stored block is no longer predicted)."""
        blocks, predicted = self._blocks.get, self._predicted.get
        return [len(blocks(w, ())) + len(predicted(w, ())) for w in worker_ids]

    def workers(self) -> list[str]:
        return [w for w, b in self._blocks.items() if b or self._predicted.get(w)]

    def holds(self, worker_id: str, block_hash: bytes) -> bool:
        return block_hash in self._blocks.get(worker_id, ()) or block_hash in self._predicted.get(worker_id, ())

    def num_tier_blocks(self, worker_id: str, tier: str) -> int:
        if tier == "store":
            return len(self._store_blocks) if self._store_workers & self._bits.get(worker_id, 0) else 0
        return len(self._tier_blocks.get((worker_id, tier), ()))

    def has_lower_tiers(self) -> bool:
        return any(self._tier_holders.values()) or bool(self._store_blocks)

    def tiered_overlaps(self, block_hashes: list[bytes]) -> dict[str, tuple[int, ...]]:
        """worker id -> leading blocks held on the device; on device or host; on device, host or disk;
        and on those or in the shared store (each run at least as long as the one before; absent:
        nothing held)."""
        device = self.overlaps(block_hashes)
        if not self.has_lower_tiers():
            return {w: (n, n, n, n) for w, n in device.items()}
        dev, host, disk = self._holders.get, self._tier_holders["host"].get, self._tier_holders["disk"].get
        store, everyone = self._store_blocks, self._store_workers
        with_host = self.overlaps(block_hashes, lambda h, _: dev(h, 0) | host(h, 0))
        with_disk = self.overlaps(block_hashes, lambda h, _: dev(h, 0) | host(h, 0) | disk(h, 0))
        with_store = self.overlaps(block_hashes,
                                   lambda h, _: dev(h, 0) | host(h, 0) | disk(h, 0) | (everyone if h in store else 0))
        return {w: (device.get(w, 0), with_host.get(w, 0), with_disk.get(w, 0), n) for w, n in with_store.items()}

    def overlaps(self, block_hashes: list[bytes], get=None) -> dict[str, int]:
        """worker id -> number of leading blocks of `block_hashes` it holds, stored or predicted (absent: 0).
        `get(hash, 0)`: the holders' mask of a block (default: the device pool's)."""
        result: dict[str, int] = {}
        if not block_hashes:
            return result
        get = get or self._holders.get
        live = get(block_hashes[0], 0)
        if not live:
            return result
        depth = 1
        for mask in map(get, islice(block_hashes, 1, None), repeat(0)):
            nxt = live & mask
            if nxt != live:
                self._name_all(live ^ nxt, depth, result)
                if not nxt:
                    return result
                live = nxt
            depth += 1
        self._name_all(live, depth, result)
        return result

    def _name_all(self, mask: int, depth: int, result: dict[str, int]) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            result[names[low.bit_length() - 1]] = depth
            mask ^= low


def _narrow(holders: dict[bytes, int], h: bytes, keep: int) -> None:
    """Keep only the `keep` bits of a block's holders; a block nobody holds leaves the map."""
    m = holders[h] & keep
    if m:
        holders[h] = m
    else:
        del holders[h]
