"""A real Kubernetes control plane on 127.0.0.1 for the tests (DESIGN section 6).

`start_cluster()` runs etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok as child processes, from the binaries that
tests/k8s/build-control-plane.sh built into its cache, and returns a
`KubeCluster` with helpers (kubectl, helm, the official Python client, GPU
nodes, namespaces). Nothing is mocked: the apiserver validates and stores,
controllers reconcile, the default scheduler binds, and kwok plays the kubelet
of every simulated node (no containers run).

Shape of the cluster:
- etcd 3.6 (built by the script: Debian's 3.4 lacks the watch progress requests
  client-go's streaming lists need) on a free port, data in /dev/shm when present
  (etcd fsyncs a lot).
- kube-apiserver on a free secure port, bound to 127.0.0.1, with a fresh CA and
  serving certificate, a static admin token (group system:masters) and RBAC on,
  so the chart's RBAC objects are real.
- kube-controller-manager with a short node monitor grace period, so a node
  whose heartbeats stop goes NotReady within seconds (see nodes.py).
- kube-scheduler (the default scheduler) and kwok, both against the same kubeconfig.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from splitserve.net import free_port

import pki
from cluster import KubeCluster
from nodes import KWOK_MANAGED, KWOK_MANAGED_VALUE
from procs import Component, ComponentError, wait_healthy

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build-control-plane.sh"
KWOK_STAGES = "kwok-stages.yaml"
REQUIRED_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm",
                     "etcd")
NODE_MONITOR_GRACE_SECONDS = 10
NODE_LEASE_SECONDS = 4        # kwok renews a node's lease every quarter of this


class MissingBinariesError(RuntimeError):
    """The control-plane binaries are not built (run build-control-plane.sh)."""


def locate_bin_dir() -> Path:
    """The cache folder of the binaries: $SPLITSERVE_K8S_BIN, or the build script's."""
    override = os.environ.get("SPLITSERVE_K8S_BIN")
    if override:
        bin_dir = Path(override)
    else:
        out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin-dir"], capture_output=True,
                             text=True, check=True, timeout=30)
        bin_dir = Path(out.stdout.strip().splitlines()[-1])
    missing = [b for b in REQUIRED_BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if not (bin_dir / KWOK_STAGES).is_file():
        missing.append(KWOK_STAGES)
    if missing:
        raise MissingBinariesError(f"{', '.join(missing)} missing from {bin_dir}: run "
                                   f"bash {BUILD_SCRIPT.relative_to(HERE.parent.parent)} "
                                   "(scripts/install-test-deps.sh does)")
    return bin_dir


_SCRATCH_PREFIX = "splitserve-etcd-"


def _sweep_stale_scratch(root: Path) -> None:
    """Remove etcd folders left by sessions that were killed before their teardown."""
    for folder in root.glob(f"{_SCRATCH_PREFIX}*"):
        try:
            pid = int((folder / "owner.pid").read_text())
            os.kill(pid, 0)
            continue                      # its session is still running
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue                      # not ours to judge (unreadable, being created)
        shutil.rmtree(folder, ignore_errors=True)


def _scratch_dir(parent: Path) -> Path:
    """etcd's data folder: in /dev/shm when writable (RAM, so stale ones are swept)."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else parent
    _sweep_stale_scratch(root)
    folder = Path(tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=root))
    (folder / "owner.pid").write_text(str(os.getpid()))
    return folder


def _etcd(etcd_bin: Path, workdir: Path, data_dir: Path) -> tuple[Component, str]:
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    argv = [str(etcd_bin), "--name", "k8s", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"k8s={peer}", "--log-level", "warn",
            "--unsafe-no-fsync"]   # throw-away data: durability buys nothing here
    return Component("etcd", argv, workdir / "etcd.log"), client


def _apiserver(bin_dir: Path, workdir: Path, creds: pki.Credentials, etcd_url: str, port: int) -> Component:
    argv = [str(bin_dir / "kube-apiserver"),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={workdir / 'apiserver-certs'}",
            f"--tls-cert-file={creds.server_cert}", f"--tls-private-key-file={creds.server_key}",
            f"--token-auth-file={creds.token_file}",
            f"--service-account-key-file={creds.sa_pub}",
            f"--service-account-signing-key-file={creds.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--authorization-mode=RBAC",
            # 127.0.0.1 cannot be an Endpoints address: do not publish the `kubernetes` Service's.
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--allow-privileged=true"]
    return Component("kube-apiserver", argv, workdir / "kube-apiserver.log")


def _controller_manager(bin_dir: Path, workdir: Path, creds: pki.Credentials, kubeconfig: Path,
                        port: int) -> Component:
    argv = [str(bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={workdir / 'kcm-certs'}",
            "--leader-elect=false",
            f"--service-account-private-key-file={creds.sa_key}",
            f"--root-ca-file={creds.ca_cert}",
            "--use-service-account-credentials=false",
            "--node-monitor-period=1s",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE_SECONDS}s",
            "--profiling=false"]
    return Component("kube-controller-manager", argv, workdir / "kube-controller-manager.log")


def _scheduler(bin_dir: Path, workdir: Path, kubeconfig: Path, port: int) -> Component:
    argv = [str(bin_dir / "kube-scheduler"),
            f"--kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={workdir / 'scheduler-certs'}",
            "--leader-elect=false",
            "--profiling=false"]
    return Component("kube-scheduler", argv, workdir / "kube-scheduler.log")


def _kwok(bin_dir: Path, workdir: Path, kubeconfig: Path, port: int) -> Component:
    # kwok's default Stages, copied from its module by the build script (only
    # kwokctl embeds them): node initialise + lease heartbeat, pod ready/complete/delete.
    config = workdir / "kwok.yaml"
    # No KwokConfiguration document: kwok then applies its defaults (a partial one gets none).
    config.write_text((bin_dir / KWOK_STAGES).read_text())
    argv = [str(bin_dir / "kwok"),
            f"--kubeconfig={kubeconfig}",
            f"--config={config}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_MANAGED}={KWOK_MANAGED_VALUE}",
            f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
            "--cidr=10.244.0.1/16", "--node-ip=10.0.0.1",
            f"--server-address=127.0.0.1:{port}"]
    return Component("kwok", argv, workdir / "kwok.log")


def write_kubeconfig(path: Path, server: str, creds: pki.Credentials) -> None:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: splitserve-test
  cluster:
    server: {server}
    certificate-authority: {creds.ca_cert}
users:
- name: {pki.ADMIN_USER}
  user:
    token: {creds.admin_token}
contexts:
- name: splitserve-test
  context:
    cluster: splitserve-test
    user: {pki.ADMIN_USER}
current-context: splitserve-test
""")
    path.chmod(0o600)


def start_cluster(workdir: Path, *, bin_dir: Path | None = None, timeout: float = 90.0) -> KubeCluster:
    """Start every component, wait until all are healthy; stop them all on failure."""
    t0 = time.monotonic()
    bin_dir = bin_dir or locate_bin_dir()
    workdir.mkdir(parents=True, exist_ok=True)
    creds = pki.generate(workdir / "pki")
    components: list[Component] = []
    data_dir = _scratch_dir(workdir)
    try:
        etcd, etcd_url = _etcd(bin_dir / "etcd", workdir, data_dir / "data")
        components.append(etcd)
        etcd.start()
        wait_healthy(etcd, f"{etcd_url}/health", timeout=timeout)

        api_port = free_port()
        server = f"https://127.0.0.1:{api_port}"
        apiserver = _apiserver(bin_dir, workdir, creds, etcd_url, api_port)
        components.append(apiserver)
        apiserver.start()
        kubeconfig = workdir / "kubeconfig"
        write_kubeconfig(kubeconfig, server, creds)
        ca_ctx = ssl.create_default_context(cafile=str(creds.ca_cert))
        wait_healthy(apiserver, f"{server}/readyz", timeout=timeout, ssl_context=ca_ctx,
                     headers={"Authorization": f"Bearer {creds.admin_token}"})

        ports = {name: free_port() for name in ("kcm", "scheduler", "kwok")}
        rest = [_controller_manager(bin_dir, workdir, creds, kubeconfig, ports["kcm"]),
                _scheduler(bin_dir, workdir, kubeconfig, ports["scheduler"]),
                _kwok(bin_dir, workdir, kubeconfig, ports["kwok"])]
        urls = [f"https://127.0.0.1:{ports['kcm']}/healthz", f"https://127.0.0.1:{ports['scheduler']}/healthz",
                f"http://127.0.0.1:{ports['kwok']}/healthz"]
        for c in rest:
            components.append(c)
            c.start()
        with ThreadPoolExecutor(len(rest)) as pool:
            for fut in [pool.submit(wait_healthy, c, u, timeout=timeout) for c, u in zip(rest, urls)]:
                fut.result()

        cluster = KubeCluster(kubeconfig=kubeconfig, server=server, bin_dir=bin_dir, workdir=workdir,
                              token=creds.admin_token, ca_cert=creds.ca_cert, components=components,
                              scratch_dirs=[data_dir])
        # The controller-manager's service-account controller is running once
        # `default` has its ServiceAccount: pods can be created from then on.
        cluster.wait_for_service_account("default", timeout=timeout)
        cluster.startup_seconds = time.monotonic() - t0
        log.info("control plane up in %.1f s at %s", cluster.startup_seconds, server)
        return cluster
    except BaseException:
        for c in reversed(components):
            c.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        raise


__all__ = ["ComponentError", "KubeCluster", "MissingBinariesError", "locate_bin_dir", "start_cluster"]
