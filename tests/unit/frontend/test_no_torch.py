"""The frontend process never imports torch: not to start, not to open its tokenizer (nor
OpenTelemetry, while tracing is off).

Text work is the frontend's and weights are the workers', so a frontend needs
the tokenizer and the wire contract only; torch would add seconds and hundreds
of MB to every frontend replica. Each check runs in a fresh interpreter (this
test process has torch loaded already) and imports what `splitserve frontend`
imports, then opens the tokenizer the way `build_frontend` does.
"""

from __future__ import annotations

import json
import subprocess
import sys

FRONTEND_MODULES = [
    "splitserve.services.cli.main",          # `splitserve frontend` starts here
    "splitserve.services.frontend.server",
    "splitserve.services.frontend.http.app",
    "splitserve.services.frontend.grpc.inference",
    "splitserve.services.frontend.core",
]

# What the frontend may take from the engine: the checkpoint opener, for the tokenizer.
# The packages a frontend must never load (it reads checkpoints through splitserve/checkpoints/).
ENGINE_SIDE = ("splitserve.services.worker", "splitserve.services.engine", "splitserve.services.engine_api")

_PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
from splitserve.checkpoints.model_source import open_checkpoint
from splitserve.services.text.tokenizer import Tokenizer
tokenizer = Tokenizer(open_checkpoint({folder!r}))
json.dump({{"vocab_size": tokenizer.vocab_size, "hello": tokenizer.encode("Hello there"),
            "modules": sorted(sys.modules)}}, sys.stdout)
"""


def _probe(folder) -> dict:
    code = _PROBE.format(modules=FRONTEND_MODULES, folder=str(folder))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_frontend_starts_and_opens_its_tokenizer_without_torch(llama_dir):
    probe = _probe(llama_dir)
    assert probe["vocab_size"] == 32000 and len(probe["hello"]) > 1     # a real tokenizer was opened
    modules = probe["modules"]
    assert "torch" not in modules, [m for m in modules if m.startswith("torch")][:5]
    loaded = sorted(m for m in modules if m in ENGINE_SIDE or m.startswith(tuple(f"{p}." for p in ENGINE_SIDE)))
    assert not loaded, loaded
    # Tracing off (no --otlp-traces-endpoint) loads no OpenTelemetry SDK or exporter (splitserve/tracing.py;
    # FastAPI itself imports the API's context and trace modules where they are installed).
    sdk = [m for m in modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
    assert not sdk, sdk
