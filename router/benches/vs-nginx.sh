#!/usr/bin/env bash
# The router against nginx as plain reverse proxies in front of the same backend (the vLLM
# emulator with the cost model zero), side by side in one run, on loopback only.
#
#   [ROUNDS=3] router/benches/vs-nginx.sh [SECONDS] [CONNECTIONS]
#
# Installs nginx and wrk with apt-get when missing. For small responses (GET /v1/models) and
# for streams (POST /v1/completions, stream, 16 tokens) it reports requests per second and
# p50/p99 latency for the direct path, nginx and the router, then the proxies' added latency
# (proxied minus direct) and their ratios to nginx and to the direct path. Each proxy gets one
# worker; wrk one thread. Then, at 5,000 req/s on average (benches/open_loop.rs: Poisson
# arrivals, open loop over 32 keep-alive connections), the added p50/p99 of each proxy over the
# direct path. Every measurement runs ROUNDS times, the three targets taking turns, and the
# median of each column is reported.
# It asserts nothing: it prints what it measured.
set -euo pipefail
SECS=${1:-5}
CONNS=${2:-16}
ROUNDS=${ROUNDS:-3}
cd "$(dirname "$0")/../.."
. router/benches/nginx.sh

if ! command -v nginx >/dev/null || ! command -v wrk >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx-light wrk >/dev/null 2>&1 ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx wrk >/dev/null
fi
cargo build --release -q -p understudy-router -p understudy-emulator --bin understudy-router --bin vllm-emulator
OPEN_LOOP=$(cargo bench -q -p understudy-router --bench open_loop --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*open_loop[^"]*\)".*/\1/p' | tail -1)

BACKEND=18000 ROUTER=18080 ADMIN=18090 NGINX=18081
T=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$T"; }
trap cleanup EXIT

wait_port() { for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

target/release/vllm-emulator serve Qwen/Qwen3-0.6B --host 127.0.0.1 --port $BACKEND --emu-instant --emu-zero-cost --disable-uvicorn-access-log >"$T/emu.log" 2>&1 &
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

# The median of the numbers on stdin.
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# Runs `$1 TARGET` for each target, ROUNDS times, the order turning each round (direct, nginx,
# router; nginx, router, direct; ...), so that a slow moment of this shared machine falls on all
# three alike; prints for each target the median of each column, as "direct|nginx|router a b c".
rounds() {
  local run=$1 out="$T/rounds" i k line
  local targets=($BACKEND $NGINX $ROUTER)
  : >"$out"
  for i in $(seq 0 $((ROUNDS - 1))); do
    for k in 0 1 2; do
      local p=${targets[$(((i + k) % 3))]}
      line=$($run "$p") || { echo "measuring 127.0.0.1:$p failed" >&2; exit 1; }
      echo "$p $line" >>"$out"
    done
  done
  for p in $BACKEND $NGINX $ROUTER; do
    local cols=()
    for c in 2 3 4 5; do cols+=("$(awk -v p="$p" -v c="$c" '$1 == p && NF >= c { print $c }' "$out" | median)"); done
    case $p in $BACKEND) echo "direct ${cols[*]}" ;; $NGINX) echo "nginx ${cols[*]}" ;; *) echo "router ${cols[*]}" ;; esac
  done
}

report() {
  local name=$1 path=$2 script=$3
  # Each measurement follows a second of warm-up on its own target (connection pools filled).
  wrk_one() {
    wrk -t1 -c"$CONNS" -d1s -s "$script" "http://127.0.0.1:$1$path" >/dev/null 2>&1
    measure "$1" "$path" "$script"
  }
  rounds wrk_one | awk -v name="$name" -v c="$CONNS" -v s="$SECS" -v r="$ROUNDS" '
    { rps[$1] = $2; p50[$1] = $3; p99[$1] = $4 }
    END {
      printf "\n== %s (%d connections, %d s each, median of %d rounds) ==\n", name, c, s, r
      printf "%-8s %10s %10s %10s %14s %14s\n", "path", "req/s", "p50 us", "p99 us", "added p50 us", "added p99 us"
      printf "%-8s %10d %10.1f %10.1f %14s %14s\n", "direct", rps["direct"], p50["direct"], p99["direct"], "-", "-"
      for (i = 0; i < 2; i++) {
        n = i ? "router" : "nginx"
        printf "%-8s %10d %10.1f %10.1f %14.1f %14.1f\n", n, rps[n], p50[n], p99[n], p50[n] - p50["direct"], p99[n] - p99["direct"]
      }
      printf "router/nginx: req/s x%.2f, p50 x%.2f, p99 x%.2f\n", rps["router"] / rps["nginx"], p50["router"] / p50["nginx"], p99["router"] / p99["nginx"]
      printf "router/direct: req/s x%.2f, p50 x%.2f, p99 x%.2f\n", rps["router"] / rps["direct"], p50["router"] / p50["direct"], p99["router"] / p99["direct"]
      printf "nginx/direct:  req/s x%.2f, p50 x%.2f, p99 x%.2f\n", rps["nginx"] / rps["direct"], p50["nginx"] / p50["direct"], p99["nginx"] / p99["direct"]
    }'
}

echo "router vs nginx on $(nproc) cores; backend: vllm-emulator --emu-zero-cost"
report "small responses: GET /v1/models" /v1/models "$T/small.lua"
report "streams: POST /v1/completions, 16 tokens, SSE" /v1/completions "$T/stream.lua"

# Fixed rate: for each target, the median over the rounds of "answered p50_us p99_us late".
fixed() {
  local name=$1 path=$2 body=${3:-}
  local rate=5000
  open_loop_one() {
    "$OPEN_LOOP" 127.0.0.1:$1 "$path" $rate 1 32 ${body:+"$body"} >/dev/null
    "$OPEN_LOOP" 127.0.0.1:$1 "$path" $rate "$SECS" 32 ${body:+"$body"}
  }
  rounds open_loop_one | awk -v name="$name" -v rate=$rate -v s="$SECS" -v r="$ROUNDS" '
    { answered[$1] = $2; p50[$1] = $3; p99[$1] = $4; late[$1] = $5 }
    END {
      printf "\n== %s at %d req/s (Poisson arrivals, open loop, 32 connections, %d s each, median of %d rounds) ==\n", name, rate, s, r
      printf "%-8s %9s %10s %10s %14s %14s %6s\n", "path", "answered", "p50 us", "p99 us", "added p50 us", "added p99 us", "late"
      split("direct nginx router", order, " ")
      for (i = 1; i <= 3; i++) {
        n = order[i]
        printf "%-8s %9d %10.1f %10.1f %14.1f %14.1f %6d\n", n, answered[n], p50[n], p99[n], p50[n] - p50["direct"], p99[n] - p99["direct"], late[n]
      }
    }'
}
fixed "small responses: GET /v1/models" /v1/models
fixed "streams: POST /v1/completions, 16 tokens, SSE" /v1/completions \
  '{"model":"Qwen/Qwen3-0.6B","prompt":"The capital of France is","max_tokens":16,"ignore_eos":true,"temperature":0,"stream":true}'
