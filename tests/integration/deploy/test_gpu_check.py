"""scripts/gpu-check.sh --dry-run: the device check's every step, on this CPU, so it cannot rot.

The real run needs a lent CUDA machine (`-m gpu` tests, bf16, batch 128, 4k context); the dry
run takes the same steps with CPU sizes and must finish with every step at exit code 0.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_dry_run_passes_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "SPLITSERVE_TEST_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    steps = dict(line.split(" ", 2)[:2] for line in (out / "summary.txt").read_text().splitlines())
    assert set(steps) == {"machine", "collect-gpu-tests", "gpu-tests", "decode-batches", "decode-long-context"}
    assert all(rc == "rc=0" for rc in steps.values()), steps
    # The gpu tests are still there to be run on a device: collected, and marked.
    assert "test_cuda_bfloat16_smollm2_answers" in (out / "collect-gpu-tests.log").read_text()
    for name in ("decode_batches", "decode_long_context"):
        report = json.loads((out / f"{name}.json").read_text())
        assert report["device"] == "cpu" and report["cpu"]
        assert all(min(r["paged_tok_s"]) > 0 and min(r["gather_tok_s"]) > 0 for r in report["rows"])
