#!/usr/bin/env bash
# The cluster tier's end-to-end suite: a real control plane (up.sh), emulated GPU nodes
# (`understudy-gpu-nodes`, whose pods are vllm-emulator and router processes on 127.0.0.x, and
# real vLLM for vLLM's CPU image when the real-vLLM tier is installed), the
# CRDs applied and the chart rendered by helm (its RBAC and PriorityClass), then `cargo test -p
# understudy-tests --test cluster`, which starts the operator binary as the chart's
# ServiceAccount, and the tests elsewhere that are ignored for want of a cluster. Everything it
# started is stopped on exit, and a failing test fails the script.
#
#   tests/cluster/e2e.sh [-- CARGO_TEST_ARGS...]
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
test_args=()
[ "${1:-}" = "--" ] && { shift; test_args=("$@"); }

echo "building the operator, the prober, the emulator, the emulated nodes and kubectl-understudy ..." >&2
cargo build -q --locked -p understudy-operator --bin understudy-operator
cargo build -q --locked -p understudy-prober --bin understudy-prober
cargo build -q --locked -p understudy-emulator --bin vllm-emulator
cargo build -q --locked -p understudy-tests --bins
cargo build -q --locked -p understudy-cli --bin kubectl-understudy
target=$(cargo metadata -q --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug

# vLLM's CPU image runs as real vLLM when the tier is installed (tests/vllm/install.sh; .ci/run
# installs it before this tier); without it, the real-vLLM test says SKIPPED.
real_vllm=()
if tests/vllm/install.sh --installed >/dev/null; then
  real_vllm=(--vllm-cpu "$root/tests/vllm/serve.sh")
  export UNDERSTUDY_CLUSTER_REAL_VLLM=1
else
  echo "SKIPPED (in part): the real-vLLM tier is not installed here, so no pod runs real vLLM" >&2
fi

# Traefik, the Gateway API implementation that serves a policy's HTTPRoute (built before any
# cluster is up: cold, it takes minutes).
traefik=$("$root/tests/cluster/traefik.sh")

. "$root/tests/cluster/nodes.sh"
cluster_up
nodes_up --nodes 4 --gpus-per-node 2 \
  --vllm "$target/vllm-emulator" --router "$target/understudy-router-e2e" \
  --operator "$target/understudy-operator" --prober "$target/understudy-prober" "${real_vllm[@]}"

# (kube-apiserver warns of the integer formats schemars writes, which it does not check.)
k apply -f "$root/crds/" >/dev/null 2> >(grep -v '^Warning: unrecognized format' >&2)
# The Gateway API's CRDs and InferencePool's, from the modules tests/cluster/gateway pins: the
# HTTPRoute a policy's `spec.route` moves.
gateway_crds=$("$root/tests/cluster/gateway-crds.sh")
for crds in $gateway_crds; do k apply -f "$crds" >/dev/null; done
k wait --for=condition=Established crd --all --timeout=60s >/dev/null
# The chart, rendered by helm as release "understudy" in understudy-system: its RBAC, so that the
# operator runs with exactly the rights the chart gives it (and the fences with the ClusterRole it
# gives them), and the PriorityClass of the GPU reserve's placeholders. (Its workloads are
# installed at the end: until then the tests start the operator binary themselves.)
"$bin/helm" lint --quiet charts/understudy >/dev/null
k create namespace understudy-system >/dev/null
"$bin/helm" template understudy charts/understudy --namespace understudy-system \
    --set routeTargets.httpRoute=true --set routeTargets.service=true \
    --show-only templates/rbac.yaml --show-only templates/priorityclass.yaml \
  | k apply -n understudy-system -f - >/dev/null
token=$(k -n understudy-system create token understudy-operator --duration 2h)
server=$(sed -n 's/.*server: "\([^"]*\)".*/\1/p' "$run/kubeconfig")
cat > "$run/operator.kubeconfig" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters: [{name: understudy-test, cluster: {server: "$server", certificate-authority: "$run/pki/ca.crt"}}]
users: [{name: understudy-operator, user: {token: "$token"}}]
contexts: [{name: operator, context: {cluster: understudy-test, user: understudy-operator}}]
current-context: operator
KUBECONFIG

UNDERSTUDY_CLUSTER_KUBECONFIG="$run/kubeconfig" \
UNDERSTUDY_CLUSTER_OPERATOR_KUBECONFIG="$run/operator.kubeconfig" \
UNDERSTUDY_CLUSTER_OPERATOR="$target/understudy-operator" \
UNDERSTUDY_CLUSTER_TRAEFIK="$traefik" \
UNDERSTUDY_CLUSTER_CLI="$target/kubectl-understudy" \
  cargo test --locked -p understudy-tests --test cluster -- --test-threads=1 "${test_args[@]}"

# The tests elsewhere that are ignored for want of a cluster run here, as the admin, in the
# default namespace: the operator's controllers in-process against the real server, and the
# prober's cold-start reader on a pod that really started.
KUBECONFIG="$run/kubeconfig" \
  cargo test -q --locked -p understudy-operator --test controller_cluster --test gameday_mock -- --ignored --test-threads=1
k create namespace e2e-coldstart >/dev/null
k -n e2e-coldstart create deployment coldstart --image vllm/vllm-openai:v0.32.0 --port 8000 \
  -- vllm serve Qwen/Qwen3-0.6B --port 8000 >/dev/null
k -n e2e-coldstart wait --for=condition=Available deployment/coldstart --timeout=90s >/dev/null
# Without a readiness probe the pod is Ready when its process starts; the reader wants vLLM's
# whole start-up in the log.
for _ in $(seq 360); do
  k -n e2e-coldstart logs deployment/coldstart 2>/dev/null | grep -q 'Application startup complete' && break
  sleep 0.25
done
KUBECONFIG="$run/kubeconfig" UNDERSTUDY_COLDSTART_NAMESPACE=e2e-coldstart \
UNDERSTUDY_COLDSTART_POD=$(k -n e2e-coldstart get pod -l app=coldstart -o jsonpath='{.items[0].metadata.name}') \
  cargo test -q --locked -p understudy-prober --test coldstart_api -- --ignored --nocapture

# The whole chart, as a user installs it, over what the tests left: the operator (two replicas,
# one leading), the routers and the GPU agents run as pods of the emulated nodes, each image by
# its binary; examples/pools/chat.yaml brings two pools of vLLM behind fences and the policy.
echo "installing the chart and examples/pools/chat.yaml ..." >&2
k apply -f - >/dev/null <<'YAML'
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: nvidia}
handler: nvidia
YAML
fence_token=$(sed -n 's/^  token: //p' examples/pools/chat.yaml)
k -n understudy-system create secret generic understudy-fence-token --from-literal=token="$fence_token" >/dev/null
"$bin/helm" template understudy charts/understudy --namespace understudy-system \
    --set image.tag=test --set operator.watchNamespace=serving \
    --set operator.replicaTokenSecret=understudy-fence-token \
  | k apply -n understudy-system -f - >/dev/null
k apply -f examples/pools/chat.yaml >/dev/null
k -n understudy-system rollout status deployment/understudy-operator --timeout=120s
k -n understudy-system rollout status daemonset/understudy-gpu-agent --timeout=120s
k -n serving rollout status deployment/chat-east --timeout=120s
k -n serving wait fpol/chat --for=jsonpath='{.status.conditions.Ready.status}'=True --timeout=120s
# A router is Ready once the operator found it by its label and pushed it the route.
k -n understudy-system rollout status deployment/understudy-router --timeout=120s
router=$(k -n understudy-system get pod -l app.kubernetes.io/component=router -o jsonpath='{.items[0].status.podIP}')
east=$(k -n serving get pod -l pool=east -o jsonpath='{.items[0].metadata.name}')
answer=$(curl -sS --max-time 10 "http://$router:8080/v1/completions" -H 'content-type: application/json' \
  -d '{"model": "Qwen/Qwen3-0.6B", "prompt": "The capital of France is", "max_tokens": 4}')
echo "a completion through router $router, then east's fence ($east): $answer" >&2
python3 -c 'import json,sys; a=json.loads(sys.argv[1]); assert a["choices"][0]["text"], a' "$answer"
k -n serving get fpol chat
