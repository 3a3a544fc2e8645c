"""Flow control's configuration: every field that cannot work is a ValueError naming it."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from splitserve.services.flow_control import BandConfig, ConcurrencyLimit, FlowControlConfig, FlowControlMetrics
from splitserve.services.flow_control.capacity import SizedCapacity

from .conftest import band


@pytest.mark.parametrize("bands, overrides, field", [
    ((), {}, "bands"),
    ((band(0, max_queue=0),), {}, r"bands\[0\]\.max_queue"),
    ((band(0), band(1, max_queue=2.5)), {}, r"bands\[1\]\.max_queue"),
    ((band(0, max_wait_s=0.0),), {}, r"bands\[0\]\.max_wait_s"),
    ((band(0, max_wait_s=math.nan),), {}, r"bands\[0\]\.max_wait_s"),
    ((band(0, min_share=-0.1),), {}, r"bands\[0\]\.min_share"),
    ((band(0, min_share=1.5),), {}, r"bands\[0\]\.min_share"),
    ((BandConfig(priority="high", max_queue=1, max_wait_s=1.0),), {"default_priority": "high"},
     r"bands\[0\]\.priority"),
    ((band(0), band(0)), {}, r"bands\[1\]\.priority"),
    ((band(0, min_share=0.6), band(1, min_share=0.6)), {}, "min_share add up"),
    ((band(0),), {"default_priority": 3}, "default_priority"),
    ((band(0),), {"share_window": 0}, "share_window"),
    ((band(0),), {"interval_smoothing": 0.0}, "interval_smoothing"),
    ((band(0),), {"interval_smoothing": 1.5}, "interval_smoothing"),
    ((band(0),), {"fair_share": 1}, "fair_share"),
    ((band(0),), {"burst": -1}, "burst"),
    ((band(0),), {"burst": 1.5}, "burst"),
])
def test_a_value_that_cannot_work_names_its_field(bands, overrides, field):
    with pytest.raises(ValueError, match=field):
        FlowControlConfig(bands=bands, **overrides)


def test_a_valid_config_keeps_its_bands_and_finds_the_band_of_a_priority():
    config = FlowControlConfig(bands=[band(0), band(10, min_share=0.1, max_wait_s=math.inf)], default_priority=10)
    assert isinstance(config.bands, tuple)
    assert config.band_for(0).priority == 0
    assert config.band_for(10).min_share == 0.1
    assert config.band_for(-3).priority == 10                          # no band: the default band


@pytest.mark.parametrize("max_in_flight", [0, -1, 1.5, True])
def test_a_concurrency_limit_needs_a_positive_integer(max_in_flight):
    with pytest.raises(ValueError, match="max_in_flight"):
        ConcurrencyLimit(max_in_flight)


def test_a_concurrency_limit_refuses_to_go_past_its_bounds_unless_told_beyond_the_room():
    limit = ConcurrencyLimit(1)
    assert isinstance(limit, SizedCapacity) and limit.units() == 1
    limit.take()
    assert not limit.has_room()
    with pytest.raises(RuntimeError):
        limit.take()
    limit.take(beyond_room=True)                     # fair sharing's burst (the controller bounds it)
    assert limit.num_in_flight == 2 and not limit.has_room()
    limit.give_back()
    limit.give_back()
    with pytest.raises(RuntimeError):
        limit.give_back()


def test_fair_sharing_is_on_by_default():
    config = FlowControlConfig(bands=[band(0)])
    assert (config.fair_share, config.burst) == (True, 4)


def test_metrics_refuse_a_negative_number_of_flow_series():
    with pytest.raises(ValueError, match="num_flow_series"):
        FlowControlMetrics(CollectorRegistry(), num_flow_series=-1)
