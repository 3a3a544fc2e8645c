"""What the image tests share: buildah on the cached vfs storage, the pins, the openai check."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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


def complete(port: int, timeout_s: float = 120) -> str:
    """12 greedy tokens of PROMPT through the official openai client."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=timeout_s)
    result = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 12
    return result.choices[0].text
