"""Labels, annotations and object names the operator writes (one place, no copies).

Every object it owns carries `splitserve.io/deployment`; worker pods also carry
pool, group, role and rank, and rank-0 pods llm-d's role label. Names are DNS-1123 labels
of at most 63 characters.
"""

from __future__ import annotations

import hashlib
import secrets

LABEL_DEPLOYMENT = "splitserve.io/deployment"
LABEL_POOL = "splitserve.io/pool"
LABEL_GROUP = "splitserve.io/group"
LABEL_ROLE = "splitserve.io/role"            # frontend | prefill | decode
LABEL_RANK = "splitserve.io/rank"
LABEL_SPEC_HASH = "splitserve.io/spec-hash"  # rolling updates replace groups whose hash is stale
LABEL_DRAINING = "splitserve.io/draining"    # "true" once a group is chosen to go (routers skip it)
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "splitserve-operator"
# llm-d's endpoint pickers filter by it (llm-d-router's bylabel: prefill | decode | prefill-decode).
# A decode worker never serves another's prefill, even while it prefills its own (prefill pool at 0).
LABEL_LLMD_ROLE = "llm-d.ai/role"
LLMD_ROLES = {"prefill": "prefill", "decode": "decode"}     # pool → llm-d role

ANN_WORKER_ADDRESS = "splitserve.io/worker-address"   # host:port overriding podIP:WORKER_PORT
ANN_DRAIN_STATE = "splitserve.io/drain-state"         # draining | drained
ANN_DRAIN_STARTED = "splitserve.io/drain-started"     # unix seconds
ANN_DRAIN_REASON = "splitserve.io/drain-reason"       # ScaleDown | RollingUpdate
ANN_GROUP_SIZE = "splitserve.io/group-size"
ANN_TOPOLOGY = "splitserve.io/topology"              # same-node | same-label=<labelKey> | none
ANN_APPLIED_HASH = "splitserve.io/applied-hash"       # children: hash of what the operator last wrote
ANN_SYNCED_REPLICAS = "splitserve.io/synced-replicas" # ServingPool: last replicas synced with the parent

SCHEDULER_NAME = "splitserve-gang"
GPU_RESOURCE = "nvidia.com/gpu"
WORKER_PORT = 50051         # the worker's gRPC service (Worker + grpc.health.v1)
DIST_PORT = 29500           # torch.distributed rendezvous on the rank-0 pod
WORKER_METRICS_PORT = 8090  # the worker's Prometheus /metrics (HTTP; `splitserve worker --metrics-port`)
WORKER_SESSION_PORT = 50052 # the worker's session stream, frontends' requests (`splitserve worker --session-port`)
METRICS_PORT_NAME = "metrics"   # the container port the chart's PodMonitor scrapes
FRONTEND_GRPC_PORT_OFFSET = 1
GATEWAY_CONTAINER = "frontend"  # spec.gateway: the decode rank-0 pods' `splitserve frontend --gateway`

MAX_NAME = 63


def truncate(name: str, limit: int = MAX_NAME) -> str:
    """Cut to `limit`, keeping names unique with a short hash of the whole."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[:limit - 7].rstrip('-')}-{digest}"


def new_group_name(deployment: str, pool: str) -> str:
    # 5 random hex chars: a replacement group never collides with a terminating one.
    return truncate(f"{deployment}-{pool}-{secrets.token_hex(3)[:5]}", MAX_NAME - 3)


def pod_name(group: str, rank: int) -> str:
    return f"{group}-{rank}"


def frontend_name(deployment: str) -> str:
    return truncate(f"{deployment}-frontend")


def workers_service_name(deployment: str) -> str:
    return truncate(f"{deployment}-workers")


def config_map_name(deployment: str) -> str:
    return truncate(f"{deployment}-config")


def pool_resource_name(deployment: str, pool: str) -> str:
    return truncate(f"{deployment}-{pool}")


def selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
