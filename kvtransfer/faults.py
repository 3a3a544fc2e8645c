"""Fault injection for KV that moves: prove that a damaged block never becomes a token.

Off unless switched on. A process reads its faults from the environment:

- `SPLITSERVE_KV_FAULTS="SITE=KIND[@RATE],..."`: fixed for the process's life;
- `SPLITSERVE_KV_FAULT_FILE=PATH`: the same text, read from PATH at each event while the file
  exists, so a test or an operator turns faults on and off without a restart. A file
  holding only `drop` or `corrupt` means `transfer=drop` / `transfer=corrupt` (its older form);
- `SPLITSERVE_KV_FAULT_SEED=N`: which events a RATE below 1 hits, the same in every run.

Sites and kinds; RATE is the chance (0..1, default 1) that one event is hit:

| site | kind | the event | what catches it |
|---|---|---|---|
| `transfer` | `drop`, `corrupt` | one verified prompt send: its middle layer's writes are not posted, or posted from other source blocks | the receiver's digest (transfer_digest.py): TransferError, the prompt recomputed |
| `host` | `flip` | one block stored in the host tier: a bit flips in its slot | the slot's checksum on load: rejected `corrupt`, recomputed |
| `disk` | `flip`, `drop` | one block written to the disk tier: a bit flips in the file, or the file is never written | the frame's checksum (block_codec.py) on read: rejected `corrupt` / `io_error` |
| `store` | `flip` | one block fetched from, or published to, the shared store: a bit flips after its checksum was taken | the fetcher's check (`store_corrupt`) or the store's (`rejected_corrupt`) |

Every injection is counted (`injected`, by site) and logged as a warning; the catching side's
counters are the ones a test compares with it.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger(__name__)

FAULTS_ENV = "SPLITSERVE_KV_FAULTS"
FAULT_FILE_ENV = "SPLITSERVE_KV_FAULT_FILE"
FAULT_SEED_ENV = "SPLITSERVE_KV_FAULT_SEED"      # which events a RATE below 1 hits, reproducibly
KINDS = {"transfer": ("drop", "corrupt"), "host": ("flip",), "disk": ("flip", "drop"), "store": ("flip",)}


class FaultSpecError(ValueError):
    pass


@dataclass(slots=True, frozen=True)
class Fault:
    kind: str
    rate: float = 1.0


def parse(text: str) -> dict[str, Fault]:
    """`SITE=KIND[@RATE],...` (or the file's older `drop` / `corrupt`) -> {site: Fault}."""
    text = text.strip()
    if text in KINDS["transfer"]:
        return {"transfer": Fault(text)}
    faults: dict[str, Fault] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        site, sep, rest = item.partition("=")
        kind, _, rate_text = rest.partition("@")
        site, kind = site.strip(), kind.strip()
        if not sep or site not in KINDS or kind not in KINDS[site]:
            raise FaultSpecError(f"bad KV fault {item!r}: expected SITE=KIND[@RATE] with "
                                 + "; ".join(f"{s}={'|'.join(k)}" for s, k in KINDS.items()))
        try:
            rate = float(rate_text) if rate_text else 1.0
        except ValueError:
            rate = -1.0
        if not 0.0 <= rate <= 1.0:
            raise FaultSpecError(f"bad KV fault {item!r}: RATE must be a number from 0 to 1")
        faults[site] = Fault(kind, rate)
    return faults


class FaultSwitch:
    """This process's faults (module docstring); `hit(site)` decides one event."""

    def __init__(self, fixed: str = "", path: str = "", seed: int | None = None):
        self.fixed = parse(fixed) if fixed else {}
        self.path = path
        self.injected: Counter[str] = Counter()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._file_text: str | None = None
        self._file_faults: dict[str, Fault] = {}

    @classmethod
    def from_env(cls) -> "FaultSwitch":
        seed = os.environ.get(FAULT_SEED_ENV, "")
        return cls(os.environ.get(FAULTS_ENV, ""), os.environ.get(FAULT_FILE_ENV, ""),
                   int(seed) if seed.strip().lstrip("-").isdigit() else None)

    @property
    def armed(self) -> bool:
        """Whether any fault can be injected (a cheap test before the per-event work)."""
        return bool(self.fixed or self.path)

    def faults(self) -> dict[str, Fault]:
        if not self.path:
            return self.fixed
        try:
            with open(self.path) as f:          # each time: a switch, not a hot path
                text = f.read()
        except OSError:
            return self.fixed
        with self._lock:
            if text != self._file_text:
                self._file_text = text
                try:
                    self._file_faults = parse(text)
                except FaultSpecError as exc:
                    log.warning("KV faults: %s: %s; none injected from it", self.path, exc)
                    self._file_faults = {}
            return {**self.fixed, **self._file_faults}

    def hit(self, site: str, what: str = "") -> str:
        """The kind of fault to inject into this event at `site`, or "" (none); counted and logged."""
        if not self.armed:
            return ""
        fault = self.faults().get(site)
        if fault is None:
            return ""
        with self._lock:
            if fault.rate < 1.0 and self._random.random() >= fault.rate:
                return ""
            self.injected[site] += 1
        log.warning("KV faults: injecting %s=%s%s (%s)", site, fault.kind, f" into {what}" if what else "",
                    FAULTS_ENV if site in self.fixed else self.path)
        return fault.kind

    def flip(self, site: str, buffer, what: str = "") -> bool:
        """Flip one bit of `buffer` if this event at `site` is hit by a `flip` fault."""
        if self.hit(site, what) != "flip":
            return False
        flip_bit(buffer)
        return True


def flip_bit(buffer, index: int | None = None) -> None:
    """Flip one bit of a writable buffer (a bytearray, a numpy or memoryview of bytes)."""
    view = memoryview(buffer).cast("B")
    i = len(view) // 2 if index is None else index
    view[i] ^= 0x10

