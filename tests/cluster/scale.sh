#!/usr/bin/env bash
# The operator at scale (tests/benches/operator_scale.rs): a real control plane (up.sh), emulated
# nodes with room for 1,320 pods whose containers are release-built `vllm-emulator` processes,
# the CRDs, then the release-built operator and router against one setup after another, side by
# side in one report. It reports; it asserts nothing; everything it started is stopped on exit.
#
#   tests/cluster/scale.sh [--intervals N] [POLICIESxREPLICAS...]   (default: 1x200 50x4)
#
# A setup of P policies with pools of R replicas runs 2·P·R emulator processes of about 4 MiB
# each; a killed one is not restarted (the kubelet's back-off is set to an hour).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
echo "building the operator, the router, the emulator and the emulated nodes (release) ..." >&2
cargo build -q --locked --release -p understudy-operator --bin understudy-operator \
  -p understudy-emulator --bin vllm-emulator \
  -p understudy-tests --bin understudy-gpu-nodes --bin understudy-router-e2e
cargo bench -q --locked -p understudy-tests --bench operator_scale --no-run
target=$(cargo metadata -q --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release

. "$root/tests/cluster/nodes.sh"
cluster_up
# 110 pods a node, as a kubelet's default.
nodes_up --nodes 12 --gpus-per-node 0 \
  --vllm "$target/vllm-emulator" --pull-ms 0 --restart-backoff-ms 3600000
k apply -f "$root/crds/" >/dev/null 2> >(grep -v '^Warning: unrecognized format' >&2)
k wait --for=condition=Established crd --all --timeout=60s >/dev/null

UNDERSTUDY_CLUSTER_KUBECONFIG="$run/kubeconfig" \
UNDERSTUDY_SCALE_OPERATOR="$target/understudy-operator" \
UNDERSTUDY_SCALE_ROUTER="$target/understudy-router-e2e" \
  cargo bench -q --locked -p understudy-tests --bench operator_scale -- "$@"
