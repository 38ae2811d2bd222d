# Sourced by e2e.sh and scale.sh, with `root` and `target` set: a control plane brought up
# (up.sh) with emulated GPU nodes on it, and everything stopped on exit.
#
#   cluster_up                 starts the control plane; sets `run`, `bin` and `k` (kubectl)
#   nodes_up NODE_ARGS...      starts understudy-gpu-nodes with NODE_ARGS besides the cluster's
#                              own, and waits until every node is Ready

cluster_up() {
  run=$("$root/tests/cluster/up.sh")
  nodes_pid=
  trap cluster_down EXIT
  bin=$("$root/tests/cluster/build.sh")
}

k() { "$bin/kubectl" --kubeconfig "$run/kubeconfig" "$@"; }

cluster_down() {
  status=$?
  set +e # whatever fails here, the rest is still stopped
  [ -n "$nodes_pid" ] && kill "$nodes_pid" 2>/dev/null && wait "$nodes_pid" 2>/dev/null
  # The emulated pods' processes die with their kubelet (kill on drop); any left are ours.
  if [ "$status" -ne 0 ] && [ -f "$run/nodes.log" ]; then
    echo "--- the emulated nodes' log (last 30 lines)" >&2; tail -30 "$run/nodes.log" >&2
  fi
  "$root/tests/cluster/down.sh" "$run"
  exit "$status"
}

nodes_up() {
  "$target/understudy-gpu-nodes" --kubeconfig "$run/kubeconfig" "$@" \
    --work-dir "$run/nodes" --tls-cert "$run/pki/kubelet.crt" --tls-key "$run/pki/kubelet.key" \
    > "$run/nodes.out" 2> "$run/nodes.log" &
  nodes_pid=$!
  for _ in $(seq 300); do
    grep -q '^kubelet listening on' "$run/nodes.out" 2>/dev/null && break
    kill -0 "$nodes_pid" 2>/dev/null || { echo "the emulated nodes died:" >&2; cat "$run/nodes.log" >&2; exit 1; }
    sleep 0.1
  done
  k wait --for=condition=Ready node --all --timeout=60s >/dev/null
}
