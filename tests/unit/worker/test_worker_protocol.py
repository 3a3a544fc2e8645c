"""The worker<->frontend contract (services/worker_protocol): torch-free, engine-free, and its proto
conversions lose nothing a request or an output says.

Both sides import services/worker_protocol; the frontend must be able to without pulling in
torch or the engine, so every module of the package is imported in a fresh
interpreter and what it loaded is checked.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import splitserve.services.worker_protocol as worker_protocol
from splitserve.errors import InvalidRequestError
from splitserve.proto.v1 import common_pb2
from splitserve.services.worker_protocol.proto_conversion import (finish_reason_from_proto, finish_reason_to_proto, params_from_proto,
                                              params_to_proto)
from splitserve.services.worker_protocol.outputs import FinishReason
from splitserve.services.worker_protocol.sampling_params import SamplingParams


def test_the_worker_protocol_package_imports_neither_torch_nor_the_engine():
    names = [f"{worker_protocol.__name__}.{m.name}" for m in pkgutil.iter_modules(worker_protocol.__path__)]
    assert {"splitserve.services.worker_protocol.proto_conversion", "splitserve.services.worker_protocol.outputs"} <= set(names)
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "json.dump(sorted(sys.modules), sys.stdout)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout)
    assert "torch" not in modules
    assert not [m for m in modules if m.split(".")[:3] in (["splitserve", "services", "engine"],
                                                           ["splitserve", "services", "worker"])]


def test_sampling_params_survive_the_wire():
    params = SamplingParams(max_tokens=9, temperature=0.5, top_k=4, top_p=0.8, min_p=0.1, seed=0,
                            stop=["\n"], stop_token_ids=[7], ignore_eos=True, logprobs=0,
                            include_stop_str_in_output=True, num_prior_draws=3, presence_penalty=-0.5,
                            frequency_penalty=1.5, repetition_penalty=1.2, logit_bias={3: -100.0, 11: 2.5},
                            min_tokens=2, num_prior_output_tokens=4)
    assert params_from_proto(params_to_proto(params)) == params
    unset = params_from_proto(params_to_proto(SamplingParams()))
    assert unset == SamplingParams() and unset.seed is None and unset.logprobs is None
    with pytest.raises(InvalidRequestError):
        params_from_proto(common_pb2.SamplingParams(max_tokens=0))


def test_finish_reasons_survive_the_wire():
    for reason in [None, *FinishReason]:
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason
