#!/usr/bin/env bash
# Build the CPU flavour of the image where no container registry is reachable (this
# project's sandboxes and CI): the base is made here with debootstrap from Debian's
# mirror instead of being pulled, imported into buildah, and the image is built with
# buildah's vfs storage and chroot isolation (no daemon, no overlay mounts, no user
# namespaces needed). Opt-in: `make test` does not run it.
#
#   scripts/build-image-offline.sh [ARGS for scripts/build-image.sh ...]     (--engine vllm: the vLLM flavour)
#
# Needs root, debootstrap and buildah (apt-get install debootstrap buildah). The base
# rootfs and buildah's storage are cached under
# ${SPLITSERVE_IMAGE_CACHE:-~/.cache/splitserve/image}/<debian release>-<python>/, so a
# second run reuses the base. Python comes from the release (bookworm: 3.11).
# TORCH_INDEX_URL is passed on: where download.pytorch.org is unreachable, set it to
# https://pypi.org/simple (PyPI's torch is the CUDA build; it runs on CPU, but is
# several GB bigger). PIP_CERT (a CA bundle) is mounted for pip when set.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RELEASE="${DEBIAN_RELEASE:-bookworm}"
case "$RELEASE" in
    bookworm) PYTHON_VERSION=3.11 ;;
    trixie) PYTHON_VERSION=3.13 ;;
    *) echo "build-image-offline.sh: unknown Debian release '$RELEASE'" >&2; exit 2 ;;
esac
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${SPLITSERVE_IMAGE_CACHE:-$HOME/.cache/splitserve/image}/$RELEASE-$PYTHON_VERSION"
BASE_IMAGE="localhost/splitserve-base:$RELEASE"
STORAGE=(--root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver vfs)

for tool in debootstrap buildah; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "build-image-offline.sh: $tool is missing (apt-get install debootstrap buildah)" >&2
        exit 1
    fi
done
mkdir -p "$CACHE"

if [[ ! -f "$CACHE/rootfs.tar" ]]; then
    rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs"' EXIT
    echo "+ debootstrap --variant=minbase $RELEASE $rootfs $MIRROR"
    debootstrap --variant=minbase "$RELEASE" "$rootfs" "$MIRROR"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner -cf "$CACHE/rootfs.tar.partial" .
    mv "$CACHE/rootfs.tar.partial" "$CACHE/rootfs.tar"
    rm -rf "$rootfs"
    trap - EXIT
fi

if ! buildah "${STORAGE[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    container="$(buildah "${STORAGE[@]}" from scratch)"
    buildah "${STORAGE[@]}" add "$container" "$CACHE/rootfs.tar" /
    buildah "${STORAGE[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$container"
    buildah "${STORAGE[@]}" commit --rm "$container" "$BASE_IMAGE"
fi

# Behind a TLS-intercepting proxy pip needs the host's CA bundle (PIP_CERT, as pip
# itself reads it): mounted for the RUN steps only, never copied into the image.
ca_args=()
if [[ -n "${PIP_CERT:-}" ]]; then
    ca_args=(-v "$PIP_CERT:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
fi

BUILDER=buildah BUILDER_GLOBAL_ARGS="${STORAGE[*]}" \
    "$ROOT/scripts/build-image.sh" --flavour cpu --base "$BASE_IMAGE" "$@" -- \
    --isolation chroot --pull=false "${ca_args[@]}"
# The image this build replaced under the same tag is left untagged: each is ~6 GB in vfs.
buildah "${STORAGE[@]}" rmi --prune >/dev/null
