"""A connector in its own process, driven over a pipe: test and benchmark support.

Transfers are only meaningful between two real processes (separate address
spaces, real sockets, real UCX endpoints), so tests and bench/kvtransfer.py start
`PeerProcess`es and call `PeerProcess.call(method, ...)`. Each call runs one
`_Peer` method in the child and returns its result or re-raises its exception
(TransferErrors pickle unchanged). A call may stream progress events before its
result (`write_loop` reports its first completed write), so a test can act on an
event instead of sleeping.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict

import torch

from splitserve.kvtransfer.backends import make_connector
from splitserve.kvtransfer.connector import Connector, Reservation
from splitserve.kvtransfer.layout import KVLayout
from splitserve.kvtransfer.memory import empty_pool

_PROGRESS = "progress"


def random_pool(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.pool_shape(num_blocks), generator=generator).to(layout.torch_dtype)


class _Peer:
    """What a child process can be asked to do."""

    def __init__(self, conn):
        self.conn = conn
        self.connector: Connector | None = None
        self.registry = None

    def setup(self, backend: str, name: str, layout: dict, num_blocks: int, seed: int | None,
              timeout_s: float = 10.0, core: int | None = None, threads: int = 1, device: str = "cpu",
              token: bytes = b"", coalesce: bool = True):
        from prometheus_client import CollectorRegistry
        if core is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(threads)
        lay = KVLayout(**layout)
        self.registry = CollectorRegistry()
        self.connector = make_connector(backend, name, lay, timeout_s=timeout_s, registry=self.registry, token=token,
                                        coalesce=coalesce)
        pool = empty_pool(lay.pool_shape(num_blocks), lay.torch_dtype, device)   # huge pages before first touch
        if seed is None:
            pool.zero_()
        else:
            pool.copy_(random_pool(lay, num_blocks, seed))
        self.connector.register(pool)
        return self.connector.metadata()

    def pool(self) -> torch.Tensor:
        return self.connector.pool.cpu().clone()

    def load(self, tensor: torch.Tensor) -> None:
        self.connector.pool.copy_(tensor)

    def fill(self, value: float) -> None:
        self.connector.pool.fill_(value)

    def set_coalesce(self, on: bool) -> None:
        """Coalesce runs of blocks (the default) or move one span per block; see Connector."""
        self.connector.coalesce = on

    def metric(self, name: str, labels: dict) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def send_request(self, reservation: Reservation, src: list[int], dst: list[int], payload: bytes = b"",
                     layers: list[int] | None = None) -> None:
        """All layers of one request, then its notification; waits for all."""
        self.send_many([(reservation, src, dst, payload)], layers)

    def send_many(self, requests: list[tuple], layers: list[int] | None = None) -> None:
        """Posts every layer of every request interleaved, then the notifications, then waits."""
        c = self.connector
        layers = range(c.layout.num_layers) if layers is None else layers
        handles = [c.write_layer(r, layer, src, dst) for layer in layers for r, src, dst, _ in requests]
        handles += [c.notify(r, payload) for r, _, _, payload in requests]
        for handle in handles:
            c.wait(handle)

    def write_loop(self, reservation: Reservation, src: list[int], dst: list[int], max_s: float) -> None:
        """Writes layers round and round (reporting the first completion) until an error or `max_s`; then notifies."""
        c, start, reported, layer = self.connector, time.monotonic(), False, 0
        while time.monotonic() - start < max_s:
            c.wait(c.write_layer(reservation, layer, src, dst))
            if not reported:
                self.conn.send((_PROGRESS, "first write done"))
                reported = True
            layer = (layer + 1) % c.layout.num_layers
        c.wait(c.notify(reservation, b"late"))

    def timed_writes(self, reservation: Reservation, src: list[int], dst: list[int], repeats: int,
                     layer: int = 0) -> float:
        """Seconds per write of one layer (post to completion), best of `repeats` after a warm-up."""
        c = self.connector
        c.wait(c.write_layer(reservation, layer, src, dst))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            c.wait(c.write_layer(reservation, layer, src, dst))
            best = min(best, time.perf_counter() - start)
        return best

    def timed_writes_vs_memcpy(self, reservation: Reservation, src: list[int], dst: list[int], repeats: int,
                               layer: int = 0) -> dict:
        """One-layer writes interleaved with a local memcpy of as many bytes, on this process's core.

        Each repetition runs both (alternating which goes first) so that both see the same
        machine load; returns best and median seconds of each, after one warm-up of each.
        """
        c = self.connector
        num_bytes = 2 * len(src) * c.layout.block_bytes
        flat = c.pool.view(torch.uint8).reshape(-1)[:num_bytes]
        scratch = empty_pool((num_bytes,), torch.uint8, flat.device)   # the same kind of memory as a pool
        scratch.copy_(flat)
        c.wait(c.write_layer(reservation, layer, src, dst))
        writes, copies = [], []
        for rep in range(repeats):
            for kind in (("write", "copy") if rep % 2 == 0 else ("copy", "write")):
                start = time.perf_counter()
                if kind == "write":
                    c.wait(c.write_layer(reservation, layer, src, dst))
                    writes.append(time.perf_counter() - start)
                else:
                    scratch.copy_(flat)
                    copies.append(time.perf_counter() - start)
        return dict(bytes=num_bytes, write_best_s=min(writes), write_median_s=statistics.median(writes),
                    memcpy_best_s=min(copies), memcpy_median_s=statistics.median(copies))

    def simulated_prefill(self, reservation: Reservation, src: list[int], dst: list[int],
                          compute_s: float, detail: bool = False) -> float | dict:
        """Busy-compute `compute_s` per layer, posting each layer's WRITE; returns seconds exposed after the last.

        Exposed = waiting for every write after the last layer's WRITE was posted. With
        `detail`, a dict that also has `post_last_s` (how long posting the last layer took)
        and `after_compute_s` (post_last_s + exposed: all the time after the last compute).
        """
        c = self.connector
        a = torch.randn(128, 128)
        handles = []
        for layer in range(c.layout.num_layers):
            end = time.perf_counter() + compute_s
            while time.perf_counter() < end:
                torch.mm(a, a)              # "compute": a kernel that releases the GIL
                for handle in handles:      # an engine step polls its connector between kernels
                    if not handle.finished:
                        c.poll(handle)
            posted = time.perf_counter()
            handles.append(c.write_layer(reservation, layer, src, dst))
        start = time.perf_counter()
        for handle in handles:
            c.wait(handle)
        done = time.perf_counter()
        if not detail:
            return done - start
        return dict(exposed_s=done - start, post_last_s=start - posted, after_compute_s=done - posted)


    def __getattr__(self, name):
        # Connector methods by name: add_peer, reserve, release, wait_notification, active_reservations...
        return getattr(self.connector, name)


def _serve(conn, idle_poll_s: float) -> None:
    peer = _Peer(conn)
    while True:
        # Idle like an engine loop: keep driving the connector between commands.
        while peer.connector is not None and not conn.poll(idle_poll_s):
            peer.connector.progress()
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            break
        if method == "exit":
            break
        try:
            conn.send(("ok", getattr(peer, method)(*args, **kwargs)))
        except Exception as error:       # report every failure to the caller, keep serving
            try:
                conn.send(("err", error))
            except Exception:            # an exception that does not pickle
                conn.send(("err", RuntimeError(repr(error))))
    if peer.connector is not None:
        peer.connector.close()


class PeerProcess:
    """One child process holding one connector."""

    def __init__(self, call_timeout_s: float = 60.0, idle_poll_s: float = 5e-4):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, idle_poll_s), daemon=True)
        self.process.start()
        child.close()
        self.call_timeout_s = call_timeout_s

    def call(self, method: str, *args, **kwargs):
        self.send(method, *args, **kwargs)
        return self.result()

    def send(self, method: str, *args, **kwargs) -> None:
        self.conn.send((method, args, kwargs))

    def next_event(self, timeout_s: float | None = None):
        """The next message from the child: (kind, value)."""
        if not self.conn.poll(self.call_timeout_s if timeout_s is None else timeout_s):
            raise TimeoutError(f"peer process {self.process.pid} did not answer")
        return self.conn.recv()

    def result(self, timeout_s: float | None = None):
        while True:
            kind, value = self.next_event(timeout_s)
            if kind == "ok":
                return value
            if kind == "err":
                raise value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("exit", (), {}))
            except OSError:
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.kill()
        self.conn.close()


def layout_dict(layout: KVLayout) -> dict:
    return asdict(layout)
