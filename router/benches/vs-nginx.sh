#!/usr/bin/env bash
# The router against nginx as plain reverse proxies in front of the same backend (the vLLM
# emulator with the cost model zero), side by side in one run, on loopback only.
#
#   router/benches/vs-nginx.sh [SECONDS] [CONNECTIONS]
#
# Installs nginx and wrk with apt-get when missing. For small responses (GET /v1/models) and
# for streams (POST /v1/completions, stream, 16 tokens) it reports requests per second and
# p50/p99 latency for the direct path, nginx and the router, then the proxies' added latency
# (proxied minus direct) and their ratios to nginx and to the direct path. Each proxy gets one
# worker; wrk one thread. Then, at a fixed 5,000 req/s (benches/open_loop.rs, open loop over 32
# keep-alive connections), the added p50/p99 of each proxy over the direct path.
# It asserts nothing: it prints what it measured.
set -euo pipefail
SECS=${1:-5}
CONNS=${2:-16}
cd "$(dirname "$0")/../.."
. router/benches/nginx.sh

if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light wrk >/dev/null 2>&1 ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx wrk >/dev/null
fi
cargo build --release -q -p understudy-router -p understudy-gameday --bin understudy-router --bin vllm-emulator
OPEN_LOOP=$(cargo bench -q -p understudy-router --bench open_loop --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*open_loop[^"]*\)".*/\1/p' | tail -1)

BACKEND=18000 ROUTER=18080 ADMIN=18090 NGINX=18081
T=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$T"; }
trap cleanup EXIT

wait_port() { for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

target/release/vllm-emulator serve Qwen/Qwen3-0.6B --host 127.0.0.1 --port $BACKEND --emu-instant --emu-zero-cost >"$T/emu.log" 2>&1 &
PIDS+=($!)
UNDERSTUDY_ADMIN_TOKEN=bench RUST_LOG=warn target/release/understudy-router gateway \
  --listen 127.0.0.1:$ROUTER --admin-listen 127.0.0.1:$ADMIN --workers 1 >"$T/router.log" 2>&1 &
PIDS+=($!)
write_nginx_conf "$T" "$BACKEND" "$NGINX"
nginx -c "$T/nginx.conf" -p "$T/nginx" >"$T/nginx.out" 2>&1 &
PIDS+=($!)
wait_port $BACKEND; wait_port $ROUTER; wait_port $ADMIN; wait_port $NGINX
curl -sf -X PUT -H 'authorization: Bearer bench' "http://127.0.0.1:$ADMIN/route" \
  -d "{\"pool\":\"bench\",\"epoch\":1,\"endpoints\":[\"127.0.0.1:$BACKEND\"]}" >/dev/null

cat >"$T/stream.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"Qwen/Qwen3-0.6B","prompt":"The capital of France is","max_tokens":16,"ignore_eos":true,"temperature":0,"stream":true}'
LUA
echo 'wrk.method = "GET"' >"$T/small.lua"

# Prints "rps p50_us p99_us" for one wrk run.
measure() {
  local port=$1 path=$2 script=$3
  wrk -t1 -c"$CONNS" -d"${SECS}s" --latency -s "$script" "http://127.0.0.1:$port$path" 2>&1 | awk '
    function us(v) { if (v ~ /us$/) return v+0; if (v ~ /ms$/) return v*1000; if (v ~ /s$/) return v*1000000; return v }
    /Requests\/sec/ { rps = $2 }
    $1 == "50%" { p50 = us($2) }
    $1 == "99%" { p99 = us($2) }
    / Non-2xx/ { bad = $NF }
    END { if (bad > 0) print "non-2xx:" bad > "/dev/stderr"; printf "%.0f %.1f %.1f\n", rps, p50, p99 }'
}

report() {
  local name=$1 path=$2 script=$3
  # Warm the connection pools, then measure each target in turn.
  for p in $BACKEND $NGINX $ROUTER; do wrk -t1 -c"$CONNS" -d1s -s "$script" "http://127.0.0.1:$p$path" >/dev/null 2>&1; done
  read -r d_rps d_p50 d_p99 < <(measure $BACKEND "$path" "$script")
  read -r n_rps n_p50 n_p99 < <(measure $NGINX "$path" "$script")
  read -r r_rps r_p50 r_p99 < <(measure $ROUTER "$path" "$script")
  awk -v name="$name" -v c="$CONNS" -v s="$SECS" \
      -v drps="$d_rps" -v dp50="$d_p50" -v dp99="$d_p99" \
      -v nrps="$n_rps" -v np50="$n_p50" -v np99="$n_p99" \
      -v rrps="$r_rps" -v rp50="$r_p50" -v rp99="$r_p99" 'BEGIN {
    printf "\n== %s (%d connections, %d s each) ==\n", name, c, s
    printf "%-8s %10s %10s %10s %14s %14s\n", "path", "req/s", "p50 us", "p99 us", "added p50 us", "added p99 us"
    printf "%-8s %10d %10.1f %10.1f %14s %14s\n", "direct", drps, dp50, dp99, "-", "-"
    printf "%-8s %10d %10.1f %10.1f %14.1f %14.1f\n", "nginx", nrps, np50, np99, np50-dp50, np99-dp99
    printf "%-8s %10d %10.1f %10.1f %14.1f %14.1f\n", "router", rrps, rp50, rp99, rp50-dp50, rp99-dp99
    printf "router/nginx: req/s x%.2f, p50 x%.2f, p99 x%.2f\n", rrps/nrps, rp50/np50, rp99/np99
    printf "router/direct: req/s x%.2f, p50 x%.2f, p99 x%.2f\n", rrps/drps, rp50/dp50, rp99/dp99
    printf "nginx/direct:  req/s x%.2f, p50 x%.2f, p99 x%.2f\n", nrps/drps, np50/dp50, np99/dp99
  }'
}

echo "router vs nginx on $(nproc) cores; backend: vllm-emulator --emu-zero-cost"
report "small responses: GET /v1/models" /v1/models "$T/small.lua"
report "streams: POST /v1/completions, 16 tokens, SSE" /v1/completions "$T/stream.lua"

# Fixed rate: prints "sent p50_us p99_us late" for each target.
fixed() {
  local name=$1 path=$2 body=${3:-}
  local rate=5000
  printf "\n== %s at %d req/s (open loop, 32 connections, %d s each) ==\n" "$name" $rate "$SECS"
  printf "%-8s %8s %10s %10s %14s %14s %6s\n" path sent "p50 us" "p99 us" "added p50 us" "added p99 us" late
  local d_p50 d_p99
  for p in $BACKEND $NGINX $ROUTER; do
    "$OPEN_LOOP" 127.0.0.1:$p "$path" $rate 1 32 ${body:+"$body"} >/dev/null
    read -r sent p50 p99 late < <("$OPEN_LOOP" 127.0.0.1:$p "$path" $rate "$SECS" 32 ${body:+"$body"})
    case $p in $BACKEND) n=direct; d_p50=$p50; d_p99=$p99 ;; $NGINX) n=nginx ;; *) n=router ;; esac
    awk -v n=$n -v s="$sent" -v a="$p50" -v b="$p99" -v da="$d_p50" -v db="$d_p99" -v l="$late" \
      'BEGIN { printf "%-8s %8d %10.1f %10.1f %14.1f %14.1f %6d\n", n, s, a, b, a-da, b-db, l }'
  done
}
fixed "small responses: GET /v1/models" /v1/models
fixed "streams: POST /v1/completions, 16 tokens, SSE" /v1/completions \
  '{"model":"Qwen/Qwen3-0.6B","prompt":"The capital of France is","max_tokens":16,"ignore_eos":true,"temperature":0,"stream":true}'
