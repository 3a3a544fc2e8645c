#!/usr/bin/env bash
# Build, once, the real Kubernetes control plane the tests in tests/k8s run on
# (DESIGN section 6): kube-apiserver, kube-controller-manager, kube-scheduler and
# kubectl from the Go module k8s.io/kubernetes, kwok (simulated nodes and
# kubelets) from sigs.k8s.io/kwok, and helm from helm.sh/helm/v3 — all through
# the Go module proxy, into a cache outside the repository keyed by versions:
#
#   ${SPLITSERVE_K8S_CACHE:-$HOME/.cache/splitserve/k8s}/k8s-<v>_kwok-<v>_helm-<v>_etcd-<v>/bin/
#
# A cache that is complete is reused (seconds). Binaries are built into a
# temporary folder and moved into place one by one, and bin/ itself appears
# only when every binary is there, so a half-built cache is never used.
#
# k8s.io/kubernetes is not meant to be a dependency: its go.mod requires its
# staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0 and replaces
# them with ./staging/src paths, which Go ignores in a dependency. A small
# generated go.mod therefore requires k8s.io/kubernetes and pins every staging
# module with a replace directive at the matching v0.<minor>.<patch>.
# kwok and helm are built from their own modules, so their dependency versions
# never meet kubernetes'.
#
# etcd is built too, from go.etcd.io/etcd/server/v3 (its go.mod has replace
# directives, so it gets a generated go.mod like kubernetes): Debian's
# etcd-server is 3.4, whose missing watch progress requests break client-go's
# streaming lists (kwok's informers never settle against it).
#
# Prints the path of the bin/ folder as its last line. With --print-bin-dir it
# only prints that path (built or not) and builds nothing: the test fixture
# uses it so that the versions are written down in this one place.
set -euo pipefail

# Everything runs inside main(), which bash parses whole before running, so
# editing this file while a build runs cannot derail that build.
main() {
    K8S_VERSION="${SPLITSERVE_K8S_VERSION:-v1.37.2}"
    KWOK_VERSION="${SPLITSERVE_KWOK_VERSION:-v0.8.0}"
    HELM_VERSION="${SPLITSERVE_HELM_VERSION:-v3.22.0}"
    ETCD_VERSION="${SPLITSERVE_ETCD_VERSION:-v3.6.16}"

    CACHE_ROOT="${SPLITSERVE_K8S_CACHE:-$HOME/.cache/splitserve/k8s}"
    KEY="k8s-${K8S_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}_etcd-${ETCD_VERSION}"
    DEST="$CACHE_ROOT/$KEY"
    BIN="$DEST/bin"
    K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
    ALL_BINARIES=("${K8S_BINARIES[@]}" kwok helm etcd)

    log() { echo "[build-control-plane] $*" >&2; }

    # kwok's default Stages (node initialise and lease heartbeat, pod ready,
    # complete and delete): the kwok binary needs them in its configuration
    # (only kwokctl embeds them), so they are copied from the same kwok version.
    KWOK_STAGES="kwok-stages.yaml"

    cache_complete() {
        local b
        [[ -d "$BIN" && -s "$BIN/$KWOK_STAGES" ]] || return 1
        for b in "${ALL_BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
    }

    if [[ "${1:-}" == "--print-bin-dir" ]]; then
        echo "$BIN"
        exit 0
    fi

    if cache_complete; then
        log "reusing $BIN"
        echo "$BIN"
        exit 0
    fi

    # The machines' Go lives in /usr/local/go, put on PATH by ~/.bashrc only.
    if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
        export PATH="/usr/local/go/bin:$PATH"
    fi
    command -v go >/dev/null || { log "go is not installed (need go >= 1.26 on PATH)"; exit 1; }
    start=$(date +%s)
    mkdir -p "$DEST"
    # Partial results live in staging/ until all binaries exist.
    STAGE="$DEST/staging"
    mkdir -p "$STAGE"
    # An incomplete bin/ (a binary deleted, or one added to this script):
    # keep what it has and build only what is missing.
    if [[ -d "$BIN" ]]; then
        find "$BIN" -maxdepth 1 -type f -exec mv -n {} "$STAGE/" \;
        rm -rf "$BIN"
    fi
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/splitserve-k8s-build.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT

    export GOFLAGS="-buildvcs=false"
    export CGO_ENABLED=0
    LDFLAGS_COMMON="-s -w"

    # Move a freshly built binary into staging/ atomically (same filesystem).
    install_binary() {
        local src="$1" name="$2"
        cp "$src" "$STAGE/.$name.tmp"
        chmod 0755 "$STAGE/.$name.tmp"
        mv -f "$STAGE/.$name.tmp" "$STAGE/$name"
    }

    build_kubernetes() {
        local need=0 b
        for b in "${K8S_BINARIES[@]}"; do [[ -x "$STAGE/$b" ]] || need=1; done
        [[ $need == 1 ]] || { log "kubernetes binaries already staged"; return; }
        local t0=$(date +%s) mod="$WORK/kubernetes"
        mkdir -p "$mod"
        local minor="${K8S_VERSION#v1.}"          # 37.2
        local staging_version="v0.${minor}"       # v0.37.2
        log "fetching k8s.io/kubernetes@$K8S_VERSION go.mod"
        local kmod
        kmod="$(cd "$mod" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
        [[ -f "$kmod" ]] || { log "could not download k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
        {
            echo "module splitserve.local/k8sbuild"
            echo
            echo "go $(sed -n 's/^go \(.*\)/\1/p' "$kmod")"
            echo
            echo "require k8s.io/kubernetes $K8S_VERSION"
            echo
            echo "replace ("
            # Every "k8s.io/X => ./staging/src/k8s.io/X" becomes "k8s.io/X => k8s.io/X v0.M.P".
            sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/src/.*#\t\1 => \1 '"$staging_version"'#p' "$kmod"
            echo ")"
        } >"$mod/go.mod"
        cat >"$mod/tools.go" <<EOF
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
EOF
        log "resolving the kubernetes module graph"
        (cd "$mod" && go mod tidy)
        local v="k8s.io/component-base/version" cv="k8s.io/client-go/pkg/version"
        local date; date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        local x=""
        for pkg in "$v" "$cv"; do
            x+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=${minor%%.*}"
            x+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
        done
        log "building ${K8S_BINARIES[*]} (the long part)"
        mkdir -p "$WORK/out-k8s"
        (cd "$mod" && go build -trimpath -ldflags "$LDFLAGS_COMMON$x" -o "$WORK/out-k8s/" \
            k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
            k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
        for b in "${K8S_BINARIES[@]}"; do install_binary "$WORK/out-k8s/$b" "$b"; done
        log "kubernetes built in $(( $(date +%s) - t0 )) s"
    }

    # go install-style build of one main package from its own module.
    build_tool() {
        local name="$1" pkg="$2" version="$3" ldflags="$4"
        [[ -x "$STAGE/$name" ]] && { log "$name already staged"; return; }
        local t0=$(date +%s)
        log "building $name from $pkg@$version"
        GOBIN="$WORK/out-$name" go install -trimpath -ldflags "$LDFLAGS_COMMON $ldflags" "$pkg@$version"
        install_binary "$WORK/out-$name/$(basename "$pkg")" "$name"
        log "$name built in $(( $(date +%s) - t0 )) s"
    }

    # etcd's main package is the root of go.etcd.io/etcd/server/v3.
    build_etcd() {
        [[ -x "$STAGE/etcd" ]] && { log "etcd already staged"; return; }
        local t0=$(date +%s) mod="$WORK/etcd"
        mkdir -p "$mod" "$WORK/out-etcd"
        printf 'module splitserve.local/etcdbuild\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' \
            "$ETCD_VERSION" >"$mod/go.mod"
        printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >"$mod/tools.go"
        log "building etcd from go.etcd.io/etcd/server/v3@$ETCD_VERSION"
        (cd "$mod" && go mod tidy && go build -trimpath -ldflags "$LDFLAGS_COMMON" \
            -o "$WORK/out-etcd/etcd" go.etcd.io/etcd/server/v3)
        install_binary "$WORK/out-etcd/etcd" etcd
        log "etcd built in $(( $(date +%s) - t0 )) s"
    }

    copy_kwok_stages() {
        local dir f
        dir="$(cd "$WORK" && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')"
        : >"$STAGE/.$KWOK_STAGES.tmp"
        for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
                 pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
            [[ -f "$dir/kustomize/stage/$f" ]] || { log "kwok $KWOK_VERSION has no stage $f"; exit 1; }
            { echo "---"; cat "$dir/kustomize/stage/$f"; } >>"$STAGE/.$KWOK_STAGES.tmp"
        done
        mv -f "$STAGE/.$KWOK_STAGES.tmp" "$STAGE/$KWOK_STAGES"
    }

    build_kubernetes
    build_tool kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" \
        "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
    copy_kwok_stages
    # helm's default Kubernetes version (helm template/lint without --kube-version)
    # is set at link time from its client-go version, as helm's Makefile does.
    local helm_mod helm_kube_minor
    helm_mod="$(cd "$WORK" && go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
    helm_kube_minor="$(sed -n 's/^[[:space:]]*k8s\.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$helm_mod")"
    [[ -n "$helm_kube_minor" ]] || { log "cannot read client-go's version from helm's go.mod"; exit 1; }
    local hx="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
    for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
        hx+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$helm_kube_minor"
    done
    build_tool helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$hx"
    build_etcd

    # Publish: staging/ becomes bin/ in one rename.
    rm -rf "$BIN"
    mv "$STAGE" "$BIN"
    cache_complete || { log "internal error: $BIN is incomplete"; exit 1; }
    log "built ${ALL_BINARIES[*]} in $(( $(date +%s) - start )) s into $BIN"
    echo "$BIN"
}

main "$@"; exit $?
