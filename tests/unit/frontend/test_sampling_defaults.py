"""Defaults of omitted sampling parameters from generation_config.json (--generation-config).

Requests go through the real HTTP parsing (GenerationEndpoints.prepare_chat /
prepare_completion) and the real Frontend.sampling_params over a real tokenizer;
only the worker pool is a stand-in that reports one ready decode worker.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import orjson
import pytest

from splitserve.errors import ModelLoadError
from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.services.frontend.core import Frontend
from splitserve.services.frontend.http.generation import GenerationEndpoints
from splitserve.services.frontend.metrics import FrontendMetrics
from splitserve.services.frontend.sampling_defaults import (
    GenerationConfigError, SamplingDefaults, load_sampling_defaults)
from splitserve.services.frontend.server import FrontendConfig, build_frontend
from splitserve.services.frontend.workers.pool import WorkerAddress, WorkerPool
from splitserve.services.text.tokenizer import Tokenizer

MODEL = "served"


class ReadyPool:
    """One ready decode worker with a 256-token context: all that sampling_params reads."""

    def __init__(self):
        self.workers = [SimpleNamespace(info=SimpleNamespace(model_name=MODEL, max_model_len=256))]

    def ready(self, role_filter=None):
        return self.workers


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return Tokenizer(open_checkpoint(str(llama_dir)))


def _endpoints(tokenizer, defaults: SamplingDefaults | None) -> GenerationEndpoints:
    frontend = Frontend(tokenizer, ReadyPool(), None, FrontendMetrics(), MODEL, sampling_defaults=defaults)
    return GenerationEndpoints(None, frontend)


def _chat(endpoints: GenerationEndpoints, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return endpoints.prepare_chat(orjson.dumps(body)).gen.params


def _completion(endpoints: GenerationEndpoints, **fields):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, **fields}
    return endpoints.prepare_completion(orjson.dumps(body)).gen.params


def _folder(tmp_path, config) -> str:
    (tmp_path / "generation_config.json").write_text(
        config if isinstance(config, str) else json.dumps(config), encoding="utf-8")
    return str(tmp_path)


AUTHORS = {"bos_token_id": 1, "temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "do_sample": True}


@pytest.mark.parametrize("prepare", [_chat, _completion], ids=["chat", "completions"])
def test_omitted_parameters_take_the_files_values_and_sent_ones_win(tokenizer, tmp_path, prepare):
    endpoints = _endpoints(tokenizer, load_sampling_defaults(_folder(tmp_path, AUTHORS)))
    omitted = prepare(endpoints)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.min_p) == (0.2, 0.9, 20, 0.05)
    sent = prepare(endpoints, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    assert (sent.temperature, sent.top_p, sent.top_k, sent.min_p) == (0.0, 1.0, 0, 0.0)
    one = prepare(endpoints, temperature=1.5)            # each parameter on its own
    assert (one.temperature, one.top_p, one.top_k, one.min_p) == (1.5, 0.9, 20, 0.05)


def test_absent_keys_leave_the_engines_neutral_defaults(tokenizer, tmp_path):
    defaults = load_sampling_defaults(_folder(tmp_path, {"temperature": 0.7, "top_p": None}))
    assert defaults.overrides() == {"temperature": 0.7}
    params = _chat(_endpoints(tokenizer, defaults))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 1.0, 0, 0.0)
    neutral = _chat(_endpoints(tokenizer, None))          # no defaults at all: as before
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p) == (1.0, 1.0, 0, 0.0)


def test_vllm_ignores_the_models_file_and_auto_reads_it():
    assert load_sampling_defaults("vllm", AUTHORS).overrides() == {}
    assert load_sampling_defaults("auto", AUTHORS, "/m").overrides() == {
        "temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.05}
    assert load_sampling_defaults("auto", {}, "/m").overrides() == {}
    assert load_sampling_defaults("auto", None, "/m").overrides() == {}


def test_a_path_may_name_the_folder_or_the_file(tmp_path):
    folder = _folder(tmp_path, {"top_k": -1, "temperature": 1})
    for path in (folder, f"{folder}/generation_config.json"):
        defaults = load_sampling_defaults(path)
        assert defaults.overrides() == {"temperature": 1.0, "top_k": 0}       # -1 (vLLM's "off") is 0 here
        assert defaults.source.endswith("generation_config.json")


def test_the_start_up_line_says_what_is_in_use(tmp_path):
    line = load_sampling_defaults(_folder(tmp_path, {"temperature": 0.2, "repetition_penalty": 1.1})).startup_line()
    assert "overridden by the model's generation config" in line and "temperature=0.2" in line
    assert "--generation-config vllm" in line
    assert "repetition_penalty=1.1" in line and "not applied" not in line      # the engine applies it now
    assert "neutral defaults" in load_sampling_defaults("vllm").startup_line()


def test_the_models_repetition_penalty_is_the_default_of_a_request_that_omits_it(tokenizer, tmp_path):
    endpoints = _endpoints(tokenizer, load_sampling_defaults(_folder(tmp_path, {"repetition_penalty": 1.1})))
    assert _chat(endpoints).repetition_penalty == 1.1
    assert _chat(endpoints, repetition_penalty=1.0).repetition_penalty == 1.0
    assert _chat(_endpoints(tokenizer, None)).repetition_penalty == 1.0


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "must hold a JSON object"),
    ("{\"temperature\": ", "cannot read"),
    ({"temperature": "hot"}, "temperature must be a number in [0, 100]"),
    ({"temperature": -0.5}, "temperature must be a number"),
    ({"top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"top_p": True}, "top_p must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"min_p": 1.5}, "min_p must be a number in [0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number"),
], ids=["not-an-object", "not-json", "string", "negative", "top_p-0", "bool", "float-top_k", "min_p", "penalty"])
def test_a_malformed_file_is_a_clear_error(tmp_path, content, message):
    with pytest.raises(GenerationConfigError) as info:
        load_sampling_defaults(_folder(tmp_path, content))
    assert message in str(info.value) and "generation_config.json" in str(info.value)


def test_a_folder_without_the_file_is_a_clear_error(tmp_path):
    with pytest.raises(GenerationConfigError, match="no generation_config.json there"):
        load_sampling_defaults(str(tmp_path / "missing"))


def _build(model, mode: str) -> Frontend:
    """build_frontend as `splitserve frontend` calls it (inside a running loop; nothing starts)."""
    async def build():
        pool = WorkerPool.connect([WorkerAddress.parse("decode=127.0.0.1:1")])
        try:
            return build_frontend(FrontendConfig(model=str(model), generation_config=mode), pool)[0]
        finally:
            await pool.close()
    return asyncio.run(build())


def test_build_frontend_reads_the_model_folders_file_and_prints_one_line(llama_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.8}))
    assert _build(model, "auto").sampling_defaults.overrides() == {"temperature": 0.3, "top_p": 0.8}
    lines = [line for line in capsys.readouterr().out.splitlines() if "sampling parameters" in line]
    assert len(lines) == 1 and "temperature=0.3, top_p=0.8" in lines[0] and str(model) in lines[0]
    assert _build(model, "vllm").sampling_defaults.overrides() == {}


def test_build_frontend_stops_at_a_malformed_model_file(llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt model file .*generation_config.json"):
        _build(model, "auto")
    (model / "generation_config.json").write_text(json.dumps({"temperature": "warm"}))
    with pytest.raises(GenerationConfigError, match="temperature must be a number"):
        _build(model, "auto")


@pytest.mark.parametrize("given, expected", [([], "auto"), (["--generation-config", "vllm"], "vllm"),
                                             (["--generation-config", "/m/gen"], "/m/gen")])
def test_serve_forwards_the_flag_to_the_frontends_it_starts(given, expected):
    from splitserve.services.cli.parsers import build_parser
    from splitserve.services.launch.children import frontend_argv

    parser = build_parser()
    serve = parser.parse_args(["serve", *given])
    argv = frontend_argv(serve, "/m", "127.0.0.1", 8000, 8001, [], [])
    assert parser.parse_args(["frontend", "--worker", "both=127.0.0.1:1", *argv]).generation_config == expected


def test_an_omitted_max_tokens_is_a_cap_the_planner_counts_only_where_the_api_has_a_default(tokenizer):
    # Completions default to 16 tokens (vLLM, OpenAI); a chat without one may run to the end of
    # the context, which says nothing of its length (the planner's output prior, core.py).
    endpoints = _endpoints(tokenizer, None)

    def gen(prepare, **body):
        return prepare(orjson.dumps({"model": MODEL, **body})).gen

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    uncapped = gen(endpoints.prepare_chat, **chat)
    assert not uncapped.max_tokens_from_client and uncapped.params.max_tokens > 200
    capped = gen(endpoints.prepare_chat, **chat, max_completion_tokens=7)
    assert capped.max_tokens_from_client and capped.params.max_tokens == 7
    default = gen(endpoints.prepare_completion, prompt=[5, 6, 7])
    assert default.max_tokens_from_client and default.params.max_tokens == 16
