"""The KV fault switch at the command line: a bad SPLITSERVE_KV_FAULTS stops `worker` and `serve`
before anything starts, with the accepted forms in the message; `--help` documents the switch."""

from __future__ import annotations

import pytest

from splitserve.services.cli.main import main


@pytest.mark.parametrize("command", [["worker", "--model", "nowhere"], ["serve", "--model", "nowhere"]])
def test_a_bad_fault_spec_is_refused_at_start(monkeypatch, capsys, command):
    monkeypatch.setenv("SPLITSERVE_KV_FAULTS", "disk=melt")
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "SPLITSERVE_KV_FAULTS: bad KV fault 'disk=melt'" in err and "disk=flip|drop" in err


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_help_documents_the_switch_and_the_weights_revision(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for name in ("SPLITSERVE_KV_FAULTS", "SPLITSERVE_KV_FAULT_FILE", "SPLITSERVE_KV_FAULT_SEED", "transfer=drop|corrupt",
                 "SPLITSERVE_WEIGHTS_REVISION"):
        assert name in out, name
