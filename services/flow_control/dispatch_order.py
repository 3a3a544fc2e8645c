"""Which band dispatches next: strict priority, except for a band owed its share.

Bands go by strict priority, the lowest `priority` value first (vLLM's direction, config.py),
with one exception that keeps every band from starving within its share: a band with requests
queued whose share of the last `share_window` dispatches (all bands, fast path included) is below
its `min_share` goes first. When several are owed, the one furthest below its share goes first,
ties to the lower priority value. The choice is a function of the queues and the window alone,
so it is deterministic.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from splitserve.services.flow_control.config import BandConfig


class ShareWindow:
    """The bands of the last `size` dispatches, and each band's share of them."""

    __slots__ = ("_recent", "_counts")

    def __init__(self, size: int) -> None:
        self._recent: deque[int] = deque(maxlen=size)
        self._counts: Counter[int] = Counter()

    def record(self, band: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._counts[self._recent[0]] -= 1
        self._recent.append(band)
        self._counts[band] += 1

    def share(self, band: int) -> float:
        """The fraction of the recorded dispatches that came from `band` (0 before any)."""
        return self._counts[band] / len(self._recent) if self._recent else 0.0


def pick_band(backlogged: Sequence[BandConfig], window: ShareWindow) -> BandConfig:
    """The band, of those with requests queued (at least one), whose request is dispatched next."""
    owed = [(band.min_share - window.share(band.priority), band) for band in backlogged
            if window.share(band.priority) < band.min_share]
    if owed:
        return max(owed, key=lambda item: (item[0], -item[1].priority))[1]
    return min(backlogged, key=lambda band: band.priority)
