"""Optional API keys on the HTTP and public gRPC APIs, against real processes.

The frontend gets its keys from a file and from SPLITSERVE_API_KEYS (never on
its command line) and logs at DEBUG, the most it ever logs. Requests without a
key or with a wrong one get 401 invalid_api_key (HTTP) / UNAUTHENTICATED
(gRPC) and are counted; /health, /ready, /metrics and /openapi.json stay
open. At the end no line any process printed contains a key, neither the
valid keys nor the wrong ones clients sent.
"""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from splitserve.testing.cluster import Cluster
from splitserve.testing.openai_api import served_model_name

from .conftest import grpc_generate

FILE_KEY = "sk-file-7d1e4c8a9b2f"
ENV_KEY = "sk-env-3a5c7e9f1b2d"
WRONG_KEY = "sk-wrong-6b8d0f2a4c6e"


@pytest.fixture(scope="module")
def deployment(llama_dir, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text(f"# frontend keys\n{FILE_KEY}\n\n")
    cluster = Cluster(llama_dir, log_level="debug")
    try:
        cluster.start_worker("worker-0", "both").wait_ready()
        front = cluster.start_frontend("--api-keys-file", str(keys_file), env={"SPLITSERVE_API_KEYS": ENV_KEY})
        front.wait_ready()
        yield cluster, front
    finally:
        codes = cluster.close()
    assert codes == [0, 0], cluster.outputs()[-3000:]
    logs = cluster.outputs()
    for key in (FILE_KEY, ENV_KEY, WRONG_KEY):
        assert key not in logs, f"an API key was logged: {key}"
        assert key[3:] not in logs


@pytest.fixture(scope="module")
def front(deployment):
    return deployment[1]


@pytest.fixture(scope="module")
def model_name(front):
    return served_model_name(front.openai_url, headers={"Authorization": f"Bearer {ENV_KEY}"})


def test_open_endpoints_need_no_key(front):
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert front.get(path)[0] == 200, path


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": ENV_KEY},
                                     {"Authorization": f"Basic {ENV_KEY}"}, {"X-Api-Key": ENV_KEY}],
                         ids=["none", "wrong", "no-scheme", "basic", "other-header"])
def test_http_without_a_valid_key_is_401(front, model_name, headers):
    before = front.metric("splitserve_rejected_requests_total", protocol="http", reason="auth")
    for method, path, body in (("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"model": model_name, "prompt": "x", "max_tokens": 2})):
        reply = httpx.request(method, f"{front.base_url}{path}", json=body, headers=headers)
        assert reply.status_code == 401, reply.text
        assert reply.headers["www-authenticate"] == "Bearer"
        error = reply.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
    assert front.metric("splitserve_rejected_requests_total", protocol="http", reason="auth") == before + 2


@pytest.mark.parametrize("key", [FILE_KEY, ENV_KEY])
def test_openai_client_with_a_key_is_served(front, model_name, key):
    client = openai.OpenAI(base_url=front.openai_url, api_key=key, max_retries=0, timeout=60)
    out = client.completions.create(model=model_name, prompt="Hello", max_tokens=3)
    assert out.usage.completion_tokens == 3
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, stream=True)
    assert sum(1 for _ in stream) >= 1


def test_openai_client_with_a_wrong_key_gets_authentication_error(front, model_name):
    client = openai.OpenAI(base_url=front.openai_url, api_key=WRONG_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model=model_name, prompt="Hello", max_tokens=3)
    assert info.value.code == "invalid_api_key"


def test_grpc_needs_the_key(front, model_name):
    before = front.metric("splitserve_rejected_requests_total", protocol="grpc", reason="auth")
    with grpc.insecure_channel(front.grpc_address) as channel:
        for metadata in ((), (("authorization", f"Bearer {WRONG_KEY}"),), (("authorization", ENV_KEY),)):
            with pytest.raises(grpc.RpcError) as info:
                grpc_generate(channel, model_name, metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert WRONG_KEY not in info.value.details()
        assert grpc_generate(channel, model_name, (("authorization", f"Bearer {FILE_KEY}"),))
    assert front.metric("splitserve_rejected_requests_total", protocol="grpc", reason="auth") == before + 3
