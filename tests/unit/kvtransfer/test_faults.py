"""The KV fault switch (kvtransfer/faults.py): its spec, its rates, the file that turns it on and off."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.kvtransfer.faults import (FAULT_FILE_ENV, FAULT_SEED_ENV, FAULTS_ENV, Fault, FaultSpecError, FaultSwitch,
                                         flip_bit, parse)


def test_the_spec_names_sites_kinds_and_rates():
    assert parse("transfer=corrupt, disk=drop@0.25,host=flip,store=flip@1") == {
        "transfer": Fault("corrupt"), "disk": Fault("drop", 0.25), "host": Fault("flip"), "store": Fault("flip")}
    assert parse("drop") == {"transfer": Fault("drop")}          # the fault file's older form
    assert parse("") == {}


@pytest.mark.parametrize("bad, says", [("disk=melt", "SITE=KIND"), ("gpu=flip", "SITE=KIND"), ("host", "SITE=KIND"),
                                       ("host=flip@2", "from 0 to 1"), ("host=flip@x", "from 0 to 1")])
def test_a_bad_spec_names_what_is_accepted(bad, says):
    with pytest.raises(FaultSpecError, match=says) as info:
        parse(bad)
    assert "transfer=drop|corrupt" in str(info.value) or "RATE" in str(info.value)


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    monkeypatch.delenv(FAULT_FILE_ENV, raising=False)
    switch = FaultSwitch.from_env()
    assert not switch.armed
    assert switch.hit("host") == "" and not switch.injected


def test_every_event_at_rate_one_and_about_rate_of_them_below(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "host=flip,disk=flip@0.3")
    monkeypatch.setenv(FAULT_SEED_ENV, "7")
    switch = FaultSwitch.from_env()
    assert [switch.hit("host") for _ in range(5)] == ["flip"] * 5
    hits = sum(switch.hit("disk") == "flip" for _ in range(2000))
    assert 500 < hits < 700
    assert switch.hit("store") == "" and switch.hit("transfer") == ""
    assert switch.injected == {"host": 5, "disk": hits}


def test_the_file_turns_faults_on_and_off_while_the_process_runs(monkeypatch, tmp_path):
    path = tmp_path / "faults"
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    monkeypatch.setenv(FAULT_FILE_ENV, str(path))
    switch = FaultSwitch.from_env()
    assert switch.armed and switch.hit("transfer") == ""              # armed, but no file yet
    path.write_text("corrupt")
    assert switch.hit("transfer") == "corrupt"
    path.write_text("transfer=drop,store=flip")
    assert switch.hit("transfer") == "drop" and switch.hit("store") == "flip"
    path.write_text("store=boil")                                     # a bad file: logged, nothing injected
    assert switch.hit("store") == ""
    path.unlink()
    assert switch.hit("transfer") == "" and switch.injected == {"transfer": 2, "store": 1}


def test_flip_bit_changes_exactly_one_bit():
    data = np.zeros(64, dtype=np.uint8)
    flip_bit(data)
    assert np.unpackbits(data).sum() == 1
    buffer = bytearray(b"\xff" * 8)
    flip_bit(buffer, 3)
    assert buffer == b"\xff\xff\xff\xef\xff\xff\xff\xff"
