#!/usr/bin/env bash
# Builds the programs a Go module of tests/cluster pins, from that module (go.sum checks every byte), into the
# directory given: its go.mod's `tool` lines name them. tests/cluster/go.mod: kube-apiserver,
# kube-controller-manager, kube-scheduler (k8s.io/kubernetes) and etcd (go.etcd.io/etcd/server/v3), the control
# plane of the real-cluster lane (make cluster: .tools/bin); tests/cluster/floor/go.mod: the kube-apiserver of the
# oldest Kubernetes minor the CRD is checked on (.tools/floor/bin). Go's module and build caches make a second build
# fast.
# Usage: tests/cluster/build.sh OUT_DIR [MODULE_DIR (default: tests/cluster)]
set -euo pipefail
out=$(realpath -m "${1:?usage: build.sh OUT_DIR [MODULE_DIR]}")
cd "${2:-$(dirname "$0")}"
command -v go >/dev/null || PATH="$PATH:/usr/local/go/bin"  # the toolchain's default place, when PATH lacks it
command -v go >/dev/null || { echo "error: no 'go' on PATH: install the Go toolchain (go.mod names the version)" >&2; exit 2; }
v=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' go.mod)
minor=${v#v1.}; minor=${minor%%.*}
# the `tool` directive's packages, one line (`tool pkg`) or a block (`tool (` ... `)`)
mapfile -t tools < <(awk '$1 == "tool" && $2 != "(" {print $2} $1 == "tool" && $2 == "(" {b=1; next} b && $1 == ")" {b=0} b {print $1}' go.mod)
[ "${#tools[@]}" -gt 0 ] || { echo "error: $(pwd)/go.mod names no tool to build" >&2; exit 2; }
ld="-s -w"
# What `kube-apiserver --version` and the /version endpoint report (the release build sets the same variables).
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld="$ld -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
mkdir -p "$out"
tmp="$out/.build.$$"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "building from $(pwd)/go.mod (Kubernetes $v): ${tools[*]} into $out"
GOFLAGS="${GOFLAGS:-} -mod=readonly" go build -trimpath -ldflags "$ld" -o "$tmp/" "${tools[@]}"
[ ! -e "$tmp/server" ] || mv "$tmp/server" "$tmp/etcd"  # the etcd module's main package is named after its folder
for b in "$tmp"/*; do mv -f "$b" "$out/$(basename "$b")"; done
echo "built in $(( $(date +%s) - start )) s"
