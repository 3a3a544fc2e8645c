"""Loaded by every process of the traced deployment (bench/request_path.py puts this folder on
PYTHONPATH): a profile hook that, between SIGUSR1 and SIGUSR2, records which of the
repository's files call which. It records nothing before SIGUSR1, so start-up is not counted."""

import json
import os
import signal
import sys
import threading

_ROOT = os.environ.get("SPLITSERVE_TRACE_ROOT", "")
_OUT = os.environ.get("SPLITSERVE_TRACE_OUT", "")
_state = {"on": False}
# Library frames that run callbacks: a frame of ours above one of them did not call what runs below.
_DISPATCHERS = {"_run", "_run_once", "run_forever", "run", "_bootstrap_inner", "_worker", "__step", "__wakeup"}
_files: set[str] = set()
_edges: set[tuple[str, str]] = set()


def _profile(frame, event, arg):
    if event != "call" or not _state["on"]:
        return
    callee = frame.f_code.co_filename
    if not callee.startswith(_ROOT) or callee == __file__:
        return
    _files.add(callee)
    caller = frame.f_back
    while caller is not None and not caller.f_code.co_filename.startswith(_ROOT):
        if caller.f_code.co_name in _DISPATCHERS:
            return                      # a callback of the event loop or a thread: nobody of ours called it
        caller = caller.f_back          # through library frames (functools, grpc, contextlib) to our caller
    if caller is not None and caller.f_code.co_filename != callee:
        _edges.add((caller.f_code.co_filename, callee))


def _start(signum, frame):
    _files.clear()
    _edges.clear()
    _state["on"] = True


def _dump(signum, frame):
    _state["on"] = False
    with open(f"{_OUT}/{os.getpid()}.json", "w") as f:
        loaded = sorted(m.__file__ for m in list(sys.modules.values())
                        if (getattr(m, "__file__", None) or "").startswith(_ROOT) and m.__file__ != __file__)
        json.dump({"argv": sys.argv, "files": sorted(_files), "edges": sorted(_edges), "loaded": loaded,
                   "torch": "torch" in sys.modules}, f)


if _ROOT and _OUT:
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
