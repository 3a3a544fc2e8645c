"""Run the operator under kopf (`splitserve operator`).

kopf provides the process frame: login (kubeconfig or in-cluster service
account, through the official client), watch streams, startup and cleanup.
It runs standalone (no peering CRD). Watch events on ServingDeployments, their
pods and nodes only wake the control loop (`loop.OperatorLoop`), which does the
level-triggered work; no kopf handler stores state on the objects, so the
operator adds no finalizers and deleting a ServingDeployment never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import kubernetes

from splitserve.errors import SplitserveError
from splitserve.operator import names
from splitserve.operator.builders import WorkloadOptions
from splitserve.operator.kube import AsyncKube, Kube, load_api_client
from splitserve.operator.leader import LeaseElector
from splitserve.operator.loop import OperatorLoop
from splitserve.services.spec.serving_deployment import API_GROUP, API_VERSION, PLURAL

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OperatorOptions:
    kubeconfig: Path | None = None
    namespaces: list[str] = field(default_factory=list)    # empty: all namespaces
    etcd_endpoints: list[str] = field(default_factory=lambda: ["splitserve-etcd:2379"])
    interval_s: float = 2.0
    use_pod_ip: bool = True       # False: reach workers only through the worker-address annotation
    leader_election_namespace: str | None = None   # None: no election (a single replica)
    health_port: int | None = None                 # kopf's liveness endpoint on 0.0.0.0 (in a pod)
    node_grace_s: float = 10.0    # how long a node may be NotReady before its groups are replaced
    etcd_tls_secret: str | None = None             # Secret (ca.crt, tls.crt, tls.key) the pods use for etcd

    @classmethod
    def from_flags(cls, *, kubeconfig: str | None, namespaces: list[str] | None, all_namespaces: bool,
                   etcd_endpoint: str | None, interval_s: float, worker_address: str, node_grace_s: float,
                   leader_election_namespace: str | None, health_port: int | None,
                   etcd_tls_secret: str | None = None,
                   environ: Mapping[str, str] = os.environ) -> "OperatorOptions":
        """`splitserve operator`'s flags, with the chart's SPLITSERVE_* environment variables
        (deploy/helm/README.md) standing in for the flags not given; flags win."""
        env_namespaces = environ.get("SPLITSERVE_WATCH_NAMESPACES")
        if all_namespaces:
            watched: list[str] = []
        elif namespaces:
            watched = namespaces
        elif env_namespaces is not None:
            watched = [n for n in env_namespaces.split(",") if n]
        else:
            raise SplitserveError("give --namespace NS (repeatable) or --all-namespaces")
        etcd = etcd_endpoint or environ.get("SPLITSERVE_ETCD") or "splitserve-etcd:2379"
        endpoints = [e.strip().split("://")[-1] for e in etcd.split(",") if e.strip()]
        return cls(kubeconfig=Path(kubeconfig) if kubeconfig else None, namespaces=watched,
                   etcd_endpoints=endpoints, interval_s=interval_s,
                   use_pod_ip=worker_address == "auto",
                   health_port=health_port or int(environ.get("SPLITSERVE_HEALTH_PORT") or 0) or None,
                   node_grace_s=node_grace_s,
                   leader_election_namespace=leader_election_namespace
                   or environ.get("SPLITSERVE_LEADER_ELECTION_NAMESPACE") or None,
                   etcd_tls_secret=etcd_tls_secret or environ.get("SPLITSERVE_ETCD_TLS_SECRET") or None)


def connection_info(configuration: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """kopf's credentials from the same client configuration the operator's own calls use
    (kubeconfig or in-cluster), so both always talk to the same apiserver as the same user."""
    header = (configuration.get_api_key_with_prefix("BearerToken")
              or configuration.get_api_key_with_prefix("authorization"))
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(server=configuration.host, ca_path=configuration.ssl_ca_cert,
                               insecure=not configuration.verify_ssl, scheme=scheme, token=token,
                               certificate_path=configuration.cert_file, private_key_path=configuration.key_file,
                               username=configuration.username or None, password=configuration.password or None)


def build_registry(configuration: kubernetes.client.Configuration) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(configuration)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 60
        memo.task = asyncio.create_task(memo.loop.run(), name="splitserve-operator-loop")

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        memo.loop.stop()
        await memo.task

    @kopf.on.event(API_GROUP, API_VERSION, PLURAL, registry=registry)
    def deployment_changed(memo: kopf.Memo, **_: Any) -> None:
        memo.loop.wake()

    @kopf.on.event("", "v1", "pods", labels={names.LABEL_MANAGED_BY: names.MANAGED_BY}, registry=registry)
    def pod_changed(memo: kopf.Memo, **_: Any) -> None:
        memo.loop.wake()

    @kopf.on.event("", "v1", "nodes", registry=registry)
    def node_changed(memo: kopf.Memo, **_: Any) -> None:
        memo.loop.wake()

    return registry


def run_operator(options: OperatorOptions) -> int:
    try:
        api_client = load_api_client(options.kubeconfig)
    except (kubernetes.config.ConfigException, OSError) as exc:
        where = options.kubeconfig or "in-cluster service account or $KUBECONFIG"
        raise SplitserveError(f"cannot load Kubernetes credentials from {where}: {exc}") from exc
    kube = AsyncKube(Kube(api_client))
    elector = None
    if options.leader_election_namespace:
        identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
        elector = LeaseElector(kube, options.leader_election_namespace, identity)
    loop = OperatorLoop(kube, options.namespaces, options.etcd_endpoints, interval_s=options.interval_s,
                        use_pod_ip=options.use_pod_ip, elector=elector, node_grace_s=options.node_grace_s,
                        workload=WorkloadOptions(etcd_tls_secret=options.etcd_tls_secret))
    memo = kopf.Memo(loop=loop, task=None)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)   # one line per watch event otherwise
    log.warning("splitserve operator: watching %s", ", ".join(options.namespaces) or "all namespaces")
    liveness = f"http://0.0.0.0:{options.health_port}/healthz" if options.health_port else None
    kopf.run(registry=build_registry(api_client.configuration), standalone=True, memo=memo, liveness_endpoint=liveness,
             namespaces=options.namespaces, clusterwide=not options.namespaces)
    return 0
