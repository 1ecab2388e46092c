#!/usr/bin/env bash
# Builds the tests' control plane from the modules tests/cluster/go.mod pins (go.sum checks every byte):
# kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes) and etcd (go.etcd.io/etcd/server/v3),
# into the directory given (make cluster: .tools/bin). Go's module and build caches make a second build fast.
# Usage: tests/cluster/build.sh OUT_DIR
set -euo pipefail
out=$(realpath -m "${1:?usage: build.sh OUT_DIR}")
cd "$(dirname "$0")"
command -v go >/dev/null || PATH="$PATH:/usr/local/go/bin"  # the toolchain's default place, when PATH lacks it
command -v go >/dev/null || { echo "error: no 'go' on PATH: install the Go toolchain (go.mod names the version)" >&2; exit 2; }
v=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" {print $3}' go.mod)
minor=${v#v1.}; minor=${minor%%.*}
ld="-s -w"
# What `kube-apiserver --version` and the /version endpoint report (the release build sets the same variables).
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld="$ld -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
tmp="$out/.build.$$"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "building Kubernetes $v (kube-apiserver, kube-controller-manager, kube-scheduler) and etcd $(sed -n 's/^\tgo\.etcd\.io\/etcd\/server\/v3 \(v[^ ]*\).*/\1/p' go.mod) into $out"
GOFLAGS="${GOFLAGS:-} -mod=readonly" go build -trimpath -ldflags "$ld" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler go.etcd.io/etcd/server/v3
mv "$tmp/server" "$tmp/etcd"  # the etcd module's main package is named after its folder
for b in etcd kube-apiserver kube-controller-manager kube-scheduler; do mv -f "$tmp/$b" "$out/$b"; done
echo "built in $(( $(date +%s) - start )) s"
