"""The store's slot bookkeeping: one copy per hash, LRU eviction that spares pinned and pending
slots, aborted publishes give their slots back."""

from __future__ import annotations

from splitserve.services.kvstore.block_table import StoreBlockTable


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def publish(table: StoreBlockTable, *ids: int) -> list[int]:
    reserved = table.reserve([h(i) for i in ids])
    for index in reserved.wanted:
        table.commit(h(ids[index]), crc=ids[index])
    return reserved.slots


def test_a_hash_held_or_pending_is_not_wanted_again():
    table = StoreBlockTable(8)
    assert publish(table, 1, 2) == [0, 1]
    pending = table.reserve([h(2), h(3), h(3), h(4)])
    assert pending.wanted == [1, 3] and pending.slots == [2, 3]      # 2 held, the second 3 a repeat
    assert table.reserve([h(3)]).wanted == []                         # 3 is being written
    assert table.lookup([h(1), h(2), h(3)]) == 2                      # pending is not served


def test_lru_eviction_spares_pinned_blocks_and_reports_what_it_dropped():
    table = StoreBlockTable(3)
    publish(table, 1, 2, 3)
    assert table.lookup([h(1)]) == 1                                  # 1 is now the most recent
    assert table.pin([h(2)]) == [(1, 2)]                              # (slot, crc) of block 2
    reserved = table.reserve([h(4)])
    assert reserved.evicted == [h(3)] and reserved.slots == [2]       # 2 is pinned: 3 goes
    table.commit(h(4), 4)
    assert table.reserve([h(5), h(6)]).evicted == [h(1), h(4)]        # 2 still pinned
    table.unpin([1])
    assert table.reserve([h(7)]).evicted == [h(2)]
    assert table.reserve([h(8)]).wanted == []                         # every slot pending: offer later


def test_an_aborted_publish_frees_its_slot_and_pin_stops_at_the_first_miss():
    table = StoreBlockTable(2)
    reserved = table.reserve([h(1), h(2)])
    table.commit(h(1), 11)
    table.abort(h(2))
    assert table.num_pending == 0 and len(table) == 1
    assert table.reserve([h(3)]).slots == reserved.slots[1:]
    assert table.pin([h(1), h(9), h(3)]) == [(reserved.slots[0], 11)]
