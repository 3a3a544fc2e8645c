"""Worker gRPC addresses to gateway endpoints (services/epp/endpoints.py) and pods to workers
(services/epp/pool_pods.py)."""

from __future__ import annotations

import pytest

from splitserve.errors import SplitserveError
from splitserve.services.epp.endpoints import EndpointBook
from splitserve.services.epp.pool_pods import pod_worker


def test_endpoint_is_the_target_port_unless_given():
    book = EndpointBook.parse(8000, ["127.0.0.1:50051=127.0.0.1:8101"])
    assert book.endpoint("127.0.0.1:50051") == "127.0.0.1:8101"
    assert book.endpoint("10.1.2.3:50051") == "10.1.2.3:8000"
    book.forget("127.0.0.1:50051")
    assert book.endpoint("127.0.0.1:50051") == "127.0.0.1:8000"


@pytest.mark.parametrize("bad", ["127.0.0.1:50051", "x=127.0.0.1:1", "127.0.0.1:50051=host", "1.2.3.4:0=1.2.3.4:80"])
def test_a_bad_endpoint_flag_names_itself(bad):
    with pytest.raises(SplitserveError, match="--endpoint"):
        EndpointBook.parse(8000, [bad])


def _pod(name="d-0", role="decode", phase="Running", ip="10.0.0.7", ports=({"name": "grpc", "containerPort": 7000},),
         deleting=False, ready="True") -> dict:
    meta = {"name": name, "labels": {"llm-d.ai/role": role} if role is not None else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    conditions = [{"type": "PodScheduled", "status": "True"}] + ([{"type": "Ready", "status": ready}] if ready else [])
    return {"metadata": meta, "spec": {"containers": [{"name": "worker", "ports": list(ports)}]},
            "status": {"phase": phase, "podIP": ip, "conditions": conditions}}


def test_a_running_pod_with_a_role_is_a_worker():
    w = pod_worker(_pod(), 8000)
    assert (w.record.worker_id, w.record.role, w.record.address, w.endpoint) == \
        ("d-0", "decode", "10.0.0.7:7000", "10.0.0.7:8000")
    assert pod_worker(_pod(role="prefill-decode"), 8000).record.role == "both"
    assert pod_worker(_pod(ports=()), 9000).record.address == "10.0.0.7:50051"         # no grpc port: the default
    assert pod_worker(_pod(ip="fd00::7"), 8000).endpoint == "[fd00::7]:8000"


@pytest.mark.parametrize("pod", [_pod(role=None), _pod(role="frontend"), _pod(phase="Pending"), _pod(ip=None),
                                 _pod(deleting=True), _pod(ready="False"), _pod(ready=None)])
def test_pods_that_are_not_workers_now(pod):
    assert pod_worker(pod, 8000) is None
