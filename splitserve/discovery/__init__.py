"""Where the workers are: a static in-process registry or etcd leases (DESIGN section 4).

A registry exposes `members()` (worker id -> WorkerRecord) and `changed` (an
asyncio.Event set on every change); the frontend's worker pool reconciles
its members against it (services/frontend/workers/pool.py). Workers register themselves with a lease (`EtcdRegistration`); a
lost lease removes them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

KVSTORE_PREFIX = "/splitserve/kvstore/"      # where `splitserve kvstore --etcd` registers (not a worker prefix)


@dataclass(slots=True, frozen=True)
class WorkerRecord:
    worker_id: str
    role: str          # both | decode | prefill
    address: str       # host:port of its Worker service

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "WorkerRecord":
        d = json.loads(data)
        return cls(d["worker_id"], d["role"], d["address"])
