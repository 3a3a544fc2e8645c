"""Waiting for a condition, not for a time: the one bounded poll of the tests and their harnesses.

A fixed sleep before an assertion is either too long (a slow suite) or too short (a flaky
one) on a loaded 2-core machine. `wait_until` calls a predicate until it returns something
truthy and returns that value; past its timeout it raises `WaitTimeout`, naming what it
waited for and the last value it saw, so that a failure says what did not happen.
`async_wait_until` is its twin for code on an event loop: it yields to the loop between
two looks, and its predicate may be a coroutine function.

A predicate may raise to end the wait early: a process that exited will never print its
ready line.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL_S = 0.1
MAX_SHOWN_CHARS = 500          # of the last value's repr in a WaitTimeout


class WaitTimeout(AssertionError, TimeoutError):
    """A condition not reached in time: a failed assertion to pytest, a TimeoutError to
    harness code that catches one."""


def wait_until(predicate: Callable[[], T], *, timeout: float, what: str, interval: float = POLL_INTERVAL_S,
               details: Callable[[], object] | None = None) -> T:
    """Call `predicate` every `interval` s until it returns something truthy, and return that.

    After `timeout` s: WaitTimeout saying that `what` was not reached, with the last value
    and, when given, what `details()` returns then (a log tail, the state that was read)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, value, details)
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], *, timeout: float, what: str,
                           interval: float = POLL_INTERVAL_S, details: Callable[[], object] | None = None) -> T:
    """`wait_until` on an event loop: `predicate` may return an awaitable (a coroutine
    function), and the loop runs other tasks between two looks."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, value, details)
        await asyncio.sleep(interval)


def _timed_out(what: str, timeout: float, value: object, details: Callable[[], object] | None) -> WaitTimeout:
    shown = repr(value)
    if len(shown) > MAX_SHOWN_CHARS:
        shown = shown[:MAX_SHOWN_CHARS] + " ..."
    message = f"timed out after {timeout:g} s waiting for {what} (last value: {shown})"
    if details is not None:
        try:
            message += f"\n{details()}"
        except Exception as exc:  # the timeout is the failure to report, not this
            message += f"\n(details unavailable: {exc!r})"
    return WaitTimeout(message)
