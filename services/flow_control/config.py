"""Flow control's configuration: the priority bands and how dispatch is shared between them.

A band is the queue of one `priority` value. The direction is vLLM's (its request field
`priority`: "lower means earlier handling"), so a client's `priority` means the same thing to
splitserve's frontend, to an EPP in front of vLLM and to vLLM itself: a band with a lower value
is dispatched first. A request whose priority no band has goes to the default band.

Every field is checked when the object is built: a ValueError names the field whose value cannot
work, so a bad flag or spec fails at start-up, not under load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_SHARE_WINDOW = 100        # dispatches over which each band's share is measured
DEFAULT_INTERVAL_SMOOTHING = 0.2  # weight of the newest interval in a band's dispatch-interval EWMA
DEFAULT_BURST = 4                 # units a steady flow may go beyond the room while a flood holds units


@dataclass(slots=True, frozen=True)
class BandConfig:
    """One priority band.

    priority: the `priority` value this band serves (lower: dispatched first).
    max_queue: requests that may wait in the band at once (in flight ones do not count).
    max_wait_s: a request still queued this long after it arrived is shed (math.inf: never).
    min_share: the fraction of the last `share_window` dispatches this band is owed while it has
      requests queued; a band below it goes before bands of lower priority value (0: none owed).
    """

    priority: int
    max_queue: int
    max_wait_s: float
    min_share: float = 0.0

    def validate(self, where: str = "band") -> None:
        """Raises ValueError naming the field (as `where.field`) whose value cannot work."""
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"{where}.priority must be an integer, not {self.priority!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError(f"{where}.max_queue must be an integer >= 1, not {self.max_queue!r}")
        if math.isnan(self.max_wait_s) or self.max_wait_s <= 0:
            raise ValueError(f"{where}.max_wait_s must be > 0 seconds (math.inf: no limit), not {self.max_wait_s!r}")
        if not 0.0 <= self.min_share <= 1.0:
            raise ValueError(f"{where}.min_share must be within [0, 1], not {self.min_share!r}")


@dataclass(slots=True, frozen=True)
class FlowControlConfig:
    """All bands, the band of priorities no band has, and how shares and waits are measured.

    share_window: how many of the most recent dispatches (all bands) a band's share is taken over.
    interval_smoothing: the EWMA weight of the newest interval between two dispatches from a
      band's queue; the estimated wait of a newcomer is its position times that EWMA.
    fair_share: within a band, the flow holding the fewest units goes first, the flow with the
      most requests waiting holds at most its fair share of the room while a lighter flow is
      active, and a lighter flow's request may go beyond the room by up to `burst` units
      (fair_share.py); off: plain round-robin.
    burst: how many units in all lighter flows' requests may take beyond the room (0: never).
    """

    bands: tuple[BandConfig, ...]
    default_priority: int = 0
    share_window: int = DEFAULT_SHARE_WINDOW
    interval_smoothing: float = DEFAULT_INTERVAL_SMOOTHING
    fair_share: bool = True
    burst: int = DEFAULT_BURST

    def __post_init__(self) -> None:
        object.__setattr__(self, "bands", tuple(self.bands))     # a list from a parser is fine too
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field whose value cannot work."""
        if not self.bands:
            raise ValueError("bands must name at least one band")
        seen: set[int] = set()
        for i, band in enumerate(self.bands):
            band.validate(f"bands[{i}]")
            if band.priority in seen:
                raise ValueError(f"bands[{i}].priority {band.priority} is given to two bands")
            seen.add(band.priority)
        if self.default_priority not in seen:
            raise ValueError(f"default_priority {self.default_priority} names no band (bands have {sorted(seen)})")
        total_share = sum(band.min_share for band in self.bands)
        if total_share > 1.0 + 1e-9:
            raise ValueError(f"bands' min_share add up to {total_share:g}; at most 1 can be owed")
        if isinstance(self.share_window, bool) or not isinstance(self.share_window, int) or self.share_window < 1:
            raise ValueError(f"share_window must be an integer >= 1 (dispatches), not {self.share_window!r}")
        if not 0.0 < self.interval_smoothing <= 1.0:
            raise ValueError(f"interval_smoothing must be within (0, 1], not {self.interval_smoothing!r}")
        if not isinstance(self.fair_share, bool):
            raise ValueError(f"fair_share must be True or False, not {self.fair_share!r}")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 0:
            raise ValueError(f"burst must be an integer >= 0 (units), not {self.burst!r}")

    def band_for(self, priority: int) -> BandConfig:
        """The band that serves `priority`: its own, else the default band."""
        by_priority = {band.priority: band for band in self.bands}
        return by_priority.get(priority) or by_priority[self.default_priority]
