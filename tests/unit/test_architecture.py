"""The architecture as declared is the architecture as built.

- import-linter keeps every contract of pyproject.toml ([tool.importlinter]): the layers, the
  forbidden imports (a worker reaches its engine only through services/engine_api), and no
  import cycles inside a folder;
- docs/architecture.md's layer table is the one generated from those contracts;
- every package folder is named in the doc's §1, and every folder §1 names exists;
- the folders' READMEs that list their modules list them all.
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"


def _layers_doc() -> dict:
    return runpy.run_path(str(REPO / "scripts" / "layers_doc.py"))


def _section_1() -> str:
    text = DOC.read_text()
    return text[text.index("## 1."):text.index("## 2.")]


def _package_folders() -> set[str]:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = _layers_doc()["folder_of"]
    return {folder_of(package) for package in setuptools["packages"]}


def test_the_import_contracts_hold():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "lint_imports.py")], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    kept = re.search(r"Contracts: (\d+) kept, (\d+) broken", done.stdout)
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert kept and (int(kept[1]), int(kept[2])) == (len(contracts), 0), done.stdout[-2000:]


def test_the_contracts_forbid_what_the_layers_promise():
    """The linter is only as good as its contracts: the worker must not reach the engine, the
    store no worker or engine, the Ray target no operator, the engine no router."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = [re.split(r"\s*[|:]\s*", layer) for layer in next(c for c in contracts if c["type"] == "layers")["layers"]]
    depth = {name.strip(): i for i, names in enumerate(layers) for name in names}
    worker = next(c for c in contracts if c["id"] == "worker")
    assert "splitserve.services.engine" in worker["forbidden_modules"]
    assert depth["splitserve.services.kvstore"] == depth["splitserve.services.engine"] > depth["splitserve.services.worker"]
    assert depth["splitserve.router"] > depth["splitserve.services.engine"]           # the engine is above the router
    assert depth["splitserve.block_hashes"] > depth["splitserve.router"]             # ... and needs none of it
    assert depth["splitserve.services.spec"] > depth["splitserve.operator"] > depth["splitserve.services.ray_serve"]


def test_the_docs_layer_table_is_the_contracts():
    doc = _layers_doc()
    assert doc["current"]() == doc["table"](), "run `python scripts/layers_doc.py --write`"


def test_every_package_folder_is_named_in_the_architecture():
    named = set(re.findall(r"`([\w/.]+/)`", _section_1()))
    missing = sorted(f for f in _package_folders() if f.endswith("/") and f not in named)
    assert not missing, f"docs/architecture.md §1 names no {missing}"


def test_every_folder_the_architecture_names_exists():
    named = set(re.findall(r"`([\w/.]+/)`", _section_1()))
    gone = sorted(f for f in named if not (REPO / f).is_dir())
    assert not gone, f"docs/architecture.md §1 names folders that do not exist: {gone}"


@pytest.mark.parametrize("folder, pattern", [
    ("kvtransfer", "*.py"), ("router", "*.py"), ("splitserve", "*.py"), ("loadgen", "*.py"),
    ("operator/controller", "*.py"), ("proto/splitserve/v1", "*.proto")])
def test_a_readme_that_lists_its_modules_lists_them_all(folder, pattern):
    readme = REPO / folder / "README.md"
    if not readme.is_file():
        readme = REPO / folder.split("/")[0] / "README.md"
    text = readme.read_text()
    missing = sorted(p.name for p in (REPO / folder).glob(pattern)
                     if p.name != "__init__.py" and f"`{p.name}`" not in text)
    assert not missing, f"{readme.relative_to(REPO)} does not name {missing}"
