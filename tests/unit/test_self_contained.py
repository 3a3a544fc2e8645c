"""Nothing in the repository names the development workspace's shared folder.

A clone is all a user has: a code path, test or doc that reaches outside it (the
folder beside a development checkout, or that workspace's absolute path) works
only on the machine that wrote it. Every tracked file is read (bytes, so data files
count too); the needles are built from parts so this file does not match itself.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NEEDLES = [".." + "/shared", "/work" + "/shared"]


def _tracked_files() -> list[str]:
    listing = subprocess.run(["git", "ls-files", "-z"],
                             cwd=REPO_ROOT, capture_output=True, check=True, timeout=60)
    return [name for name in listing.stdout.decode().split("\0") if name]


def test_no_file_names_the_workspace_shared_folder():
    files = _tracked_files()
    assert "pyproject.toml" in files          # the listing really is the repository's
    offenders = []
    for name in files:
        path = REPO_ROOT / name
        if not path.is_file():                # deleted in the work tree, not yet committed
            continue
        content = path.read_bytes()
        offenders += [f"{name}: {needle}" for needle in NEEDLES if needle.encode() in content]
    assert not offenders, "files that reach outside the repository:\n" + "\n".join(offenders)
