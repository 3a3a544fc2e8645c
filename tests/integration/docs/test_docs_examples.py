"""Docs that execute (issue 37): every shell and Python block of the repository's Markdown runs
here against real processes, or is marked, right before it, with the test that runs it or why
nothing can:

    <!-- run-by: tests/integration/serving/test_serve.py::test_readme_examples_as_printed_answer_about_paris -->
    <!-- not-run: installs packages; tests/integration/cli/test_quickstart.py runs it -->

The rule covers every Markdown file git tracks (README.md, docs/, the folders' READMEs), so a
block added tomorrow runs tomorrow. `test_every_block_runs_here_or_says_why_not` fails on a
fence without a language, an empty reason, a marker that marks no block, a `run-by` that names
no test, and a test named in a marker that does not exist; `test_doc_block` runs each unmarked
block.

How a block runs, as a reader would run it:
- Shell blocks: `bash -e -o pipefail -c BLOCK` in the repository root; Python blocks:
  `python -c BLOCK` in a fresh process, cwd an empty folder (the reader's own script).
- A block that talks to http://127.0.0.1:8000 talks to one `splitserve serve --aggregated` on
  the shipped SmolLM2 (the model the README's examples name), started once for the module on
  a free port: that URL in the block is replaced by the server's. Placeholder paths are
  replaced by real ones: `/path/to/hf-folder` by the suite's random Llama checkpoint,
  `model.Q4_1.gguf` by the shipped SmolLM2 GGUF. SPLITSERVE_CACHE_DIR points at the suite's
  converted SmolLM2, so `--model smollm2` converts nothing.
- A shell block that would install packages, change a cluster or start a long-lived server
  (`pip install`, `helm install`, `splitserve serve`, ...: NEVER_RUN) is not run: it fails,
  asking for a marker.
- It passes when it exits 0, printed no traceback, and no HTTP reply it printed is an OpenAI
  error body (`curl -s` exits 0 on a 400).

The tool, measured (2 busy cores, the repository's 15 Markdown files, 41 fences):

| | install | finds | shell blocks | marks a block not run | parse |
|---|---|---|---|---|---|
| markdown-it-py (chosen) | 0 B more (rich's dependency) | all 41 fences, with language and line | any info string | an HTML block before the fence, read with a regex | 0.15 s |
| Sybil 10.1.0 | 0.5 MB, no deps | 17: only blocks a parser claims; others silently ignored | a CodeBlockParser per language, evaluator to write | `<!-- skip: next -->` (a reason only as `if(cond, reason=...)`), evaluated as Python | 0.04 s |
| pytest-examples 0.0.18 | 8.4 MB (black, pytokens, pathspec) + ruff (24 MB binary) | 3: Python blocks only | none | fence settings (`py test="skip"`), no reason | 0.005 s (0.5 s import) |

Both libraries evaluate Python in the test process (a shared namespace) and skip what is not
claimed; here every block needs its own process (a fresh interpreter, substituted URLs, the
reader's PATH) and every unclaimed fence must fail, which is the part neither does. What is left
is a parser: markdown-it-py is a maintained CommonMark one that is installed already.

Cost, measured on the 2 shared cores (load ~3): the module took 178 s wall, 85 s CPU; the
`splitserve generate` block (five commands, each a fresh torch process, one with two ranks)
101 s, the server's start 29 s, the structured-outputs block 28 s, the engine block 13 s. A
second run at load ~8 took 315 s wall for the same 85 s CPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from splitserve.checkpoints.model_source import find_packaged_gguf
from splitserve.net import free_port
from splitserve.testing.doc_blocks import DocBlock, repository_blocks
from splitserve.testing.openai_api import served_model_name
from splitserve.testing.processes import CHILD_ENV, READY_TIMEOUT_S, Proc

REPO = Path(__file__).resolve().parents[3]
DOC_URL = "http://127.0.0.1:8000"
BLOCK_TIMEOUT_S = 300.0
BLOCKS, STRAY_MARKERS = repository_blocks(REPO)
RUN_BLOCKS = [block for block in BLOCKS if block.runs_here]
TEST_PATH = re.compile(r"\btests/[\w/]+\.py(?:::\w+)?")
# Commands a test must never run unasked: they install things, change a cluster or start a
# server that runs until stopped. An unmarked block with one fails at once, asking for a marker.
NEVER_RUN = re.compile(r"\b(?:pip3? install|apt(?:-get)? install|make (?:test|install)|helm (?:install|upgrade)"
                       r"|kubectl (?:apply|create|delete)|(?:docker|podman|buildah) push"
                       r"|splitserve (?:serve|worker|frontend|operator|kvstore)\b(?!.*--help))")


def test_every_block_runs_here_or_says_why_not():
    assert any(block.path == "README.md" for block in RUN_BLOCKS)      # the collector sees the README
    unlabeled = [block.id for block in BLOCKS if not block.language]
    assert not unlabeled, f"fences without a language (```bash, ```python, ```text, ...): {unlabeled}"
    marked = [block for block in BLOCKS if block.marker]
    empty = [block.id for block in marked if not block.reason]
    assert not empty, f"markers without a reason: {empty}"
    strays = [f"{m.path}:{m.line}" for m in STRAY_MARKERS]
    assert not strays, f"markers with no fenced block right after them: {strays}"
    data = [block.id for block in marked if not block.is_code]
    assert not data, f"markers on blocks that are not shell or Python (never run anyway): {data}"
    unnamed = [block.id for block in marked if block.marker == "run-by"
               and not any("::" in name for name in TEST_PATH.findall(block.reason or ""))]
    assert not unnamed, f"run-by markers that name no test (tests/...py::test_name): {unnamed}"
    missing = [f"{block.id}: {name}" for block in marked
               for name in TEST_PATH.findall(block.reason or "") if not _test_exists(name)]
    assert not missing, f"markers naming tests that do not exist: {missing}"


@pytest.mark.parametrize("source, refused", [
    ("python3 -m pip install -e '.[nixl]' && splitserve serve", True), ("make test", True),
    ("helm install splitserve deploy/helm/splitserve", True), ("splitserve frontend --worker both=h:1", True),
    ("splitserve serve --help", False), ("splitserve generate --model smollm2 --prompt Hi", False),
    ("curl -s http://127.0.0.1:8000/v1/models", False)])
def test_blocks_that_install_or_start_servers_are_refused_unmarked(source: str, refused: bool):
    assert bool(NEVER_RUN.search(source)) == refused


def _test_exists(name: str) -> bool:
    path, _, function = name.partition("::")
    return (REPO / path).is_file() and (not function or f"def {function}(" in (REPO / path).read_text())


@dataclass(frozen=True, slots=True)
class DocsServer:
    base_url: str
    proc: Proc


@pytest.fixture(scope="session")
def smollm2_cache(smollm2_dir) -> Path:
    """SPLITSERVE_CACHE_DIR's layout: <cache>/models/<name>."""
    return smollm2_dir.parent.parent


def _reader_env(smollm2_cache: Path) -> dict[str, str]:
    """The environment blocks and the server run in: the suite's interpreter first on PATH (so
    `python`, `splitserve` and `pip` are the reader's), the suite's converted SmolLM2."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, **CHILD_ENV, "PATH": path, "SPLITSERVE_CACHE_DIR": str(smollm2_cache)}


@pytest.fixture(scope="module")
def docs_server(smollm2_cache):
    """`splitserve serve` on the shipped SmolLM2, one aggregated worker, free ports."""
    port = free_port()
    proc = Proc.start(["splitserve", "serve", "--aggregated", "--workers", "1", "--port", str(port),
                       "--grpc-port", str(free_port()), "--threads", "1", "--kv-cache-gib", "0.1"],
                      env=_reader_env(smollm2_cache))
    base_url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for_line(rf"splitserve is ready: {re.escape(base_url)}/v1", READY_TIMEOUT_S)
        assert served_model_name(f"{base_url}/v1") == "smollm2"      # the name the docs' examples use
        yield DocsServer(base_url, proc)
    finally:
        code = proc.stop()
        assert code == 0, proc.tail()


def _substituted(block: DocBlock, request: pytest.FixtureRequest) -> str:
    """The block's text with the doc's URL and placeholder paths made real (module docstring)."""
    source = block.source
    if DOC_URL in source:
        source = source.replace(DOC_URL, request.getfixturevalue("docs_server").base_url)
    if "/path/to/hf-folder" in source:
        source = source.replace("/path/to/hf-folder", str(request.getfixturevalue("llama_dir")))
    if "model.Q4_1.gguf" in source:
        source = source.replace("model.Q4_1.gguf", str(find_packaged_gguf()[0]))
    return source


def _run(block: DocBlock, source: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    argv = ["bash", "-e", "-o", "pipefail", "-c", source] if block.is_shell else [sys.executable, "-c", source]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def _error_replies(stdout: str) -> list[dict]:
    """OpenAI error bodies among the JSON documents the block printed, one a line."""
    errors = []
    for line in stdout.splitlines():
        try:
            reply = json.loads(line)
        except ValueError:
            continue
        if isinstance(reply, dict) and "error" in reply:
            errors.append(reply)
    return errors


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[block.id for block in RUN_BLOCKS])
def test_doc_block(block: DocBlock, request: pytest.FixtureRequest, smollm2_cache: Path, tmp_path: Path):
    if block.is_shell and (command := NEVER_RUN.search(block.source)):
        pytest.fail(f"{block.id} runs `{command.group(0)}`, which a test must not run: put "
                    "`<!-- not-run: why -->` (or `<!-- run-by: tests/...py::test_name -->`) right before it")
    source = _substituted(block, request)
    result = _run(block, source, _reader_env(smollm2_cache), REPO if block.is_shell else tmp_path)
    shown = f"{block.id} ({block.language}) exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}" \
            f"\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, shown
    assert "Traceback (most recent call last)" not in result.stdout + result.stderr, shown
    assert not _error_replies(result.stdout), shown
    print(f"\n[{block.id}] {result.stdout.strip()[:300]}")
