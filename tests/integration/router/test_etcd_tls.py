"""Discovery as pods need it (issue 17): an etcd that serves TLS and requires client
certificates, and a worker on every interface that registers the address it advertises.

A real etcd (`--client-cert-auth`, certificates from a throwaway CA), a real aggregated
worker that registers in it and a real frontend that finds the worker there, both with
--etcd-ca/--etcd-cert/--etcd-key; the official openai client gets the engine's greedy
tokens through them. Then the refusals: a registry without a client certificate, and one
that trusts another CA, never see the worker.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from splitserve.discovery.etcd import EtcdRegistry
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.engine import LLMEngine
from splitserve.services.worker_protocol.sampling_params import SamplingParams
from splitserve.testing.certs import TestCA
from splitserve.testing.cluster import Cluster
from splitserve.testing.etcd import Etcd
from splitserve.tls import TlsConfig

PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]
CONNECT_S = 3.0      # a registry that cannot connect has logged "etcd unreachable" by then


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("etcd-pki"))
    server, client = ca.issue("etcd"), ca.issue("splitserve")
    return {"ca": ca, "server": TlsConfig(cert=str(server.cert), key=str(server.key), ca=str(ca.ca_path)),
            "client": TlsConfig(cert=str(client.cert), key=str(client.key), ca=str(ca.ca_path))}


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory, pki):
    server = Etcd(str(tmp_path_factory.mktemp("etcd-tls")), tls=pki["server"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _flags(endpoint: str, tls: TlsConfig) -> list[str]:
    return ["--etcd", endpoint, "--etcd-ca", tls.ca, "--etcd-cert", tls.cert, "--etcd-key", tls.key]


def _members_seen(endpoint: str, tls: TlsConfig) -> tuple[bool, list[str]]:
    async def go():
        registry = EtcdRegistry([endpoint], tls=tls)
        await registry.start()
        try:
            try:
                await asyncio.wait_for(registry.changed.wait(), CONNECT_S)
            except TimeoutError:
                pass
            return registry.connected, sorted(registry.members())
        finally:
            await registry.close()
    return asyncio.run(go())


def test_workers_register_and_frontends_discover_over_mutual_tls(llama_dir, tls_etcd, pki, tmp_path_factory):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64, num_threads=1))
    try:
        [expected] = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        engine.close()
    flags = _flags(tls_etcd.endpoint, pki["client"])
    cluster = Cluster(llama_dir)
    try:
        cluster.start_worker("w0", "both", *flags, "--etcd-ttl", "5")
        cluster.wait_workers()
        front = cluster.start_frontend("--served-model-name", "llama", *flags, workers=[])
        front.wait_ready(num_workers=1)
        client = openai.OpenAI(base_url=front.openai_url, api_key="unused", max_retries=0, timeout=60)
        out = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == expected.token_ids

        assert _members_seen(tls_etcd.endpoint, pki["client"]) == (True, ["w0"])
        no_client_cert = TlsConfig(ca=pki["client"].ca)
        assert _members_seen(tls_etcd.endpoint, no_client_cert) == (False, [])
        other_ca = TestCA(tmp_path_factory.mktemp("other-pki"))
        stranger = other_ca.issue("stranger")
        wrong_ca = TlsConfig(cert=str(stranger.cert), key=str(stranger.key), ca=str(other_ca.ca_path))
        assert _members_seen(tls_etcd.endpoint, wrong_ca) == (False, [])
    finally:
        codes = cluster.close()
    cluster.assert_clean_exit(codes, 2)


def test_a_worker_on_every_interface_registers_the_address_it_advertises(llama_dir, etcd):
    """A pod's worker listens on 0.0.0.0 and registers its pod IP (--advertise-host); without
    one it refuses to start, since 0.0.0.0 in etcd would be reachable by nobody."""
    flags = ["--etcd", etcd.endpoint, "--etcd-ttl", "5"]
    cluster = Cluster(llama_dir)
    try:
        refused = cluster.start_worker("bare", "both", *flags, "--host", "0.0.0.0")
        assert refused.proc.process.wait(60) == 2
        refused.proc.wait_for_line("give --advertise-host", timeout=10)
        worker = cluster.start_worker("w1", "both", *flags, "--host", "0.0.0.0", "--advertise-host", "127.0.0.1")
        worker.wait_ready()
        connected, members = _members_seen(etcd.endpoint, TlsConfig())
        assert connected and members == ["w1"]

        async def address():
            registry = EtcdRegistry([etcd.endpoint])
            await registry.start()
            try:
                await asyncio.wait_for(registry.changed.wait(), CONNECT_S)
                return registry.members()["w1"].address
            finally:
                await registry.close()
        assert asyncio.run(address()) == worker.address           # 127.0.0.1:<port>, not 0.0.0.0
    finally:
        codes = cluster.close()
    assert codes == [0], cluster.outputs()[-3000:]        # the refused worker had exited already
