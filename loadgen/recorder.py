"""What happened to each request (`RequestRecord`) and the run's running tally (`Recorder`).

A record is filled by the client as the response streams in: timestamps are
seconds on the run's monotonic clock (`start_s`, `end_s`: since the run began;
`chunk_times_s`: since this request's start, one per chunk with non-empty
content). Latencies are derived from them once the request ends
(`metrics.finish_record`). `to_json()` is the per-request entry of the run's JSON
file; the answer text stays in memory only (multi-turn prompts need it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

CANCELLED = "cancelled"      # still running when the run's time was up; not a server error


@dataclass(slots=True)
class RequestRecord:
    request_index: int
    conversation_id: str
    turn: int
    max_tokens: int
    num_prompt_tokens: int | None        # counted locally from what was sent, as the server should count it
    scheduled_s: float | None = None     # when the arrival process wanted it sent (open loop)
    start_s: float = 0.0
    end_s: float | None = None
    group: str | None = None
    ok: bool = False
    error_kind: str | None = None        # http_<status>, connect, disconnected, timeout, stream_error, ...
    error: str | None = None
    status_code: int | None = None
    prompt_tokens: int | None = None     # the server's usage
    cached_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_source: str | None = None   # "usage" or "tokenizer"
    chunk_times_s: list[float] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    output_text: str = ""

    def fail(self, kind: str, message: str, status_code: int | None = None) -> None:
        self.ok, self.error_kind, self.error = False, kind, message[:500]
        if status_code is not None:
            self.status_code = status_code

    def to_json(self) -> dict:
        out = asdict(self)
        del out["output_text"]
        out["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        return out


@dataclass(slots=True)
class Recorder:
    """Collects records and keeps the counts a progress display shows."""

    records: list[RequestRecord] = field(default_factory=list)
    num_in_flight: int = 0
    errors: Counter = field(default_factory=Counter)
    on_change: Callable[["Recorder"], None] | None = None

    def started(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.num_in_flight += 1
        self._changed()

    def finished(self, record: RequestRecord) -> None:
        self.num_in_flight -= 1
        if not record.ok:
            self.errors[record.error_kind] += 1
        self._changed()

    @property
    def num_done(self) -> int:
        return len(self.records) - self.num_in_flight

    @property
    def num_ok(self) -> int:
        return sum(1 for r in self.records if r.ok)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)


def records_from_json(entries: list[dict]) -> list[RequestRecord]:
    """Rebuild records from a run document's `requests` (for plots of a saved run)."""
    names = set(RequestRecord.__slots__)
    return [RequestRecord(**{k: v for k, v in entry.items() if k in names}) for entry in entries]
