"""A real `splitserve frontend` started before its worker, and its sampling defaults.

Readiness a client can trust: until a decode-capable worker is ready, GET /v1/models
answers 503 with the OpenAI error body (the official client raises, instead of
seeing an empty list and picking no model); once the worker is up, it lists the
model. And --generation-config FOLDER: a request that omits temperature gets the
folder's value (temperature 0 there: greedy, token for token what temperature=0
asks for), while a request that sets it keeps its own.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from splitserve.net import free_port
from splitserve.testing.cluster import Cluster
from splitserve.testing.waiting import wait_until

PROMPT_IDS = [1, 415, 2936, 9060, 285, 1142, 28705, 28740, 28734, 2421]


@pytest.fixture(scope="module")
def cluster(llama_dir):
    c = Cluster(llama_dir)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_p": 0.5}))
    return folder


def test_models_answers_503_until_a_worker_can_serve_then_lists_it(cluster, llama_dir, greedy_by_default):
    port = free_port()
    front = cluster.start_frontend("--worker", f"both=127.0.0.1:{port}", workers=[])
    other = cluster.start_frontend("--worker", f"both=127.0.0.1:{port}", "--generation-config",
                                   str(greedy_by_default), workers=[])
    client = openai.OpenAI(base_url=front.openai_url, api_key="unused", max_retries=0, timeout=30)
    wait_until(lambda: front.get("/health")[0] == 200 or not front.proc.alive(), timeout=120,
               what="the frontend to answer /health", details=front.proc.tail)
    assert front.proc.alive(), front.proc.tail()    # the frontend is up, its worker is not
    status, body = front.get("/v1/models")
    assert status == 503, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "service_unavailable"
    assert "no worker is ready" in error["message"]
    with pytest.raises(openai.InternalServerError) as refused:
        client.models.list()
    assert refused.value.status_code == 503
    assert front.get("/ready")[0] == 503

    worker = cluster.start_worker("late", "both", port=port)
    worker.wait_ready()
    front.wait_ready()
    models = client.models.list().data
    assert [m.id for m in models] == [llama_dir.name]
    assert httpx.get(f"{front.openai_url}/models").json()["data"][0]["max_model_len"] > 0
    out = client.completions.create(model=models[0].id, prompt=PROMPT_IDS, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4

    # The second frontend prints the defaults it took from the folder, at start.
    other.wait_ready()
    assert "temperature=0.0, top_p=0.5" in other.proc.output and str(greedy_by_default) in other.proc.output
    assert "default sampling parameters" in front.proc.output


def test_generation_config_folder_sets_omitted_parameters_and_sent_ones_win(cluster, llama_dir):
    front, other = cluster.frontends[-2:]
    plain = openai.OpenAI(base_url=front.openai_url, api_key="unused", max_retries=0, timeout=60)
    greedy_default = openai.OpenAI(base_url=other.openai_url, api_key="unused", max_retries=0, timeout=60)
    model = llama_dir.name
    kwargs = dict(model=model, prompt=PROMPT_IDS, max_tokens=12, extra_body={"ignore_eos": True})
    greedy = plain.completions.create(temperature=0, **kwargs).choices[0].text
    # Omitted temperature on the frontend whose folder says 0: greedy, in both APIs.
    assert greedy_default.completions.create(**kwargs).choices[0].text == greedy
    chat = dict(model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=8,
                extra_body={"ignore_eos": True})
    assert greedy_default.chat.completions.create(**chat).choices[0].message.content == \
        plain.chat.completions.create(temperature=0, **chat).choices[0].message.content
    # A sent temperature wins over the folder's: seeded sampling at 1.0 is the same on both frontends.
    sampled = [c.completions.create(temperature=1.0, top_p=1.0, seed=11, **kwargs).choices[0].text
               for c in (plain, greedy_default)]
    assert sampled[0] == sampled[1] and sampled[0] != greedy
