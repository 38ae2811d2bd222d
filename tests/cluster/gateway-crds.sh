#!/usr/bin/env bash
# The Gateway API's standard CRDs (HTTPRoute and the rest) and the Inference Extension's
# InferencePool CRD, at the versions gateway/go.mod pins, verified against gateway/go.sum: the
# modules are downloaded into the cluster tier's cache (a second run finds them) and the folders
# holding their CRDs are printed, one a line. Nothing is built.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${UNDERSTUDY_CLUSTER_CACHE:-$HOME/.cache/understudy-cluster}
export GOPATH=$cache/gopath GOMODCACHE=$cache/gopath/pkg/mod GOFLAGS=-mod=readonly
command -v go >/dev/null || { echo "gateway-crds.sh: no go on the PATH" >&2; exit 2; }
cd "$here/gateway"
# `go mod download -json` says what went wrong in its JSON, on stdout.
dir() {
  local out found
  out=$(go mod download -json "$1" || true)
  found=$(sed -n 's/^\t"Dir": "\(.*\)",$/\1/p' <<<"$out")
  [ -n "$found" ] || { echo "gateway-crds.sh: $1 could not be downloaded: $out" >&2; exit 1; }
  echo "$found"
}
gateway=$(dir sigs.k8s.io/gateway-api)
inference=$(dir sigs.k8s.io/gateway-api-inference-extension)
echo "$gateway/config/crd/standard"
echo "$inference/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
