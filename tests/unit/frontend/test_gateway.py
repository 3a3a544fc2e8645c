"""Gateway mode's prefill header (services/frontend/gateway.py)."""

from __future__ import annotations

import pytest

from splitserve.services.cli.main import main as cli_main
from splitserve.services.frontend.errors import APIError
from splitserve.services.frontend.gateway import gateway_prefill_address


def test_the_header_names_the_prefill_worker():
    assert gateway_prefill_address([(b"host", b"x"), (b"x-prefiller-host-port", b"10.0.0.9:50051")]) == \
        "10.0.0.9:50051"
    assert gateway_prefill_address([(b"X-Prefiller-Host-Port", b" [fd00::9]:50051, 10.0.0.8:50051")]) == \
        "[fd00::9]:50051"                       # llm-d may list several: the first
    assert gateway_prefill_address([(b"host", b"x")]) == ""          # absent: prefill locally
    assert gateway_prefill_address([(b"x-prefiller-host-port", b"")]) == ""


@pytest.mark.parametrize("value", [b"10.0.0.9", b"10.0.0.9:http", b":50051", b"10.0.0.9:0", b"10.0.0.9:70000"])
def test_a_value_that_is_no_host_port_is_a_400_naming_the_header(value):
    with pytest.raises(APIError) as refused:
        gateway_prefill_address([(b"x-prefiller-host-port", value)])
    assert refused.value.status == 400 and "x-prefiller-host-port" in refused.value.message


def test_gateway_mode_takes_no_prefill_worker_flag(capsys):
    assert cli_main(["frontend", "--gateway", "--worker", "decode=127.0.0.1:1", "--worker", "prefill=127.0.0.1:2"]) != 0
    assert "x-prefiller-host-port" in capsys.readouterr().err
