"""SIGTERM/SIGINT for a server's asyncio loop: they set its stop event, until it has stopped."""

from __future__ import annotations

import asyncio
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def handle_stop_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)


def ignore_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Once stopped: a repeated SIGTERM (a supervisor asking again) while asyncio.run closes the
    loop would hit its closed wakeup fd ("Exception ignored ... Bad file descriptor")."""
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
