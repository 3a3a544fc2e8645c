"""Compile a kernel's C++ source into a shared library for this CPU, once, and load it.

The engine's CPU kernels are small C++ files beside this module that include only
ATen's parallel header (torch's OpenMP pool) and c10's scalar types, so one builds
in a few seconds with the system's g++ and needs no Python binding: callers use
ctypes with raw pointers. `-march=native` makes the code for the CPU it runs on,
so the cache key holds that CPU's model and flags as well as the source, the torch
version and the compiler: a cache copied to another machine is rebuilt, not run.

The cache lives in `$SPLITSERVE_KERNEL_CACHE` (default `~/.cache/splitserve/kernels`);
a file lock makes the workers that start together build it once.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
# -ffast-math is left out on purpose: in a shared library it can set the CPU's
# flush-to-zero mode for the whole process. Reassociation alone lets the loops vectorize.
CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno",
            "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-DNDEBUG")


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("SPLITSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "splitserve" / "kernels")


def compiler() -> str | None:
    """$CXX if it names a program, else g++ or c++ from PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("g++") or shutil.which("c++")


def cpu_identity() -> str:
    """The CPU's model name and feature flags, as /proc/cpuinfo gives them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def _torch_paths() -> tuple[list[str], str]:
    import torch
    from torch.utils.cpp_extension import include_paths

    return include_paths(), str(Path(torch.__file__).parent / "lib")


def _key(name: str, cxx: str) -> str:
    import torch

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    h = hashlib.sha256()
    for part in ((SOURCE_DIR / f"{name}.cpp").read_bytes(), torch.__version__.encode(), version.encode(),
                 cpu_identity().encode(), " ".join(CXXFLAGS).encode(), sys.version.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def build(name: str) -> Path:
    """The path of `name`.so for this machine, compiling `name`.cpp first if needed."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable(f"no C++ compiler: {os.environ.get('CXX') or 'g++'} not found; "
                                "install g++ or set CXX")
    out_dir = cache_root() / _key(name, cxx)
    lib = out_dir / f"{name}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():                   # another process built it while this one waited
            return lib
        includes, torch_lib = _torch_paths()
        tmp = out_dir / f"{name}.{os.getpid()}.so"
        cmd = [cxx, *CXXFLAGS, *(f"-I{p}" for p in includes), str(SOURCE_DIR / f"{name}.cpp"), "-o", str(tmp),
               f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelUnavailable(f"building {name}.cpp failed ({cxx}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    return lib


@lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL:
    """Build (if needed) and load a kernel library; raises KernelUnavailable."""
    import torch  # noqa: F401  (its libgomp and libc10 must be loaded first: the kernel shares them)

    try:
        return ctypes.CDLL(str(build(name)))
    except OSError as exc:
        raise KernelUnavailable(f"loading {name}: {exc}") from None
