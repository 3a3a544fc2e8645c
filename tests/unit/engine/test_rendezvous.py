"""Joining a tensor-parallel group of independently started ranks: the environment, and the
rendezvous itself (rank 0 and rank 1 in one process, over real sockets and a real TCPStore).

Every store is freed before its test ends: a TCPStore's threads in this process make a
child that a later test forks abort."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from splitserve.errors import SplitserveError
from splitserve.net import free_port
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.parallel.rendezvous import (GroupJoinError, GroupMember, host_group, join_leader,
                                                            member_config)
from splitserve.testing.waiting import wait_until


def test_no_environment_means_local_ranks():
    assert GroupMember.from_env({}) is None
    assert GroupMember.from_env({"SPLITSERVE_TP_RANK": ""}) is None


def test_environment_parsed():
    member = GroupMember.from_env({"SPLITSERVE_TP_RANK": "1", "SPLITSERVE_TP_WORLD_SIZE": "4",
                                   "SPLITSERVE_TP_LEADER": "g-0.workers.ns.svc:29500",
                                   "SPLITSERVE_TP_JOIN_TIMEOUT": "12.5"})
    assert member == GroupMember(1, 4, "g-0.workers.ns.svc", 29500, 12.5)
    assert member.leader == "g-0.workers.ns.svc:29500"
    v6 = GroupMember.from_env({"SPLITSERVE_TP_RANK": "0", "SPLITSERVE_TP_WORLD_SIZE": "2",
                               "SPLITSERVE_TP_LEADER": "[fd00::1]:29500"})
    assert (v6.leader_host, v6.leader_port, v6.join_timeout_s) == ("fd00::1", 29500, 600.0)


@pytest.mark.parametrize("env, message", [
    ({"SPLITSERVE_TP_RANK": "1", "SPLITSERVE_TP_LEADER": "h:1"}, "must be integers"),
    ({"SPLITSERVE_TP_RANK": "2", "SPLITSERVE_TP_WORLD_SIZE": "2", "SPLITSERVE_TP_LEADER": "h:1"}, "not a rank"),
    ({"SPLITSERVE_TP_RANK": "0", "SPLITSERVE_TP_WORLD_SIZE": "2"}, "HOST:PORT"),
    ({"SPLITSERVE_TP_RANK": "0", "SPLITSERVE_TP_WORLD_SIZE": "2", "SPLITSERVE_TP_LEADER": "h"}, "HOST:PORT"),
])
def test_incomplete_environment_refused(env, message):
    with pytest.raises(SplitserveError, match=message):
        GroupMember.from_env(env)


def test_rank1_joins_before_rank0_listens_and_gets_rank0s_config(monkeypatch):
    port = free_port()
    leader = EngineConfig(model="/rank0/path", tensor_parallel_size=2, num_kv_blocks=123, block_size=32)
    hosted: dict = {}
    refused: list[tuple] = []
    dial = socket.create_connection

    def counted_dial(address, *args, **kwargs):
        try:
            return dial(address, *args, **kwargs)
        except ConnectionRefusedError:
            refused.append(address)
            raise

    monkeypatch.setattr(socket, "create_connection", counted_dial)

    def rank0() -> None:
        # Rank 1 dials first and must wait for the leader.
        wait_until(lambda: ("127.0.0.1", port) in refused, timeout=20, interval=0.01,
                   what="rank 1 to dial the leader's port before it listens")
        hosted["store"], hosted["conns"] = host_group(leader, port, timeout_s=20)

    thread = threading.Thread(target=rank0)
    thread.start()
    store, conn, config = join_leader(GroupMember(1, 2, "127.0.0.1", port, 20))
    thread.join(20)
    assert config.num_kv_blocks == 123 and config.block_size == 32
    own = member_config(EngineConfig(model="/rank1/path", device="cpu", num_threads=3), config)
    assert (own.model, own.num_kv_blocks, own.num_threads, own.tensor_parallel_size) == ("/rank1/path", 123, 3, 2)
    # The control connection carries objects both ways, as the local pipes do.
    hosted["conns"][1].send(("call", 7))
    assert conn.recv() == ("call", 7)
    conn.send("reply")
    assert hosted["conns"][1].recv() == "reply"
    conn.close()
    hosted["conns"][1].close()
    del store, hosted      # the store's threads end with it (a later test forks)


def test_rank0_names_the_ranks_that_did_not_join():
    port = free_port()
    config = EngineConfig(model="unused", tensor_parallel_size=3, num_kv_blocks=8)
    errors: list[str] = []

    def rank0() -> None:
        try:
            host_group(config, port, timeout_s=3)
        except GroupJoinError as exc:
            errors.append(str(exc))     # not the exception: its frames would keep the store alive

    thread = threading.Thread(target=rank0)
    thread.start()
    # Rank 2 joins; rank 1 never does. (Rank 2 then waits for the others: it gives up too.)
    with pytest.raises(GroupJoinError):
        join_leader(GroupMember(2, 3, "127.0.0.1", port, 4))
    thread.join(10)
    assert len(errors) == 1 and "rank(s) 1 of 3 did not join" in errors[0]


def test_a_rank_gives_up_on_an_absent_leader():
    start = time.monotonic()
    with pytest.raises(GroupJoinError, match="unreachable"):
        join_leader(GroupMember(1, 2, "127.0.0.1", free_port(), 1.5))
    assert time.monotonic() - start < 10
