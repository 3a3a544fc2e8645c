#!/usr/bin/env bash
# The device check: one prepared run on a CUDA machine (an H200 lent to an issue), or on
# this CPU with --dry-run so that the script cannot rot between lendings.
#
#   scripts/gpu-check.sh --prepare           here, before a lending: download the Python 3.12
#                                            wheels the device lacks into .gpu-wheels/ (≤ 64 MiB)
#   scripts/gpu-check.sh [--out DIR]         on the device (run it with carry [".gpu-wheels"])
#   scripts/gpu-check.sh --dry-run [--out DIR]   the same steps on CPU, small sizes (CI runs it)
#
# The device has torch, transformers and Triton on Python 3.12 and reaches nothing, so
# splitserve goes in with --no-deps and its other dependencies from .gpu-wheels/. Steps,
# each with its own time limit (10 minutes in all on the device):
#   1. the machine: nvidia-smi, torch's CUDA build, the CPU
#   2. the `gpu` tests (CUDA fp32 oracle, bf16 SmolLM2, VRAM KV transfer over TCP and NIXL)
#   3. decode tok/s at batch 1, 32 and 128 (bench/decode_attention.py: 256-token contexts)
#   4. decode at 4k context, batch 8: the paged path (the Triton kernel on CUDA) vs gather
# Every step writes its log under the output folder (default $OUT, else ./gpu-check-out)
# and summary.txt lists each step's exit code; the script exits non-zero if one failed.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=device
out="${OUT:-gpu-check-out}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) mode=dry ;;
        --prepare) mode=prepare ;;
        --out) out="$2"; shift ;;
        -h|--help) sed -n 2,20p "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
PYTHON="${PYTHON:-python3}"
WHEELS=.gpu-wheels

if [[ $mode == prepare ]]; then
    # Everything splitserve needs at run time that the device lacks, built for CPython 3.12.
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --implementation cp -d "$WHEELS" \
        "xgrammar==0.2.9" gguf safetensors tokenizers "grpcio==1.85.1" "grpcio-health-checking==1.85.1" \
        "protobuf>=7.36,<8" orjson pytest hypothesis jinja2 rich \
        --no-deps
    du -sh "$WHEELS"
    exit 0
fi

mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
failed=0
step() {   # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit} s): $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$summary"
    [[ $rc == 0 ]] || failed=1
}

if [[ $mode == dry ]]; then
    device=cpu; dtype=float32; marker="not gpu"
    gpu_tests=(tests/unit/engine/test_paged_attention.py)
    batches=(1 2); long_case=512x2; rounds=1; threads=1
else
    device=cuda; dtype=bfloat16; marker=gpu
    gpu_tests=(tests/integration/engine/test_dtypes_and_devices.py tests/integration/kvtransfer/test_vram.py)
    batches=(1 32 128); long_case=4096x8; rounds=3; threads=$(nproc)
    if [[ -d $WHEELS ]]; then
        step install 240 "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps "$WHEELS"/*.whl
        step install-splitserve 120 "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
    fi
fi

step machine 60 bash -c "nvidia-smi 2>/dev/null || echo 'no nvidia-smi (dry run)'; lscpu | head -20; \
    $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'"
# The gpu tests collect everywhere: a dry run proves they still import and are still marked.
step collect-gpu-tests 120 "$PYTHON" -m pytest -p no:cacheprovider -q --collect-only -m gpu \
    tests/integration/engine/test_dtypes_and_devices.py tests/integration/kvtransfer/test_vram.py
step gpu-tests 300 "$PYTHON" -m pytest -p no:cacheprovider -q -m "$marker" "${gpu_tests[@]}"
cases=""
for b in "${batches[@]}"; do cases="${cases:+$cases,}256x$b"; done
step decode-batches 240 "$PYTHON" bench/decode_attention.py --device "$device" --dtype "$dtype" \
    --cases "$cases" --rounds "$rounds" --steps 4 --retries 0 --threads "$threads" --out "$out/decode_batches.json"
step decode-long-context 240 "$PYTHON" bench/decode_attention.py --device "$device" --dtype "$dtype" \
    --cases "$long_case" --rounds "$rounds" --steps 4 --retries 0 --threads "$threads" --out "$out/decode_long_context.json"

echo "== summary"; cat "$summary"
exit $failed
