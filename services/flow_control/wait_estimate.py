"""How long a newcomer would wait in a band: its position times the band's dispatch interval.

The interval is an EWMA of the time between two dispatches from the band's queue, sampled only
while the band has requests waiting (the first sample of a busy spell runs from the moment the
queue stopped being empty): an idle band's gaps measure its arrivals, not how fast it drains.
It already holds everything that slows the band down: its share of capacity, higher bands
overtaking it, how long requests hold their tickets. A newcomer with `n` requests ahead of it is
dispatched at the band's (n + 1)-th dispatch, so its estimated wait is (n + 1) × the interval.
Until the first sample there is no estimate, and no deadline is judged unmeetable on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DispatchInterval:
    """EWMA of one band's time between queued dispatches; `smoothing` weighs the newest sample."""

    smoothing: float
    mean_s: float | None = None
    _since: float | None = None      # the last dispatch, or when the queue stopped being empty

    def became_busy(self, now: float) -> None:
        self._since = now

    def became_idle(self) -> None:
        self._since = None

    def dispatched(self, now: float) -> None:
        if self._since is not None:
            sample = max(0.0, now - self._since)
            self.mean_s = sample if self.mean_s is None else self.mean_s + self.smoothing * (sample - self.mean_s)
        self._since = now

    def estimate_wait_s(self, num_ahead: int) -> float | None:
        """Seconds until a request with `num_ahead` requests before it is dispatched; None: no sample yet."""
        return None if self.mean_s is None else (num_ahead + 1) * self.mean_s
