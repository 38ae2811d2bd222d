#!/usr/bin/env bash
# Starts a real control plane on 127.0.0.1, on ports it picks: etcd, kube-apiserver (RBAC on,
# generated certificates, a service-account key, a bearer token for the tests, an admin client
# certificate and the emulated kubelet's serving certificate in RUN_DIR/pki),
# kube-controller-manager and kube-scheduler. Builds them first if needed (build.sh).
#
#   tests/cluster/up.sh [RUN_DIR]     prints RUN_DIR; RUN_DIR/kubeconfig reaches the cluster
#   tests/cluster/down.sh RUN_DIR     stops what this started, by PID
#
# Services get cluster IPs on loopback, from UNDERSTUDY_SERVICE_RANGE (a /24, 127.0.200.0/24 unless
# set), so that the emulated nodes can stand in for kube-proxy (tests/src/nodes/services.rs).
#
# A cached start takes about 5 s on 2 cores.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
service_range=${UNDERSTUDY_SERVICE_RANGE:-127.0.200.0/24}
# Not 127.0.0-2.x: the API server and the pods of the emulated nodes live there.
case $service_range in
  127.0.[012].0/24) echo "up.sh: UNDERSTUDY_SERVICE_RANGE $service_range holds the API server's or the pods' addresses" >&2; exit 2 ;;
  127.*.*.0/24) ;;
  *) echo "up.sh: UNDERSTUDY_SERVICE_RANGE must be a /24 on loopback (127.x.y.0/24), not $service_range" >&2; exit 2 ;;
esac
bin=$("$here/build.sh")
run=${1:-$(mktemp -d "${TMPDIR:-/tmp}/understudy-cluster.XXXXXX")}
mkdir -p "$run/pki" "$run/etcd-data"
# A start that fails stops what it had started.
trap 'status=$?; [ "$status" -eq 0 ] || "$here/down.sh" "$run"; exit "$status"' EXIT
pki=$run/pki
# The API server's own Service, `kubernetes`, takes the range's first address.
service_ip=${service_range%.0/24}.1
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Waits until `$2` answers (curl arguments), while the process in pid file $1 lives.
await() {
  local pidfile=$1; shift
  for _ in $(seq 600); do
    if curl -sf "$@" >/dev/null 2>&1; then return 0; fi
    kill -0 "$(cat "$pidfile")" 2>/dev/null || { echo "up.sh: $(basename "$pidfile" .pid) died; its log:" >&2; tail -20 "${pidfile%.pid}.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "up.sh: $(basename "$pidfile" .pid) did not answer within 60 s" >&2; exit 1
}

(
  cd "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 7 -subj "/CN=understudy-test-ca"
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver"
  printf 'subjectAltName=IP:127.0.0.1,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\nextendedKeyUsage=serverAuth\n' "$service_ip" > server.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 7 -extfile server.ext
  openssl genrsa -out sa.key 2048
  openssl rsa -in sa.key -pubout -out sa.pub
  openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=admin"
  printf 'extendedKeyUsage=clientAuth\n' > client.ext
  openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt -days 7 -extfile client.ext
  # The emulated GPU nodes' kubelet endpoint (logs), which the API server calls on 127.0.0.1.
  openssl req -newkey rsa:2048 -nodes -keyout kubelet.key -out kubelet.csr -subj "/CN=understudy-emulated-kubelet"
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > kubelet.ext
  openssl x509 -req -in kubelet.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet.crt -days 7 -extfile kubelet.ext
) >/dev/null 2>&1
token=$(openssl rand -hex 16)
echo "$token,test-admin,test-admin,system:masters" > "$pki/token.csv"

etcd_client=$(free_port); etcd_peer=$(free_port); api_port=$(free_port)
"$bin/etcd" --name=understudy --data-dir="$run/etcd-data" \
  --listen-client-urls="http://127.0.0.1:$etcd_client" --advertise-client-urls="http://127.0.0.1:$etcd_client" \
  --listen-peer-urls="http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls="http://127.0.0.1:$etcd_peer" \
  --initial-cluster="understudy=http://127.0.0.1:$etcd_peer" --unsafe-no-fsync --log-level=warn \
  > "$run/etcd.log" 2>&1 &
echo $! > "$run/etcd.pid"
await "$run/etcd.pid" "http://127.0.0.1:$etcd_client/health"

"$bin/kube-apiserver" --etcd-servers="http://127.0.0.1:$etcd_client" \
  --bind-address=127.0.0.1 --secure-port="$api_port" --advertise-address=127.0.0.1 \
  --cert-dir="$pki" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
  --client-ca-file="$pki/ca.crt" --token-auth-file="$pki/token.csv" --authorization-mode=RBAC \
  --kubelet-certificate-authority="$pki/ca.crt" \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$pki/sa.pub" \
  --service-account-signing-key-file="$pki/sa.key" --service-cluster-ip-range="$service_range" \
  --endpoint-reconciler-type=none --allow-privileged=true \
  > "$run/kube-apiserver.log" 2>&1 &
echo $! > "$run/kube-apiserver.pid"
await "$run/kube-apiserver.pid" --cacert "$pki/ca.crt" -H "Authorization: Bearer $token" "https://127.0.0.1:$api_port/readyz"

cat > "$run/kubeconfig" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters: [{name: understudy-test, cluster: {server: "https://127.0.0.1:$api_port", certificate-authority: "$pki/ca.crt"}}]
users: [{name: test-admin, user: {token: "$token"}}]
contexts: [{name: understudy-test, context: {cluster: understudy-test, user: test-admin}}]
current-context: understudy-test
KUBECONFIG

for component in kube-controller-manager kube-scheduler; do
  port=$(free_port)
  extra=()
  [ "$component" = kube-controller-manager ] && extra=(
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" --use-service-account-credentials=true
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" --service-cluster-ip-range="$service_range")
  "$bin/$component" --kubeconfig="$run/kubeconfig" \
    --authentication-kubeconfig="$run/kubeconfig" --authorization-kubeconfig="$run/kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$port" --cert-dir="$run/$component-certs" --leader-elect=false "${extra[@]}" \
    > "$run/$component.log" 2>&1 &
  echo $! > "$run/$component.pid"
  await "$run/$component.pid" -k "https://127.0.0.1:$port/healthz"
done
echo "$run"
