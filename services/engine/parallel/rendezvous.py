"""Joining a tensor-parallel group whose ranks were started independently (one pod per rank).

`splitserve worker` learns its place in such a group from its environment
(`GroupMember.from_env`): its rank, the world size, and the leader address, the
host:port of rank 0's rendezvous, which every other rank dials. Without that
environment, `--tp N` starts ranks 1..N-1 as local child processes instead
(tensor_parallel.py) and none of this runs.

Rank 0 hosts the rendezvous (`host_group`): torch's TCPStore on the leader port
(it listens on every interface) and a control listener on a free port that it
publishes in the store. Each other rank (`join_leader`) waits until the leader
answers, reads the control port from the store, dials it, and says its rank; once
every rank has (rank 0 waits up to the join timeout and names the ranks still
missing), rank 0 answers each with its own engine config, so every rank sizes its
KV pool with rank 0's block count, and all ranks join the process group through
the store (gloo on CPU, NCCL on CUDA).

The control connection is a multiprocessing `Connection` over TCP, so rank
0's `RankControl` and a rank's `serve_control` (rank_control.py) run over it
unchanged, as over the local ranks' pipes. Both ends authenticate with
multiprocessing's HMAC challenge under a random key rank 0 puts in the store: that
ties a connection to this incarnation of the group, but it is no secret from
whoever can reach the store, so the leader port, like any torch.distributed
rendezvous, must be reachable only inside the cluster network. TCP keepalive on
the connection lets rank 0 notice a rank whose node vanished without closing it.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import torch.distributed as dist

from splitserve.errors import FatalError, SplitserveError
from splitserve.services.engine.config import EngineConfig

log = logging.getLogger(__name__)

ENV_RANK = "SPLITSERVE_TP_RANK"
ENV_WORLD_SIZE = "SPLITSERVE_TP_WORLD_SIZE"
ENV_LEADER = "SPLITSERVE_TP_LEADER"
ENV_JOIN_TIMEOUT = "SPLITSERVE_TP_JOIN_TIMEOUT"
DEFAULT_JOIN_TIMEOUT_S = 600.0

CONTROL_PORT_KEY = "splitserve/control-port"
CONTROL_KEY_KEY = "splitserve/control-key"
ACCEPT_POLL_S = 0.2
DIAL_RETRY_S = 0.5


class GroupJoinError(FatalError):
    """A rank did not join its tensor-parallel group in time, or the leader never answered."""


@dataclass(frozen=True, slots=True)
class GroupMember:
    """This process's place in a tensor-parallel group of independently started ranks."""

    rank: int
    world_size: int
    leader_host: str
    leader_port: int
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S

    @property
    def leader(self) -> str:
        return f"{self.leader_host}:{self.leader_port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> GroupMember | None:
        """None when `SPLITSERVE_TP_RANK` is unset; SplitserveError when the environment is incomplete."""
        if not environ.get(ENV_RANK):
            return None
        try:
            rank, world = int(environ[ENV_RANK]), int(environ.get(ENV_WORLD_SIZE, ""))
            timeout = float(environ.get(ENV_JOIN_TIMEOUT) or DEFAULT_JOIN_TIMEOUT_S)
        except ValueError:
            raise SplitserveError(f"{ENV_RANK} and {ENV_WORLD_SIZE} must be integers, {ENV_JOIN_TIMEOUT} "
                                  f"a number of seconds") from None
        host, sep, port = environ.get(ENV_LEADER, "").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise SplitserveError(f"{ENV_LEADER} must be HOST:PORT (rank 0's rendezvous), "
                                  f"got {environ.get(ENV_LEADER, '')!r}")
        if world < 1 or not 0 <= rank < world:
            raise SplitserveError(f"{ENV_RANK}={rank} is not a rank of a group of {ENV_WORLD_SIZE}={world}")
        return cls(rank, world, host.strip("[]"), int(port), timeout)


@dataclass(frozen=True, slots=True)
class _Hello:
    rank: int


@dataclass(frozen=True, slots=True)
class _Welcome:
    config: EngineConfig          # rank 0's, with the block count it sized


# -- rank 0 ------------------------------------------------------------------------------
def host_group(config: EngineConfig, leader_port: int, timeout_s: float
               ) -> tuple[dist.TCPStore, dict[int, Connection]]:
    """Host the rendezvous; once every rank has dialled in, send each `config`. Returns the
    store (for init_process_group) and a control connection per rank."""
    world = config.tensor_parallel_size
    deadline = time.monotonic() + timeout_s
    try:
        store = dist.TCPStore("127.0.0.1", leader_port, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise GroupJoinError(f"cannot host the tensor-parallel rendezvous on port {leader_port}: {exc}") from exc
    key = os.urandom(32)
    if socket.has_dualstack_ipv6():
        listener = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        listener = socket.create_server(("0.0.0.0", 0))
    with listener:
        store.set(CONTROL_KEY_KEY, key.hex())
        store.set(CONTROL_PORT_KEY, str(listener.getsockname()[1]))
        log.info("tensor-parallel rank 0: rendezvous on port %d, waiting up to %.0f s for ranks 1..%d",
                 leader_port, timeout_s, world - 1)
        conns = _accept_ranks(listener, key, world, deadline, leader_port)
    for conn in conns.values():
        conn.send(_Welcome(config))
    return store, conns


def _accept_ranks(listener: socket.socket, key: bytes, world: int, deadline: float,
                  leader_port: int) -> dict[int, Connection]:
    arrived: queue.SimpleQueue[tuple[int, Connection]] = queue.SimpleQueue()
    conns: dict[int, Connection] = {}
    listener.settimeout(ACCEPT_POLL_S)
    while len(conns) < world - 1:
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, world)) - set(conns))
            for conn in conns.values():
                conn.close()
            raise GroupJoinError(f"tensor-parallel rank(s) {', '.join(map(str, missing))} of {world} did not "
                                 f"join rank 0's rendezvous (port {leader_port}) in time")
        try:
            sock, peer = listener.accept()
        except TimeoutError:
            pass
        else:      # a thread per caller: one that never answers the challenge holds up nobody
            threading.Thread(target=_greet, args=(sock, peer, key, world, arrived), daemon=True,
                             name="tp-rendezvous-greet").start()
        while not arrived.empty():
            rank, conn = arrived.get()
            if rank in conns:
                log.warning("tensor-parallel rank %d dialled in twice; keeping the first", rank)
                conn.close()
            else:
                log.info("tensor-parallel rank %d joined", rank)
                conns[rank] = conn
    return conns


def _greet(sock: socket.socket, peer, key: bytes, world: int, arrived: queue.SimpleQueue) -> None:
    sock.setblocking(True)
    _keepalive(sock)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        hello = conn.recv()
        if not isinstance(hello, _Hello) or not 1 <= hello.rank < world:
            raise ValueError(f"not a rank of this group: {hello!r}")
    except Exception as exc:
        log.warning("tensor-parallel rendezvous: refused %s: %s", peer, exc)
        conn.close()
        return
    arrived.put((hello.rank, conn))


# -- ranks 1..N-1 ------------------------------------------------------------------------
def join_leader(member: GroupMember) -> tuple[dist.TCPStore, Connection, EngineConfig]:
    """Dial rank 0's rendezvous (retrying until it answers); returns the store, this rank's
    control connection and rank 0's engine config, once every rank has joined."""
    deadline = time.monotonic() + member.join_timeout_s
    _wait_reachable(member.leader_host, member.leader_port, deadline, member.leader)
    try:
        store = dist.TCPStore(member.leader_host, member.leader_port, member.world_size, is_master=False,
                              timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
        key = bytes.fromhex(store.get(CONTROL_KEY_KEY).decode())
        control_port = int(store.get(CONTROL_PORT_KEY))
    except Exception as exc:
        raise GroupJoinError(f"rank {member.rank}: the rendezvous at {member.leader} failed: {exc}") from exc
    sock = _wait_reachable(member.leader_host, control_port, deadline, member.leader)
    _keepalive(sock)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
        conn.send(_Hello(member.rank))
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise GroupJoinError(f"rank {member.rank}: rank 0 at {member.leader} did not see every rank "
                                 f"join within {member.join_timeout_s:.0f} s")
        welcome = conn.recv()
    except GroupJoinError:
        conn.close()
        raise
    except Exception as exc:
        conn.close()
        raise GroupJoinError(f"rank {member.rank}: joining rank 0 at {member.leader} failed: {exc!r}") from exc
    return store, conn, welcome.config


def _wait_reachable(host: str, port: int, deadline: float, leader: str) -> socket.socket:
    """A connected socket to host:port, retried quietly (the leader's pod may start later,
    its name may not resolve yet) until `deadline`."""
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            sock.settimeout(None)
            return sock
        except OSError as exc:
            if time.monotonic() + DIAL_RETRY_S > deadline:
                raise GroupJoinError(f"tensor-parallel leader {leader} unreachable ({host}:{port}: {exc})") from None
        time.sleep(DIAL_RETRY_S)


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection after 10 s, every 5 s, 3 times: a peer whose node vanished
    is noticed in about 25 s, not after the kernel's two hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def member_config(own: EngineConfig, leader: EngineConfig) -> EngineConfig:
    """A rank's engine config: rank 0's (block count, dtype, block size, budgets), with this
    process's own model path (the same model, where this pod has it) and device."""
    return replace(leader, model=own.model, device=own.device, num_threads=own.num_threads,
                   cpu_cores=own.cpu_cores)
