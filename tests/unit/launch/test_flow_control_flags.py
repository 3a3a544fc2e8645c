"""The --flow-control flags: what `splitserve frontend` builds from them, what it refuses, and
what `serve` hands each frontend it starts (parsed back by the frontend's own parser)."""

from __future__ import annotations

import math

import pytest

from splitserve.errors import SplitserveError
from splitserve.services.cli.flow_control_args import flow_control_settings, parse_band
from splitserve.services.cli.parsers import build_parser
from splitserve.services.flow_control import BandConfig
from splitserve.services.frontend.flow_admission import FlowControlSettings
from splitserve.services.launch.children import frontend_argv


def _frontend(*flags: str):
    return build_parser().parse_args(["frontend", "--worker", "both=127.0.0.1:1", *flags])


def test_flow_control_is_off_by_default_and_its_flags_need_it():
    assert flow_control_settings(_frontend()) is None
    with pytest.raises(SplitserveError, match="--max-concurrency, --priority-band need --flow-control"):
        flow_control_settings(_frontend("--max-concurrency", "4", "--priority-band", "0"))


def test_the_defaults_and_the_bands_given():
    assert flow_control_settings(_frontend("--flow-control")) == FlowControlSettings()
    settings = flow_control_settings(_frontend(
        "--flow-control", "--max-concurrency", "8", "--max-queue", "16", "--max-queue-wait", "inf",
        "--priority-band", "10,max-queue=4,min-share=0.1", "--priority-band", "0,max-wait=2.5"))
    assert settings == FlowControlSettings((BandConfig(0, 16, 2.5), BandConfig(10, 4, math.inf, 0.1)), 8)


@pytest.mark.parametrize("spec, problem", [
    ("x", "invalid literal"), ("0,depth=3", "not one of"), ("0,max-queue=1,max-queue=2", "at most once"),
    ("0,max-queue=0", "max_queue must be an integer >= 1"), ("0,max-wait=0", "max_wait_s must be > 0"),
    ("0,min-share=2", "min_share must be within"),
])
def test_a_band_that_cannot_work_is_refused_naming_it(spec, problem):
    with pytest.raises(SplitserveError, match=problem):
        parse_band(spec, 8, 1.0)


def test_fair_shares_are_on_by_default_and_their_flags_build_the_library_config():
    default = flow_control_settings(_frontend("--flow-control"))
    assert (default.fair_share, default.burst) == (True, 4)
    assert default.config().fair_share and default.config().burst == 4
    given = flow_control_settings(_frontend("--flow-control", "--fair-share-burst", "0"))
    assert (given.fair_share, given.burst, given.config().burst) == (True, 0, 0)
    off = flow_control_settings(_frontend("--flow-control", "--no-fair-share"))
    assert off.fair_share is False and off.config().fair_share is False
    assert "round-robin" in off.describe() and "fair shares (burst 4)" in default.describe()
    with pytest.raises(SplitserveError, match="--no-fair-share, --fair-share-burst need --flow-control"):
        flow_control_settings(_frontend("--no-fair-share", "--fair-share-burst", "2"))
    with pytest.raises(SplitserveError, match="--fair-share-burst must be >= 0"):
        flow_control_settings(_frontend("--flow-control", "--fair-share-burst", "-1"))


def test_contradicting_bands_and_a_zero_room_are_refused():
    with pytest.raises(SplitserveError, match="given to two bands"):
        flow_control_settings(_frontend("--flow-control", "--priority-band", "0", "--priority-band", "0"))
    with pytest.raises(SplitserveError, match="min_share add up to 1.2"):
        flow_control_settings(_frontend("--flow-control", "--priority-band", "0,min-share=0.6",
                                        "--priority-band", "1,min-share=0.6"))
    with pytest.raises(SplitserveError, match="--max-concurrency must be an integer >= 1"):
        flow_control_settings(_frontend("--flow-control", "--max-concurrency", "0"))


def _through_serve(*serve_flags: str) -> FlowControlSettings | None:
    parser = build_parser()
    serve = parser.parse_args(["serve", *serve_flags])
    frontend = parser.parse_args(["frontend", *frontend_argv(serve, "/m", "127.0.0.1", 8000, 8001, [], [])])
    return flow_control_settings(frontend)


def test_serve_gives_each_frontend_the_flags_and_its_share_of_the_running_batch():
    assert _through_serve() is None
    assert _through_serve("--flow-control") == FlowControlSettings(max_concurrency=64)        # --max-num-seqs
    assert _through_serve("--flow-control", "--max-num-seqs", "10", "--frontends", "3").max_concurrency == 3
    given = _through_serve("--flow-control", "--max-concurrency", "5", "--frontends", "2", "--max-queue", "7",
                           "--max-queue-wait", "9", "--priority-band", "3,min-share=0.2", "--priority-band", "-2")
    assert given == FlowControlSettings((BandConfig(-2, 7, 9.0), BandConfig(3, 7, 9.0, 0.2)), 5)
    fairness = _through_serve("--flow-control", "--no-fair-share", "--fair-share-burst", "2")
    assert (fairness.fair_share, fairness.burst) == (False, 2)


def test_serve_refuses_flow_control_on_ray_before_starting_anything():
    from splitserve.services.cli.commands import cmd_serve

    with pytest.raises(SplitserveError, match="--flow-control is not available on Ray"):
        cmd_serve(build_parser().parse_args(["serve", "--on-ray", "--flow-control"]))
