#!/usr/bin/env bash
# Traefik, a Gateway API implementation that runs on these machines: built once from the module
# gateway/go.mod pins (verified against gateway/go.sum), in its own module with its own go.mod
# and go.sum, under the cluster tier's cache; a second run finds the binary. Prints its path.
# The cluster tier fails over through it: it programs routes from HTTPRoutes, to each backend
# Service's cluster IP (nativeLB), which the emulated nodes forward to the Service's pods.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${UNDERSTUDY_CLUSTER_CACHE:-$HOME/.cache/understudy-cluster}
version=$(sed -n 's/^\tgithub.com\/traefik\/traefik\/v3 \(v[^ ]*\)$/\1/p' "$here/gateway/go.mod")
[ -n "$version" ] || { echo "traefik.sh: gateway/go.mod pins no Traefik" >&2; exit 2; }
binary=$cache/traefik-$version/traefik
if [ -x "$binary" ]; then
  echo "$binary"
  exit 0
fi
command -v go >/dev/null || { echo "traefik.sh: no go on the PATH, so Traefik cannot be built" >&2; exit 2; }
export GOPATH=$cache/gopath GOMODCACHE=$cache/gopath/pkg/mod GOCACHE=$cache/gocache GOFLAGS=-buildvcs=false
# `go mod download -json` says what went wrong in its JSON, on stdout.
out=$(cd "$here/gateway" && GOFLAGS=-mod=readonly go mod download -json github.com/traefik/traefik/v3 || true)
module=$(sed -n 's/^\t"Dir": "\(.*\)",$/\1/p' <<<"$out")
[ -n "$module" ] || { echo "traefik.sh: Traefik $version could not be downloaded: $out" >&2; exit 1; }
# The module cache is read-only: the build works on a copy.
work=$cache/traefik-$version/src
rm -rf "$work" && mkdir -p "$(dirname "$work")" && cp -r "$module" "$work" && chmod -R u+w "$work"
echo "building Traefik $version into $binary (cold: many minutes) ..." >&2
(cd "$work" && go build -trimpath -ldflags "-s -w -X github.com/traefik/traefik/v3/pkg/version.Version=$version" \
  -o "$binary" ./cmd/traefik)
rm -rf "$work"
echo "$binary"
