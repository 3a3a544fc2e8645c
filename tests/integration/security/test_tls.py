"""TLS for clients and mutual TLS between the frontend and the worker, with real processes.

A CA made for the module signs the worker's certificate, the frontend's public
certificate and the certificate the frontend presents to the worker; a second,
unrelated CA signs an impostor's. The worker requires client certificates.

- The official openai client over HTTPS (trusting the CA) is served; plain HTTP
  to that port and HTTPS without trusting the CA fail.
- The public gRPC port speaks TLS: a channel trusting the CA is served, an
  insecure one is not.
- The worker refuses plaintext, TLS without a client certificate, and a client
  certificate from another CA, on its gRPC port and on its session stream; a
  frontend without a client certificate (or with plaintext) never becomes ready.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.proto.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.services.frontend.workers.session import WorkerCallError, WorkerSession
from splitserve.tls import TlsConfig
from splitserve.testing.certs import TestCA
from splitserve.testing.cluster import Cluster
from splitserve.testing.openai_api import served_model_name
from splitserve.testing.waiting import wait_until

from .conftest import grpc_generate


@pytest.fixture(scope="module")
def pki(ca, tmp_path_factory):
    rogue = TestCA(tmp_path_factory.mktemp("rogue-pki"), name="rogue CA")
    return {"ca": ca, "worker": ca.issue("worker"), "public": ca.issue("frontend"),
            "client": ca.issue("frontend-client"), "rogue": rogue.issue("impostor")}


@pytest.fixture(scope="module")
def deployment(llama_dir, pki):
    ca = pki["ca"].ca_path
    cluster = Cluster(llama_dir)
    try:
        cluster.start_worker("worker-0", "both", "--tls-cert", str(pki["worker"].cert),
                             "--tls-key", str(pki["worker"].key), "--tls-ca", str(ca)).wait_ready()
        good = cluster.start_frontend("--tls-cert", str(pki["public"].cert), "--tls-key", str(pki["public"].key),
                                      "--tls-ca", str(ca), "--tls-client-cert", str(pki["client"].cert),
                                      "--tls-client-key", str(pki["client"].key), https_ca=ca)
        good.wait_ready()
        no_client_cert = cluster.start_frontend("--tls-ca", str(ca))
        plaintext = cluster.start_frontend()
        for front in (no_client_cert, plaintext):      # up (its HTTP answers), though never ready
            wait_until(lambda: front.get("/health")[0] == 200 or not front.proc.alive(), timeout=120,
                       what="the frontend to answer /health", details=lambda: front.proc.output[-2000:])
            assert front.proc.alive(), front.proc.output[-2000:]
        yield cluster, {"good": good, "no_client_cert": no_client_cert, "plaintext": plaintext}
    finally:
        codes = cluster.close()
    cluster.assert_clean_exit(codes, 4)


@pytest.fixture(scope="module")
def fronts(deployment):
    return deployment[1]


@pytest.fixture(scope="module")
def model_name(fronts, pki):
    verify = ssl.create_default_context(cafile=str(pki["ca"].ca_path))
    return served_model_name(fronts["good"].openai_url, verify=verify)


def test_openai_client_over_https(fronts, pki, model_name):
    verify = ssl.create_default_context(cafile=str(pki["ca"].ca_path))
    with httpx.Client(verify=verify) as http:
        client = openai.OpenAI(base_url=fronts["good"].openai_url, api_key="unused", http_client=http,
                               max_retries=0, timeout=60)
        out = client.completions.create(model=model_name, prompt="Hello", max_tokens=3)
        assert out.usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(model=model_name, max_tokens=3, stream=True,
                                                     messages=[{"role": "user", "content": "Hi"}]))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_plain_http_and_untrusted_https_fail(fronts):
    port = fronts["good"].port
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{port}/health", timeout=5)        # the system roots do not know our CA


def test_public_grpc_speaks_tls(fronts, pki, model_name):
    address = fronts["good"].grpc_address
    with TlsConfig(ca=str(pki["ca"].ca_path)).channel(address) as channel:
        assert grpc_generate(channel, model_name)
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            grpc_generate(channel, model_name, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def _health(tls: TlsConfig, address: str) -> grpc.StatusCode | int:
    with tls.channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as exc:
            return exc.code()


def test_worker_requires_a_client_certificate_from_the_ca(deployment, pki):
    address, ca = deployment[0].workers["worker-0"].address, str(pki["ca"].ca_path)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(TlsConfig(cert=str(pki["client"].cert), key=str(pki["client"].key), ca=ca), address) == serving
    assert _health(TlsConfig(), address) == grpc.StatusCode.UNAVAILABLE                     # plaintext
    assert _health(TlsConfig(ca=ca), address) == grpc.StatusCode.UNAVAILABLE                # no client cert
    impostor = TlsConfig(cert=str(pki["rogue"].cert), key=str(pki["rogue"].key), ca=ca)
    assert _health(impostor, address) == grpc.StatusCode.UNAVAILABLE                       # another CA's cert


def test_the_session_stream_requires_the_same_client_certificate(deployment, pki):
    address, ca = deployment[0].workers["worker-0"].address, str(pki["ca"].ca_path)
    good = TlsConfig(cert=str(pki["client"].cert), key=str(pki["client"].key), ca=ca)
    with good.channel(address) as channel:
        port = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10).session_port
    request = worker_pb2.TokenGenerateRequest(request_id="tls", token_ids=[5, 6, 7], params=common_pb2.SamplingParams(
        max_tokens=2, temperature=0, ignore_eos=True))

    async def generate(tls: TlsConfig) -> list[int] | grpc.StatusCode:
        session = WorkerSession.over_stream("127.0.0.1", port, tls.client_ssl_context(),
                                            tls.server_hostname("127.0.0.1"), address)
        try:
            return [t async for r in session.generate(request) for t in r.token_ids]
        except WorkerCallError as exc:
            return exc.code()
        finally:
            await session.close()

    impostor = TlsConfig(cert=str(pki["rogue"].cert), key=str(pki["rogue"].key), ca=ca)
    results = [asyncio.run(generate(tls)) for tls in (good, TlsConfig(), TlsConfig(ca=ca), impostor)]
    assert port and len(results[0]) == 2, results
    assert results[1:] == [grpc.StatusCode.UNAVAILABLE] * 3, results    # plaintext, no client cert, another CA


def test_frontend_without_a_client_certificate_is_refused(fronts):
    deadline = time.monotonic() + 5      # the good frontend became ready in less than this
    while time.monotonic() < deadline:
        for name in ("no_client_cert", "plaintext"):
            assert fronts[name].get("/ready")[0] == 503, name
            assert fronts[name].proc.alive(), fronts[name].proc.output[-2000:]
        time.sleep(0.5)                  # the next look: the claim is "not ready for 5 s", not a condition
    reply = httpx.post(f"{fronts['plaintext'].openai_url}/completions",
                       json={"model": "any", "prompt": "Hi", "max_tokens": 2})
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
