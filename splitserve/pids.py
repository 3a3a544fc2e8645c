"""Whether a process id names a live process: for the leftovers (temporary folders, sockets)
that a killed process could not remove, and that whoever comes next cleans up."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (or is another user's: kill(0) is then refused, not missing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
