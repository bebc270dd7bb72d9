#!/usr/bin/env bash
# Builds the e2e control plane from Go modules: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, kwok and helm, each cached as ~/.cache/tandem/bin/<name>-<version>.
# Idempotent: when every binary is already cached it returns at once. Prints the bin directory.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}"
BIN="$CACHE/bin"
export GOMODCACHE="$CACHE/gomod"
export GOCACHE="$CACHE/gobuild"
export GOFLAGS=-mod=mod
export CGO_ENABLED=0
# Every module here declares go <= 1.26; a machine with an older Go fetches this toolchain
# through the module proxy instead of failing.
export GOTOOLCHAIN="${GOTOOLCHAIN_OVERRIDE:-go1.26.8+auto}"
mkdir -p "$BIN" "$GOMODCACHE" "$GOCACHE"
# One build at a time per cache: a second run (another checkout on this machine) waits, then finds
# the binaries built instead of compiling everything again beside the first.
exec 9>"$CACHE/cluster-build.lock"
flock 9

log() { printf '[cluster-binaries] %s\n' "$*" >&2; }

# The binaries also depend on how they are built (wrapper mains, ldflags): a change to any of
# these files rebuilds them, which the Go build cache keeps to a relink.
RECIPE="$(cat "$HERE/build.sh" "$HERE/versions.env" "$HERE"/k8sbin/cmd/*/main.go \
  "$HERE/etcdbin/main.go" | sha256sum | cut -c1-16)"

have() {  # have NAME VERSION: the binary is cached, executable and built by this recipe
  [ -x "$BIN/$1-$2" ] && [ "$(cat "$BIN/.$1-$2.recipe" 2>/dev/null)" = "$RECIPE" ]
}

# Builds into a scratch dir and renames into place, so an interrupted build never leaves a
# half-written binary that a later run would take for a cached one.
install_bin() {  # install_bin SRC NAME VERSION
  chmod +x "$1"
  mv -f "$1" "$BIN/$2-$3"
  echo "$RECIPE" >"$BIN/.$2-$3.recipe"
  log "built $2-$3"
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tandem-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

build_kubernetes() {
  local v="$K8S_VERSION" staging="v0.${K8S_VERSION#v1.}"
  if have kube-apiserver "$v" && have kube-controller-manager "$v" && have kube-scheduler "$v" \
    && have kubectl "$v"; then
    return
  fi
  log "building kubernetes $v (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl)"
  local mod="$WORK/k8sbin"
  mkdir -p "$mod"
  cp -r "$HERE/k8sbin/." "$mod/"
  # k8s.io/kubernetes replaces every staging module with a local path; point each one at its
  # published module of the matching version instead, generated from its own go.mod.
  local gomod
  gomod="$(cd "$mod" && go mod download -json "k8s.io/kubernetes@$v" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')"
  {
    printf 'module tandem.dev/e2e/k8sbin\n\ngo 1.24.0\n\ngodebug default=go1.24\n\n'
    printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$v"
    sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/k8s.io/.*#\t\1 => \1 '"$staging"'#p' "$gomod"
    printf ')\n'
  } >"$mod/go.mod"
  local pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$v -X $pkg.gitMajor=1"
  ldflags+=" -X $pkg.gitMinor=$(echo "$v" | cut -d. -f2) -X $pkg.gitTreeState=clean"
  ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
  (cd "$mod" && go mod tidy && go build -trimpath -ldflags "$ldflags" -o "$WORK/out/" ./cmd/...)
  for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    install_bin "$WORK/out/$name" "$name" "$v"
  done
}

build_etcd() {
  local v="$ETCD_VERSION"
  have etcd "$v" && return
  log "building etcd $v"
  local mod="$WORK/etcdbin"
  mkdir -p "$mod"
  cp -r "$HERE/etcdbin/." "$mod/"
  printf 'module tandem.dev/e2e/etcdbin\n\ngo 1.24.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$v" >"$mod/go.mod"
  (cd "$mod" && go mod tidy && go build -trimpath \
    -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$v" -o "$WORK/etcd" .)
  install_bin "$WORK/etcd" etcd "$v"
}

build_kwok() {
  local v="$KWOK_VERSION"
  have kwok "$v" && return
  log "building kwok $v"
  GOBIN="$WORK/kwokbin" go install -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$v" "sigs.k8s.io/kwok/cmd/kwok@$v"
  install_bin "$WORK/kwokbin/kwok" kwok "$v"
}

build_helm() {
  local v="$HELM_VERSION"
  have helm "$v" && return
  log "building helm $v"
  # Without the Kubernetes minor version Helm assumes v1.20 for `helm template` and `helm lint`,
  # and a chart's kubeVersion constraint fails; Helm's own Makefile sets the same variables.
  local minor
  minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
  local ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$v"
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  GOBIN="$WORK/helmbin" go install -trimpath -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$v"
  install_bin "$WORK/helmbin/helm" helm "$v"
}

start=$(date +%s)
build_etcd
build_kwok
build_helm
build_kubernetes
log "ready in $(($(date +%s) - start)) s"
echo "$BIN"
