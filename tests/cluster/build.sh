#!/usr/bin/env bash
# Builds the cluster tier's control plane from Go modules, once per version: etcd, and
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from k8s.io/kubernetes
# (required from the throwaway module in kube/, whose replace directives point every staging
# module at its published version), and helm from helm/ to render the chart. Everything goes
# under $UNDERSTUDY_CLUSTER_CACHE (by default ~/.cache/understudy-cluster), outside the repo; a
# second run finds the binaries and returns at once. Prints the binaries' folder on stdout.
#
# Measured on 2 cores, cold: about 6 minutes and 724 MB of modules for etcd and the control plane,
# a few more for helm; 5 GB of cache in all.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=v1.36.3 # kube/go.mod pins it; etcd/go.mod pins the etcd it ships with (v3.6.8)
HELM_VERSION=v3.22.0 # helm/go.mod pins it
cache=${UNDERSTUDY_CLUSTER_CACHE:-$HOME/.cache/understudy-cluster}
bin=$cache/$K8S_VERSION/bin
wanted=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm)

missing=()
for b in "${wanted[@]}"; do [ -x "$bin/$b" ] || missing+=("$b"); done
# helm is pinned apart from the control plane: another version is built again.
if [ -x "$bin/helm" ] && [ "$("$bin/helm" version --template '{{.Version}}')" != "$HELM_VERSION" ]; then
  missing+=(helm)
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "$bin"
  exit 0
fi
command -v go >/dev/null || { echo "build.sh: no go on the PATH, so the control plane cannot be built" >&2; exit 2; }

export GOPATH=$cache/gopath GOMODCACHE=$cache/gopath/pkg/mod GOCACHE=$cache/gocache GOFLAGS=-buildvcs=false
mkdir -p "$bin"
stamp="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
# The modules are read from the committed go.mod and go.sum; the build works on a copy, so that
# nothing is written into the repo.
work=$cache/$K8S_VERSION/src
rm -rf "$work" && mkdir -p "$work" && cp -r "$here/kube" "$here/etcd" "$here/helm" "$work/"
echo "building ${missing[*]} ($K8S_VERSION) into $bin (cold: minutes) ..." >&2
kube=()
for b in "${missing[@]}"; do
  case $b in
    kube-*|kubectl) kube+=("k8s.io/kubernetes/cmd/$b") ;;
    etcd) (cd "$work/etcd" && go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3) ;;
    helm) (cd "$work/helm" && go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
             -o "$bin/helm" helm.sh/helm/v3/cmd/helm) ;;
  esac
done
[ ${#kube[@]} -eq 0 ] || (cd "$work/kube" && go build -trimpath -ldflags "$stamp" -o "$bin/" "${kube[@]}")
echo "$bin"
