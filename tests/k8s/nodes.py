"""Simulated GPU nodes for the test control plane: pure Node-object builders.

A node is "managed" by kwok when it carries the annotation `KWOK_MANAGED`; kwok
then plays its kubelet: it fills in status (Ready, addresses, capacity stays as
given), renews its Lease every second (`--node-lease-duration-seconds=4`), and
runs the pods bound to it (Pending → Running, deletion finalised).

Making a node NotReady (`KubeCluster.set_node_ready(name, False)`) removes that
annotation, so kwok stops heartbeating it like a kubelet that died, and writes
the `Ready=False` condition a kubelet would report on its way down. The node
lifecycle controller in kube-controller-manager then sees the node NotReady,
taints it `node.kubernetes.io/not-ready:NoExecute` (and, once the lease and
status are older than `--node-monitor-grace-period`, flips Ready to Unknown
with `node.kubernetes.io/unreachable`). Putting the annotation back hands the
node to kwok again, which reports Ready=True and renews the lease.
"""

from __future__ import annotations

from typing import Any

KWOK_MANAGED = "kwok.x-k8s.io/node"
KWOK_MANAGED_VALUE = "fake"
GPU_RESOURCE = "nvidia.com/gpu"
ZONE_LABEL = "topology.kubernetes.io/zone"
REGION_LABEL = "topology.kubernetes.io/region"


def build_gpu_node(name: str, *, gpus: int = 8, cpu: str = "96", memory: str = "1024Gi",
                   pods: int = 110, zone: str = "zone-a", region: str = "region-1",
                   labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A kwok-managed Node with `gpus` nvidia.com/gpu and topology labels.

    `labels` are added on top of (and may override) the standard ones, e.g.
    {"topology.kubernetes.io/zone": "zone-b", "splitserve.io/rack": "r1"}.
    """
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), GPU_RESOURCE: str(gpus),
                 "ephemeral-storage": "1Ti"}
    all_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": f"sim-gpu-{gpus}",
        ZONE_LABEL: zone,
        REGION_LABEL: region,
        "type": "kwok",
    }
    all_labels.update(labels or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": all_labels,
            "annotations": {KWOK_MANAGED: KWOK_MANAGED_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
        },
        # No taint: ordinary pods (and the operator's gang-scheduled ones) may land here.
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def not_ready_condition(now_iso: str) -> dict[str, str]:
    """The Ready=False condition a kubelet reports as it goes down."""
    return {"type": "Ready", "status": "False", "reason": "KubeletNotReady",
            "message": "kubelet stopped posting node status (simulated by the test)",
            "lastHeartbeatTime": now_iso, "lastTransitionTime": now_iso}
