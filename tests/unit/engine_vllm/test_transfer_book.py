"""The bookkeeping splitserve's KV connector inside vLLM shares with `VllmEngine` (transfer_book.py):
which blocks a transfer holds after vLLM finished a request, and when vLLM hears they are free.
The same hooks run against vLLM itself in tests/integration/vllm/test_disaggregated.py."""

from __future__ import annotations

import pytest

from splitserve.services.engine_vllm.transfer_book import (RECEIVE, SEND, TransferBook, marked,
                                                           transfer_params)


def test_transfer_params_mark_a_request_and_nothing_else():
    assert marked(transfer_params(RECEIVE, "r1")) == (RECEIVE, "r1")
    assert marked(transfer_params(SEND, "p1")) == (SEND, "p1")
    assert marked(None) is None
    assert marked({"do_remote_prefill": True}) is None           # vLLM's NixlConnector's, not ours
    assert marked({"splitserve": {"role": "other", "id": "x"}}) is None


def test_a_received_prompt_is_freed_by_vllm_the_usual_way():
    book = TransferBook()
    book.expect_receive("r")
    assert book.seen(RECEIVE, "r", "r-abc") is not None
    book.allocated("r-abc", [4, 5, 6], 128)
    assert book.counts().num_waiting_receives == 1 and book.counts().num_waiting_receive_blocks == 3
    assert book.mark_received("r")
    assert book.take_finished() == (set(), {"r-abc"})          # vLLM's next step takes it up
    assert not book.finished("r-abc", 3)                       # then it frees its blocks itself
    assert book.counts().num_waiting_receives == 0
    assert not book.release("r")


def test_a_reservation_given_up_keeps_its_blocks_until_its_fence_releases_them():
    book = TransferBook()
    book.expect_receive("r")
    book.seen(RECEIVE, "r", "r-abc")
    book.allocated("r-abc", [4, 5], 0)
    assert book.finished("r-abc", 2)                           # aborted while writes may still land
    assert book.counts().num_held_receive_blocks == 2
    assert not book.has_finished()
    assert not book.mark_received("r")                        # a late notification changes nothing
    assert book.release("r")                                   # the write fence: no write can land now
    assert book.take_finished() == (set(), {"r-abc"})
    assert book.take_finished() == (set(), set())              # reported once
    assert book.counts().num_held_receive_blocks == 0


def test_a_fence_that_comes_before_vllm_finished_the_request_lets_vllm_free_at_once():
    book = TransferBook()
    book.expect_receive("r")
    book.seen(RECEIVE, "r", "r-abc")
    book.allocated("r-abc", [4], 0)
    assert book.release("r")
    assert not book.finished("r-abc", 1)
    assert book.take_finished() == (set(), set())


def test_a_reservation_vllm_never_admitted_holds_nothing():
    book = TransferBook()
    book.expect_receive("r")
    book.seen(RECEIVE, "r", "r-abc")
    assert not book.finished("r-abc", 0)                       # withdrawn before any block was allocated
    book.forget(RECEIVE, "r")
    book.expect_receive("r")                                   # the next attempt may use the same id


def test_a_send_holds_its_blocks_after_the_prefill_until_the_sender_is_done():
    book = TransferBook()
    layers = []
    book.expect_send("p", layers.append)
    book.seen(SEND, "p", "p-xyz")
    assert [t.request_id for t in book.sends()] == ["p"]
    book.callback("p")("layer 0")
    assert layers == ["layer 0"]
    assert book.finished("p-xyz", 3)                           # the first token is out; writes may still read
    assert book.sends() == [] and book.counts().num_held_sends == 1
    assert book.release("p")
    assert book.take_finished() == ({"p-xyz"}, set())
    assert book.callback("p") is None


def test_one_id_has_one_transfer_of_each_role():
    book = TransferBook()
    book.expect_send("p", lambda ready: None)
    with pytest.raises(ValueError, match="already has a send transfer"):
        book.expect_send("p", lambda ready: None)
