"""free_port: ports from below the kernel's ephemeral range, each process its own walk, xdist
workers their own slices, a held port skipped."""

from __future__ import annotations

import socket

import pytest

from splitserve import net


@pytest.fixture
def fresh_walk(monkeypatch):
    monkeypatch.setattr(net, "_candidates", None)
    yield monkeypatch
    net._candidates = None


def test_ports_come_from_below_the_ephemeral_range_and_do_not_repeat(fresh_walk):
    fresh_walk.delenv("PYTEST_XDIST_WORKER", raising=False)
    low, _ = net._ephemeral_range()
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(net.FIRST_PORT <= p < low for p in ports)


def test_a_port_something_holds_is_skipped(fresh_walk):
    fresh_walk.delenv("PYTEST_XDIST_WORKER", raising=False)
    first = net.free_port()
    fresh_walk.setattr(net, "_candidates", None)
    fresh_walk.setattr(net, "_port_slice", lambda: [first, first + 1])
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        assert net.free_port() == first + 1


def test_xdist_workers_walk_disjoint_slices(fresh_walk):
    fresh_walk.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        fresh_walk.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(net._port_slice()))
    assert slices[0] and slices[1] and not slices[0] & slices[1]


def test_without_room_below_the_range_the_os_picks(fresh_walk):
    kernel_low, kernel_high = net._ephemeral_range()
    fresh_walk.setattr(net, "_ephemeral_range", lambda: (net.FIRST_PORT + 10, 60999))
    port = net.free_port()
    assert kernel_low <= port <= kernel_high          # bind(port 0): the kernel's own range
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))           # it was free


def test_a_claimed_port_is_never_handed_out(fresh_walk):
    """`serve --port P` claims P before it picks its other ports: P is not bound until the
    frontend starts, so only the claim keeps free_port from handing P to a worker."""
    fresh_walk.delenv("PYTEST_XDIST_WORKER", raising=False)
    first = net.free_port()
    fresh_walk.setattr(net, "_candidates", None)
    fresh_walk.setattr(net, "_port_slice", lambda: [first, first + 1])
    fresh_walk.setattr(net, "_claimed", set())
    net.claim_port(first)
    assert [net.free_port() for _ in range(3)] == [first + 1] * 3
