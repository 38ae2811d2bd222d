#!/usr/bin/env bash
# CPU per request, counted in instructions (repeatable on a noisy machine, unlike wall clock):
# the release router and nginx, each as a plain reverse proxy with one worker in front of the
# same zero-cost vLLM emulator, run under `valgrind --tool=callgrind` while curl sends a fixed
# number of requests one after another over one keep-alive connection.
#
#   router/benches/instructions.sh [SMALL] [STREAMS]     (defaults: 2000 500)
#
# Counting starts after a warm-up (connections open, pools filled) and stops when the requests
# are done (callgrind_control -z / -d), so start-up and shut-down are not counted. Prints
# instructions per request for each proxy and the ratio router/nginx. Asserts nothing.
# KEEP=DIR keeps the profiles (DIR/{nginx,router}.{small,streams}.callgrind) for callgrind_annotate.
set -euo pipefail
SMALL=${1:-2000}
STREAMS=${2:-500}
WARM=50
cd "$(dirname "$0")/../.."
. router/benches/nginx.sh

if ! command -v valgrind >/dev/null || ! command -v nginx >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q valgrind nginx-light >/dev/null 2>&1 ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q valgrind nginx >/dev/null
fi
cargo build --release -q -p understudy-router -p understudy-emulator --bin understudy-router --bin vllm-emulator

BACKEND=18100 ROUTER=18180 ADMIN=18190 NGINX=18181
T=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$T"; }
trap cleanup EXIT
wait_port() { for _ in $(seq 600); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

target/release/vllm-emulator serve Qwen/Qwen3-0.6B --host 127.0.0.1 --port $BACKEND --emu-instant --emu-zero-cost --disable-uvicorn-access-log >"$T/emu.log" 2>&1 &
PIDS+=($!)
write_nginx_conf "$T" "$BACKEND" "$NGINX" $'master_process off;\n'
STREAM_BODY='{"model":"Qwen/Qwen3-0.6B","prompt":"The capital of France is","max_tokens":16,"ignore_eos":true,"temperature":0,"stream":true}'

# curl sends N requests one after another on one keep-alive connection.
small() { curl -sf -o /dev/null "http://127.0.0.1:$1/v1/models?n=[1-$2]"; }
streams() { curl -sf -o /dev/null -H 'content-type: application/json' -d "$STREAM_BODY" "http://127.0.0.1:$1/v1/completions?n=[1-$2]"; }

# Runs one proxy under callgrind; prints "small_ir_per_req stream_ir_per_req".
count() {
  local name=$1 port=$2
  shift 2
  valgrind --tool=callgrind --callgrind-out-file="$T/$name.%p.out" "$@" >"$T/$name.log" 2>&1 &
  local pid=$!
  PIDS+=($pid)
  wait_port "$port"
  if [ "$name" = router ]; then
    wait_port $ADMIN
    curl -sf -X PUT -H 'authorization: Bearer bench' "http://127.0.0.1:$ADMIN/route" \
      -d "{\"pool\":\"bench\",\"epoch\":1,\"endpoints\":[\"127.0.0.1:$BACKEND\"]}" >/dev/null
  fi
  local per=()
  for kind in small streams; do
    local n=$SMALL
    [ $kind = streams ] && n=$STREAMS
    $kind "$port" $WARM
    callgrind_control -z "$pid" >/dev/null 2>&1
    $kind "$port" "$n"
    callgrind_control -d "$kind" "$pid" >/dev/null 2>&1
    local f
    f=$(ls -t "$T/$name.$pid.out".* | head -1)
    [ -n "${KEEP:-}" ] && mkdir -p "$KEEP" && cp "$f" "$KEEP/$name.$kind.callgrind"
    per+=("$(awk -v n="$n" '/^summary:/ { printf "%.0f", $2 / n }' "$f")")
  done
  kill -INT "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  echo "${per[@]}"
}

wait_port $BACKEND
read -r n_small n_stream < <(count nginx $NGINX nginx -c "$T/nginx.conf" -p "$T/nginx")
read -r r_small r_stream < <(UNDERSTUDY_ADMIN_TOKEN=bench RUST_LOG=warn count router $ROUTER \
  target/release/understudy-router gateway --listen 127.0.0.1:$ROUTER --admin-listen 127.0.0.1:$ADMIN --workers 1)

awk -v ns="$n_small" -v nt="$n_stream" -v rs="$r_small" -v rt="$r_stream" -v a="$SMALL" -v b="$STREAMS" 'BEGIN {
  printf "instructions per request (callgrind, one worker, sequential keep-alive requests)\n"
  printf "%-40s %12s %12s %8s\n", "", "nginx", "router", "router/nginx"
  printf "%-40s %12d %12d %8.2f\n", "small: GET /v1/models (" a ")", ns, rs, rs / ns
  printf "%-40s %12d %12d %8.2f\n", "stream: 16-token SSE completion (" b ")", nt, rt, rt / nt
}'
