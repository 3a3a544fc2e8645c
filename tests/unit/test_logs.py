"""splitserve/logs.py on a FakeClock: one line per error, one message per key and interval,
and the count of what was held back on the next line let through."""

from __future__ import annotations

import logging

import grpc

from splitserve.logs import RateLimitedLog, one_line_error
from splitserve.testing.clock import FakeClock

LOGGER = "splitserve.test_logs"


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    # what a failed unary call raises; its repr carries the multi-line debug string
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details,
                                'UNKNOWN:Error received from peer {grpc_status:4,\n created_time:"2026"}')


def test_a_grpc_error_is_its_code_and_details_on_one_line():
    exc = _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert "\n" in repr(exc) and "debug_error_string" in repr(exc)      # what was logged before
    assert one_line_error(exc) == "DEADLINE_EXCEEDED: Deadline Exceeded"
    assert one_line_error(_rpc_error(grpc.StatusCode.UNAVAILABLE, "")) == "UNAVAILABLE"


def test_other_errors_are_type_and_message_folded_to_one_line():
    assert one_line_error(ValueError("bad\n  value")) == "ValueError: bad value"
    assert one_line_error(KeyError()) == "KeyError"


def test_one_message_per_key_and_interval_then_the_count_of_repeats(caplog):
    clock = FakeClock()
    limited = RateLimitedLog(logging.getLogger(LOGGER), interval_s=30.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert limited.warning(("w0", "stats"), "stats of %s failed: %s", "w0", "DEADLINE_EXCEEDED")
        for _ in range(59):                       # every 0.5 s for the next 29.5 s
            clock.advance(0.5)
            assert not limited.warning(("w0", "stats"), "stats of %s failed: %s", "w0", "DEADLINE_EXCEEDED")
        assert limited.suppressed(("w0", "stats")) == 59
        assert limited.warning(("w1", "stats"), "stats of %s failed: %s", "w1", "UNAVAILABLE")   # its own key
        clock.advance(0.5)                        # 30 s after the first line
        assert limited.warning(("w0", "stats"), "stats of %s failed: %s", "w0", "DEADLINE_EXCEEDED")
    assert [r.getMessage() for r in caplog.records] == [
        "stats of w0 failed: DEADLINE_EXCEEDED",
        "stats of w1 failed: UNAVAILABLE",
        "stats of w0 failed: DEADLINE_EXCEEDED (59 more like this in the last 30 s)"]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert limited.suppressed(("w0", "stats")) == 0


def test_a_quiet_key_logs_again_without_a_count_and_forget_drops_keys(caplog):
    clock = FakeClock()
    limited = RateLimitedLog(logging.getLogger(LOGGER), interval_s=30.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert limited.log(logging.INFO, "k", "once")
        clock.advance(31.0)
        assert limited.log(logging.INFO, "k", "once")            # nothing held back: no count
        assert not limited.log(logging.INFO, "k", "once")
        limited.forget(lambda key: key == "k")
        assert limited.log(logging.INFO, "k", "once")            # forgotten: logs at once
    assert [r.getMessage() for r in caplog.records] == ["once"] * 3


def test_a_zero_interval_logs_everything(caplog):
    limited = RateLimitedLog(logging.getLogger(LOGGER), interval_s=0.0, clock=FakeClock())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert all(limited.warning("k", "m") for _ in range(3))
    assert len(caplog.records) == 3
