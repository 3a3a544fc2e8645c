"""The vLLM worker's private IPC folders (kv_events.new_ipc_endpoint): a worker killed without
closing leaves its folder behind, and the next worker to start removes it, but never a live
process's folder."""

from __future__ import annotations

import os
import subprocess
import sys

from splitserve.services.engine_vllm.kv_events import IPC_DIR_PREFIX, remove_stale_ipc_dirs


def test_folders_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)            # exited: nothing runs under that pid now (or it is reused: kept)
    stale = tmp_path / f"{IPC_DIR_PREFIX}{dead_pid}-abc"
    live = tmp_path / f"{IPC_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{IPC_DIR_PREFIX}oldstyle"         # no pid in its name: not ours to judge
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "events").write_text("")
    removed = remove_stale_ipc_dirs(str(tmp_path))
    alive = os.path.exists(f"/proc/{dead_pid}")
    assert removed == ([] if alive else [stale])
    assert live.is_dir() and other.is_dir() and stale.is_dir() == alive
