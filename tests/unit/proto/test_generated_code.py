"""The committed generated code in proto/v1 is exactly what the generator produces now."""

from __future__ import annotations

import filecmp
from pathlib import Path

from splitserve.proto import generate


def test_generated_code_is_fresh(tmp_path):
    generate.generate(tmp_path)
    committed = generate.OUTPUT_DIR
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in committed.iterdir() if p.is_file() and not p.name.endswith(".pyc")), (
        "proto/v1 has stale or missing files; run `python -m splitserve.proto.generate`")
    stale = [name for name in fresh if not filecmp.cmp(tmp_path / name, committed / name, shallow=False)]
    assert not stale, f"stale generated code {stale}; run `python -m splitserve.proto.generate`"


def test_generated_imports_are_package_relative():
    for path in generate.OUTPUT_DIR.glob("*.py"):
        text = path.read_text()
        assert "from splitserve.v1 import" not in text, path
        assert "import splitserve.v1" not in text, path


def test_services_and_package():
    from splitserve.proto.v1 import inference_pb2, worker_pb2

    assert worker_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert set(worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name) == {
        "Generate", "GenerateSession", "Prefill", "Abort", "FenceTransfer", "KvEvents", "Stats", "Describe", "Drain", "Suspend"}
    assert set(inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name) == {"Generate"}
    assert Path(generate.SOURCE_DIR, "worker.proto").is_file()
