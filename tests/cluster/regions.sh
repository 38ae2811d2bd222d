#!/usr/bin/env bash
# The cluster tier's regional suite: three real control planes on loopback. The management
# cluster holds the CRDs, the policies, their epoch Leases and (run by the tests) the operator.
# Two regions, east and west, each have emulated GPU nodes whose pods take addresses of a range of
# their own (127.0.1.x, 127.0.2.x), and the chart installed as a region takes it:
# `operator.enabled=false`, so its routers and the operator's ServiceAccount and ClusterRole, no
# operator. The operator reaches each region with a token of that ServiceAccount, in a kubeconfig
# the tests put in a Secret of the management cluster. Then `cargo test -p understudy-tests --test
# regions`; everything started is stopped on exit, and a failing test fails the script.
#
#   tests/cluster/regions.sh [-- CARGO_TEST_ARGS...]
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
test_args=()
[ "${1:-}" = "--" ] && { shift; test_args=("$@"); }

echo "building the operator, the emulator, the emulated nodes, the router and kubectl-understudy ..." >&2
cargo build -q --locked -p understudy-operator --bin understudy-operator
cargo build -q --locked -p understudy-emulator --bin vllm-emulator
cargo build -q --locked -p understudy-tests --bins
cargo build -q --locked -p understudy-cli --bin kubectl-understudy
# The cut library, with which a test cuts the operator off from a region's addresses.
cargo build -q --locked -p understudy-cut
target=$(cargo metadata -q --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug
bin=$("$root/tests/cluster/build.sh")

runs=()
nodes_pids=()
stop_all() {
  status=$?
  set +e # whatever fails here, the rest is still stopped
  for pid in "${nodes_pids[@]}"; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; done
  if [ "$status" -ne 0 ]; then
    for run in "${runs[@]}"; do
      [ -f "$run/nodes.log" ] && { echo "--- $run/nodes.log (last 20 lines)" >&2; tail -20 "$run/nodes.log" >&2; }
    done
  fi
  for run in "${runs[@]}"; do "$root/tests/cluster/down.sh" "$run"; done
  exit "$status"
}
trap stop_all EXIT

router_token=$(openssl rand -hex 16)

# A control plane, whose run directory is the variable named $1 (set here, not in a subshell, so
# that the exit trap knows it), with its Services' cluster IPs in $2 (each cluster its own, since
# its nodes bind them).
control_plane() {
  local dir
  dir=$(mktemp -d "${TMPDIR:-/tmp}/understudy-cluster.XXXXXX")
  runs+=("$dir")
  UNDERSTUDY_SERVICE_RANGE=$2 "$root/tests/cluster/up.sh" "$dir" >/dev/null
  printf -v "$1" '%s' "$dir"
}

# The chart's RBAC (and, with `region`, its routers) in understudy-system of the cluster at
# $1/kubeconfig, and a kubeconfig for the operator's ServiceAccount there at $1/operator.kubeconfig,
# with its certificate authority inline, as a Secret carries it.
install_chart() {
  local run=$1 region=${2:-}
  local k=("$bin/kubectl" --kubeconfig "$run/kubeconfig")
  "${k[@]}" create namespace understudy-system >/dev/null
  if [ -n "$region" ]; then
    "${k[@]}" -n understudy-system create secret generic understudy-router-token --from-literal=token="$router_token" >/dev/null
    "$bin/helm" template understudy charts/understudy --namespace understudy-system \
        --set image.tag=test --set operator.enabled=false --set agent.enabled=false \
        --set router.replicas=1 --set router.tokenSecret=understudy-router-token \
      | "${k[@]}" apply -n understudy-system -f - >/dev/null
  else
    "$bin/helm" template understudy charts/understudy --namespace understudy-system \
        --show-only templates/rbac.yaml \
      | "${k[@]}" apply -n understudy-system -f - >/dev/null
  fi
  local token server ca
  token=$("${k[@]}" -n understudy-system create token understudy-operator --duration 2h)
  server=$(sed -n 's/.*server: "\([^"]*\)".*/\1/p' "$run/kubeconfig")
  ca=$(base64 -w0 "$run/pki/ca.crt")
  cat > "$run/operator.kubeconfig" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters: [{name: cluster, cluster: {server: "$server", certificate-authority-data: "$ca"}}]
users: [{name: understudy-operator, user: {token: "$token"}}]
contexts: [{name: operator, context: {cluster: cluster, user: understudy-operator}}]
current-context: operator
KUBECONFIG
}

# Emulated GPU nodes for the region at run directory $1, named $2-node-N, pods from address $3.
region_nodes() {
  local run=$1 name=$2 first_ip=$3
  "$target/understudy-gpu-nodes" --kubeconfig "$run/kubeconfig" --nodes 2 --gpus-per-node 4 \
    --node-prefix "$name-node" --first-pod-ip "$first_ip" \
    --vllm "$target/vllm-emulator" --router "$target/understudy-router-e2e" \
    --work-dir "$run/nodes" --tls-cert "$run/pki/kubelet.crt" --tls-key "$run/pki/kubelet.key" \
    > "$run/nodes.out" 2> "$run/nodes.log" &
  nodes_pids+=($!)
  echo $! > "$run/nodes.pid"
  for _ in $(seq 300); do
    grep -q '^kubelet listening on' "$run/nodes.out" 2>/dev/null && break
    sleep 0.1
  done
  "$bin/kubectl" --kubeconfig "$run/kubeconfig" wait --for=condition=Ready node --all --timeout=60s >/dev/null
}

echo "starting the management cluster and regions east and west ..." >&2
control_plane management 127.0.210.0/24
control_plane east 127.0.211.0/24
control_plane west 127.0.212.0/24
"$bin/kubectl" --kubeconfig "$management/kubeconfig" apply -f "$root/crds/" >/dev/null 2> >(grep -v '^Warning: unrecognized format' >&2)
"$bin/kubectl" --kubeconfig "$management/kubeconfig" wait --for=condition=Established crd --all --timeout=60s >/dev/null
"$bin/helm" lint --quiet charts/understudy --set operator.enabled=false >/dev/null
install_chart "$management"
region_nodes "$east" east 127.0.1.10
region_nodes "$west" west 127.0.2.10
install_chart "$east" region
install_chart "$west" region

UNDERSTUDY_REGIONS_MANAGEMENT="$management" \
UNDERSTUDY_REGIONS_EAST="$east" \
UNDERSTUDY_REGIONS_WEST="$west" \
UNDERSTUDY_REGIONS_ROUTER_TOKEN="$router_token" \
UNDERSTUDY_REGIONS_CUT_LIBRARY="$target/libunderstudy_cut.so" \
UNDERSTUDY_CLUSTER_OPERATOR="$target/understudy-operator" \
UNDERSTUDY_CLUSTER_CLI="$target/kubectl-understudy" \
  timeout 20m cargo test --locked -p understudy-tests --test regions -- --test-threads=1 "${test_args[@]}"
