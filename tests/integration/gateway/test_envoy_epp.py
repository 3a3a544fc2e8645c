"""`splitserve epp` behind a real Envoy, in front of real workers (issue 40).

The deployment is what a Gateway API Inference Extension pool runs, on loopback: two decode
worker "pods" (a `splitserve worker --role decode` and its `splitserve frontend --gateway`, the
pod's OpenAI API), a prefill worker, the endpoint picker (`splitserve epp`, given the workers and
each decode worker's endpoint) and Envoy 1.40.0 configured as GIE's gateways configure it
(splitserve/testing/envoy.py): listeners that fail closed, fail open, and carry a subset hint.
The picker is also driven directly over ext_proc for the cases a proxy rarely sends. The last test
kills the picker.
"""

from __future__ import annotations

import asyncio
import json
import signal

import grpc
import httpx
import openai
import pytest
from google.protobuf import struct_pb2

from splitserve.net import free_port
from splitserve.proto.v1 import ext_proc_pb2
from splitserve.services.epp.protocol import process_call
from splitserve.testing.cluster import Cluster
from splitserve.testing.envoy import EnvoyGateway, GatewayListener
from splitserve.testing.metrics import sample_sum
from splitserve.testing.processes import Proc
from splitserve.testing.waiting import async_wait_until, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gateway")]

MODEL = "smollm2"
# Past the remote-prefill threshold (64 uncached tokens): a prefill pick, through the header.
LONG = " ".join(f"Item {i} of the inventory is a {('red', 'blue', 'green')[i % 3]} box." for i in range(40))
SHORT = "The capital of France is"


class Deployment:
    def __init__(self, model_dir):
        self.cluster = Cluster(model_dir)
        self.epp: Proc | None = None
        self.gateway: EnvoyGateway | None = None

    def start(self) -> None:
        c = self.cluster
        self.decoders = [c.start_worker("d1", "decode"), c.start_worker("d2", "decode")]
        self.prefill = c.start_worker("p1", "prefill")
        c.wait_workers()
        self.pods = [c.start_frontend("--gateway", "--served-model-name", MODEL, workers=[w]) for w in self.decoders]
        for f in self.pods:
            f.wait_ready()
        self.endpoints = {w.name: f"127.0.0.1:{f.port}" for w, f in zip(self.decoders, self.pods)}
        self.epp_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        argv = ["splitserve", "--log-level", "info", "epp", "--model", c.model, "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.epp_port), "--health-port", str(self.health_port),
                "--metrics-port", str(self.metrics_port), "--max-body-bytes", "200000",
                # Flow control: 2 requests in flight per decode worker, one more waiting per band.
                "--flow-control", "--max-concurrency", "2", "--max-queue", "1",
                # InferenceObjectives outside Kubernetes: "critical" goes to band -1, before the default 0.
                "--objective", "critical=10",
                "--worker", f"prefill={self.prefill.address}"]
        for w in self.decoders:
            argv += ["--worker", f"decode={w.address}", "--endpoint", f"{w.address}={self.endpoints[w.name]}"]
        self.epp = Proc.start(argv)
        c.procs.append(self.epp)
        self.epp.wait_for_line(r"epp: ext_proc listening on")
        wait_until(lambda: self.epp_metric("splitserve_router_index_blocks") is not None and
                   self.metrics_text().count("splitserve_router_index_blocks{") >= 3,
                   timeout=60, what="the picker to know the three workers", details=self.epp.tail)
        self.gateway = EnvoyGateway.start(f"127.0.0.1:{self.epp_port}", list(self.endpoints.values()), [
            GatewayListener("closed"), GatewayListener("open", failure_mode_allow=True),
            GatewayListener("subset", subset=[self.endpoints["d2"]]),
            GatewayListener("subset_gone", subset=["127.0.0.9:9"])])
        wait_until(self.gateway.picker_healthy, timeout=30, what="Envoy's health check to pass the picker")

    def metrics_text(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def epp_metric(self, name: str, **labels: str) -> float | None:
        try:
            return sample_sum(self.metrics_text(), name, **labels)
        except httpx.HTTPError:
            return None

    def client(self, listener: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.url(listener)}/v1", api_key="none", max_retries=0, timeout=120)

    def direct(self, pod: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.pods[pod].openai_url, api_key="none", max_retries=0, timeout=120)

    def requests(self) -> dict[str, int]:
        """Generate calls each decode worker admitted so far."""
        return {w.name: w.stats().num_requests for w in self.decoders}

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.close()
        self.cluster.close()


@pytest.fixture(scope="module")
def deployment(smollm2_dir):
    d = Deployment(smollm2_dir)
    try:
        d.start()
        yield d
    finally:
        d.close()


def complete(client: openai.OpenAI, prompt: str, stream: bool = False, max_tokens: int = 8) -> str:
    if not stream:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True) if c.choices)


def test_openai_client_through_envoy_and_the_picker(deployment):
    gateway, direct = deployment.client("closed"), deployment.direct()
    expected = complete(direct, SHORT)
    assert expected
    assert complete(gateway, SHORT) == expected
    assert complete(gateway, SHORT, stream=True) == expected
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = gateway.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == direct.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0).choices[0].message.content
    streamed = gateway.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_a_long_prompt_is_prefilled_by_the_prefill_worker_the_picker_names(deployment):
    served_before = deployment.prefill.stats().num_prefills_served
    remote_before = sum(w.stats().num_remote_prefills for w in deployment.decoders)
    text = complete(deployment.client("closed"), LONG + " The first box is")
    assert deployment.prefill.stats().num_prefills_served == served_before + 1
    assert sum(w.stats().num_remote_prefills for w in deployment.decoders) == remote_before + 1
    # The same prompt straight to a pod carries no header: its worker prefills locally, and the
    # tokens are the same.
    local_before = deployment.decoders[1].stats().num_local_prefills
    assert complete(deployment.direct(1), LONG + " The first box is") == text
    assert deployment.decoders[1].stats().num_local_prefills == local_before + 1
    assert deployment.prefill.stats().num_prefills_served == served_before + 1


def test_a_cached_prefix_goes_to_the_worker_holding_it(deployment):
    client = deployment.client("closed")
    for topic in ("orchards", "lighthouses", "glaciers"):
        shared = f"A long report on {topic}. " + LONG
        before = deployment.requests()
        complete(client, shared + " Summary:", max_tokens=2)
        first = deployment.requests()
        holder = next(name for name in first if first[name] > before[name])
        for suffix in (" Conclusion:", " Next steps:"):
            complete(client, shared + suffix, max_tokens=2)
        after = deployment.requests()
        assert after[holder] == first[holder] + 2, (topic, before, first, after)
        assert all(after[n] == first[n] for n in after if n != holder)


def test_the_subset_hint_is_honoured(deployment):
    before = deployment.requests()
    client = deployment.client("subset")
    for i in range(3):
        complete(client, f"Request {i}: {SHORT}", max_tokens=2)
    after = deployment.requests()
    assert after["d2"] == before["d2"] + 3 and after["d1"] == before["d1"]
    reply = httpx.post(f"{deployment.gateway.url('subset_gone')}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": SHORT, "max_tokens": 2})
    assert reply.status_code == 503
    assert "subset hint" in reply.json()["error"]["message"]


def test_refusals_pass_through_with_their_bodies(deployment):
    url = f"{deployment.gateway.url('closed')}/v1/completions"
    before = deployment.requests()
    unknown = httpx.post(url, json={"model": "gpt-9", "prompt": SHORT}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(url, content=b'{"model": "smollm2", "prompt": ', timeout=30,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as refused:
        deployment.client("closed").completions.create(model=MODEL, prompt=SHORT, max_tokens=2, temperature=-1)
    assert "temperature" in str(refused.value)
    assert deployment.requests() == before          # none of them reached a worker


# -- the picker over ext_proc, without a proxy ---------------------------------------------
def _headers(path: str = "/v1/completions", method: str = "POST", eos: bool = False,
             tenant: str | None = None) -> ext_proc_pb2.ProcessingRequest:
    pairs = [(":method", method), (":path", path), (":authority", "gateway"), ("content-type", "application/json")]
    if tenant is not None:
        pairs.append(("x-llm-d-inference-fairness-id", tenant))
    return ext_proc_pb2.ProcessingRequest(request_headers=ext_proc_pb2.HttpHeaders(
        headers=ext_proc_pb2.HeaderMap(headers=[ext_proc_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=eos))


def _body(data: bytes, eos: bool) -> ext_proc_pb2.ProcessingRequest:
    return ext_proc_pb2.ProcessingRequest(request_body=ext_proc_pb2.HttpBody(body=data, end_of_stream=eos))


async def _exchange(deployment, messages: list[ext_proc_pb2.ProcessingRequest]) -> list[ext_proc_pb2.ProcessingResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.epp_port}") as channel:
        call = process_call(channel)(iter(messages))
        return [r async for r in call]


def _immediate(responses) -> tuple[int, dict, dict]:
    assert len(responses) == 1 and responses[0].WhichOneof("response") == "immediate_response", responses
    r = responses[0].immediate_response
    return (r.status.code, json.loads(r.body),
            {h.header.key: h.header.raw_value.decode() for h in r.headers.set_headers})


def test_ext_proc_edge_cases(deployment):
    body = json.dumps({"model": MODEL, "prompt": SHORT, "max_tokens": 2}).encode()
    # A body in several chunks, the last one empty (as Envoy sends it): routed, then echoed whole.
    routed = asyncio.run(_exchange(deployment, [_headers(), _body(body[:10], False), _body(body[10:], False),
                                                _body(b"", True)]))
    kinds = [r.WhichOneof("response") for r in routed]
    assert kinds == ["request_headers", "request_body"], kinds
    mutation = routed[0].request_headers.response.header_mutation
    endpoint = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert endpoint["x-gateway-destination-endpoint"] in deployment.endpoints.values()
    assert routed[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == endpoint["x-gateway-destination-endpoint"]
    assert routed[1].request_body.response.body_mutation.streamed_response.body == body
    assert routed[1].request_body.response.body_mutation.streamed_response.end_of_stream
    assert "x-prefiller-host-port" in mutation.remove_headers     # short: no prefill pick, a client's dropped

    status, error, _ = _immediate(asyncio.run(_exchange(deployment, [_headers(), _body(b"{not json", True)])))
    assert status == 400 and "JSON" in error["error"]["message"]
    status, error, _ = _immediate(asyncio.run(_exchange(deployment, [
        _headers(), _body(json.dumps({"model": "other", "prompt": "x"}).encode(), True)])))
    assert status == 404 and error["error"]["param"] == "model"
    status, error, _ = _immediate(asyncio.run(_exchange(deployment, [_headers(), _body(b"x" * 150_000, False),
                                                                     _body(b"x" * 100_000, True)])))
    assert status == 413 and "200000 bytes" in error["error"]["message"]
    # A GET (no body) is routed at its headers.
    get = asyncio.run(_exchange(deployment, [_headers("/v1/models", "GET", eos=True)]))
    assert [r.WhichOneof("response") for r in get] == ["request_headers"]
    # A subset hint in the request's metadata.
    hinted = _headers()
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": [deployment.endpoints["d1"]]})
    hinted.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    picked = asyncio.run(_exchange(deployment, [hinted, _body(body, True)]))
    assert {h.header.raw_value.decode() for h in picked[0].request_headers.response.header_mutation.set_headers} \
        == {deployment.endpoints["d1"]}


def test_a_client_gone_mid_stream_ends_the_exchange(deployment):
    async def leave_mid_response():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.epp_port}") as channel:
            outbox: asyncio.Queue = asyncio.Queue()
            call = process_call(channel)(_drain(outbox))
            await outbox.put(_headers())
            await outbox.put(_body(json.dumps({"model": MODEL, "prompt": SHORT}).encode(), True))
            assert (await call.read()).WhichOneof("response") == "request_headers"
            assert (await call.read()).WhichOneof("response") == "request_body"
            await outbox.put(ext_proc_pb2.ProcessingRequest(response_headers=ext_proc_pb2.HttpHeaders()))
            assert (await call.read()).WhichOneof("response") == "response_headers"
            await outbox.put(ext_proc_pb2.ProcessingRequest(response_body=ext_proc_pb2.HttpBody(body=b"data: {}\n\n")))
            assert (await call.read()).WhichOneof("response") == "response_body"
            assert deployment.epp_metric("splitserve_epp_streams") == 1
            call.cancel()

    asyncio.run(leave_mid_response())
    wait_until(lambda: deployment.epp_metric("splitserve_epp_streams") == 0, timeout=10,
               what="the picker to close the abandoned stream")
    assert complete(deployment.client("closed"), SHORT, max_tokens=2)


def test_the_picker_serves_ext_proc_over_tls(deployment, tmp_path):
    """--tls-cert/--tls-key: a gateway that connects with TLS (its CA trusts the picker's certificate)."""
    from splitserve.testing.certs import TestCA

    ca = TestCA(tmp_path / "pki")
    cert = ca.issue("epp")
    port = free_port()
    proc = Proc.start(["splitserve", "epp", "--model", deployment.cluster.model, "--served-model-name", MODEL,
                       "--host", "127.0.0.1", "--port", str(port), "--health-port", str(free_port()),
                       "--metrics-port", "-1", "--tls-cert", str(cert.cert), "--tls-key", str(cert.key),
                       "--worker", f"decode={deployment.decoders[0].address}",
                       "--endpoint", f"{deployment.decoders[0].address}={deployment.endpoints['d1']}"])
    try:
        proc.wait_for_line(r"epp: ext_proc listening on")

        async def one(credentials) -> list[ext_proc_pb2.ProcessingResponse]:
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
                call = process_call(channel)(iter([
                    _headers(), _body(json.dumps({"model": MODEL, "prompt": SHORT}).encode(), True)]))
                return [r async for r in call]

        trusted = grpc.ssl_channel_credentials(root_certificates=ca.ca_path.read_bytes())
        routed = wait_until(lambda: _routed_or_none(asyncio.run(one(trusted))), timeout=60,
                            what="the TLS picker to route (its worker ready)", details=proc.tail)
        assert deployment.endpoints["d1"] in routed
        with pytest.raises(grpc.aio.AioRpcError):         # a gateway that does not trust it gets nothing
            asyncio.run(one(grpc.ssl_channel_credentials()))
    finally:
        assert proc.stop() == 0, proc.tail()


def _routed_or_none(responses) -> str | None:
    """The picked endpoint, or None while the picker answers 503 (its worker not ready yet)."""
    if responses[0].WhichOneof("response") != "request_headers":
        assert responses[0].immediate_response.status.code == 503, responses
        return None
    return responses[0].request_headers.response.header_mutation.set_headers[0].header.raw_value.decode()


async def _drain(outbox: asyncio.Queue):
    """A request stream that sends what is put in `outbox` until None."""
    while (message := await outbox.get()) is not None:
        yield message


async def _hold_every_unit(process, body: bytes) -> list:
    """The 4 units (2 per decode worker) held by tenant-a's streams, routed and not answered: a
    stream stays open (as Envoy's does) until its response ends. Cancel the calls to free them."""
    held = []
    for _ in range(4):
        outbox: asyncio.Queue = asyncio.Queue()
        for message in (_headers(tenant="tenant-a"), _body(body, True)):
            outbox.put_nowait(message)
        call = process(_drain(outbox))
        assert (await call.read()).WhichOneof("response") == "request_headers"
        held.append(call)
    return held


def test_flow_control_queues_then_sheds_with_429_through_envoy(deployment):
    """The 4 units (2 per decode worker) held by streams routed and not answered; one request
    through Envoy waits in its band (max-queue 1), the next of its tenant is shed with 429, its
    reason and its body, before any worker sees it; once the units come back the waiting one is
    served."""
    body = json.dumps({"model": MODEL, "prompt": SHORT}).encode()

    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.epp_port}") as channel:
            held = await _hold_every_unit(process_call(channel), body)
            before = deployment.requests()
            url = f"{deployment.gateway.url('closed')}/v1/completions"
            tenant = {"x-llm-d-inference-fairness-id": "tenant-a"}
            async with httpx.AsyncClient(timeout=60) as client:
                waiting = asyncio.ensure_future(client.post(url, headers=tenant, json={
                    "model": MODEL, "prompt": SHORT, "max_tokens": 2}))
                await async_wait_until(
                    lambda: deployment.epp_metric("splitserve_flow_control_queued_requests") == 1, timeout=30,
                    what="the first request to wait in its band",
                    details=lambda: (waiting.done() and waiting.result().text,
                                     [x for x in deployment.metrics_text().splitlines() if "flow_control" in x
                                      or "epp_" in x], deployment.epp.tail(20)))
                shed = await client.post(url, headers=tenant, json={"model": MODEL, "prompt": SHORT, "max_tokens": 2})
                assert shed.status_code == 429, shed.text
                assert shed.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
                assert int(shed.headers["retry-after"]) >= 1
                assert shed.json()["error"]["type"] == "rate_limit_error"
                assert not waiting.done() and deployment.requests() == before
                for call in held:
                    call.cancel()
                served = await waiting
            assert served.status_code == 200 and served.json()["choices"][0]["text"]

    asyncio.run(scenario())
    assert deployment.epp_metric("splitserve_epp_requests_total", outcome="shed") >= 1
    wait_until(lambda: deployment.epp_metric("splitserve_epp_streams") == 0, timeout=10,
               what="every stream closed")


def test_an_objectives_priority_overtakes_a_queued_request_through_envoy(deployment):
    """With every unit held, a plain request waits in band 0; then one naming the objective
    "critical" (priority 10: band -1) arrives; one unit comes back: the critical one is served
    first, the plain one only after it (one unit: their ends are in dispatch order). An objective
    nobody defined leaves the request's own priority, and is counted."""
    body = json.dumps({"model": MODEL, "prompt": SHORT}).encode()
    unknown_before = deployment.epp_metric("splitserve_epp_objective_requests_total", known="false")

    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{deployment.epp_port}") as channel:
            held = await _hold_every_unit(process_call(channel), body)
            url = f"{deployment.gateway.url('closed')}/v1/completions"
            ended: dict[str, float] = {}

            async def send(name: str, headers: dict[str, str]) -> httpx.Response:
                answer = await client.post(url, headers=headers, json={"model": MODEL, "prompt": SHORT,
                                                                       "max_tokens": 4})
                ended[name] = asyncio.get_running_loop().time()
                return answer

            async with httpx.AsyncClient(timeout=60) as client:
                # One tenant throughout, the held streams' too: another tenant would get its fair
                # share at once, past the full room (services/flow_control/fair_share.py).
                plain = asyncio.ensure_future(send("plain", {"x-llm-d-inference-fairness-id": "tenant-a"}))
                await async_wait_until(
                    lambda: deployment.epp_metric("splitserve_flow_control_queued_requests") == 1, timeout=30,
                    what="the plain request to wait in band 0", details=lambda: deployment.epp.tail(20))
                critical = asyncio.ensure_future(send("critical", {"x-llm-d-inference-fairness-id": "tenant-a",
                                                                   "x-gateway-inference-objective": "critical"}))
                await async_wait_until(
                    lambda: deployment.epp_metric("splitserve_flow_control_queued_requests") == 2, timeout=30,
                    what="the critical request to wait in band -1", details=lambda: deployment.epp.tail(20))
                held.pop().cancel()                   # one unit back
                served = await asyncio.gather(critical, plain)
                for call in held:
                    call.cancel()
            assert [a.status_code for a in served] == [200, 200], [a.text for a in served]
            assert ended["critical"] < ended["plain"], ended

            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.post(f"{deployment.gateway.url('closed')}/v1/completions",
                                           headers={"x-gateway-inference-objective": "nobody-defined-this"},
                                           json={"model": MODEL, "prompt": SHORT, "max_tokens": 2})
            assert answer.status_code == 200, answer.text

    asyncio.run(scenario())
    assert deployment.epp_metric("splitserve_epp_objective_requests_total", known="true") >= 1
    assert deployment.epp_metric("splitserve_epp_objective_requests_total", known="false") == unknown_before + 1
    wait_until(lambda: deployment.epp_metric("splitserve_epp_streams") == 0, timeout=10,
               what="every stream closed")


def test_failure_modes_when_the_picker_dies(deployment):
    """Last: it kills the picker. FailOpen still serves (any pod of the pool); FailClose answers 5xx."""
    assert complete(deployment.client("open"), SHORT, max_tokens=2)
    deployment.epp.stop(signal.SIGKILL)
    wait_until(lambda: not deployment.gateway.picker_healthy(), timeout=30,
               what="Envoy's health check to mark the picker down")
    assert complete(deployment.client("open"), SHORT, max_tokens=2)
    closed = httpx.post(f"{deployment.gateway.url('closed')}/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": SHORT, "max_tokens": 2})
    assert closed.status_code >= 500, closed.text
