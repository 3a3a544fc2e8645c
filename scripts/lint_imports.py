"""Check the import contracts of pyproject.toml ([tool.importlinter]) with import-linter.

pyproject.toml maps top-level folders into the one import root (`router/` is
`splitserve.router`); an editable install resolves them through an import hook that
import-linter's graph builder (grimp) does not follow, since it walks the root package's
folder. So the mapped folders are first laid out as one package tree of symlinked files
in a temporary folder, exactly as `pip install .` would, and the tool reads that.

    python scripts/lint_imports.py          (make lint-imports; the suite runs it too)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lay_out(target: Path) -> None:
    """Symlink every .py file of the packages pyproject.toml lists to where it is imported from."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    for package in setuptools["packages"]:
        # The longest mapped prefix decides the folder (splitserve.services.cli → services/cli).
        prefix = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
        folder = REPO / mapping[prefix] / Path(*package[len(prefix):].split(".")[1:] if package != prefix else ())
        dest = target / Path(*package.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for source in folder.glob("*.py"):
            (dest / source.name).symlink_to(source)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="splitserve-layout-") as tmp:
        lay_out(Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        linter = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                  "sys.exit(lint_imports_command())", "--no-cache", str(REPO / "pyproject.toml")]
        return subprocess.run(linter, env=env, cwd=tmp, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
