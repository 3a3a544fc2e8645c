"""The distribution's layout (DESIGN section 1): one import root, `splitserve`.

The top-level folders are importable only as `splitserve.*`; `operator` stays
the standard-library module; every package folder is listed in pyproject.toml,
so a wheel built from it contains the whole tree. Imports run in a subprocess
started in an empty directory, so the repository root is not on sys.path.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

IMPORTABLE = [
    "splitserve",
    "splitserve.services.engine",
    "splitserve.router",
    "splitserve.kvtransfer",
    "splitserve.operator",
    "splitserve.proto",
    "splitserve.loadgen",
    "splitserve.testing",
]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def _pyproject() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_mapped_packages_import_from_anywhere(tmp_path):
    result = _python("import " + ", ".join(IMPORTABLE), tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["router", "services", "kvtransfer", "loadgen", "proto"])
def test_top_level_folders_are_not_importable(tmp_path, name):
    # A third-party distribution may own the name (proto-plus, which Ray pulls in, installs
    # a top-level `proto`); what must never happen is the name resolving to our folder.
    code = (f"import importlib.util, sys; spec = importlib.util.find_spec({name!r}); "
            "sys.stdout.write(spec.origin or '' if spec else '')")
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    if result.stdout:
        origin = Path(result.stdout).resolve()
        assert REPO_ROOT not in origin.parents, f"`import {name}` resolves to {origin}; only splitserve.{name} should"


def test_operator_is_the_standard_library_module(tmp_path):
    code = "import operator, sys; sys.stdout.write(operator.__file__); operator.itemgetter"
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    operator_file = Path(result.stdout).resolve()
    assert operator_file.parent == Path(sysconfig.get_paths()["stdlib"]).resolve(), operator_file


def test_operator_is_the_standard_library_module_from_the_repository_root():
    # `python -m` and `python -c` put the current folder first on sys.path; the top-level
    # operator/ folder has no __init__.py (the package is operator/controller/), so it can
    # only be a namespace portion, which the standard library's operator.py wins over.
    # -S: no site-packages, so nothing (pip, an editable finder) imported `operator` earlier.
    result = subprocess.run([sys.executable, "-S", "-c", "import collections, operator; operator.eq"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_python_m_pytest_works_from_the_repository_root():
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                             "tests/unit/test_layout.py"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "test_python_m_pytest_works_from_the_repository_root" in result.stdout


def test_every_package_folder_is_listed_in_pyproject():
    setuptools_table = _pyproject()["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools_table["package-dir"]
    listed = set(setuptools_table["packages"])
    found = set()
    for package, folder in package_dir.items():
        root = REPO_ROOT / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            found.add(".".join([package, *relative.parts]))
    missing = sorted(found - listed)
    assert not missing, f"package folders missing from pyproject's packages: {missing}"
    stale = sorted(listed - found)
    assert not stale, f"pyproject lists packages with no __init__.py: {stale}"
