#!/usr/bin/env bash
# Benchmark of the vLLM emulator's own overhead, side by side in one run:
#   1. one replica pinned to one core (taskset), cost model zero: requests/s and latency, against
#      the latency the default cost model emulates for the same request (the ratio is the share
#      of an emulated request that is the emulator itself);
#   2. per streamed token: 64-token streams against 1-token streams;
#   3. how many replicas fit on this machine: N replicas with the default cost model, each under
#      one closed-loop client, mean latency against a lone replica's (1.00 = no interference).
# It reports; it asserts nothing. Usage: emulator/benches/emulator.sh [SECONDS] [REPLICA COUNTS...]
set -euo pipefail
cd "$(dirname "$0")/../.."

SECONDS_PER_RUN=${1:-5}
shift || true
REPLICA_COUNTS=("${@:-10 25 50}")
read -r -a REPLICA_COUNTS <<<"${REPLICA_COUNTS[*]}"

if ! command -v taskset >/dev/null || ! command -v python3 >/dev/null; then
  echo "installing util-linux (taskset) and python3" >&2
  SUDO=$(command -v sudo || true)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq util-linux python3 >/dev/null
fi

cargo build -q --release -p understudy-emulator --bin vllm-emulator --bin emulator-load
EMU=target/release/vllm-emulator
LOAD=target/release/emulator-load
CORES=$(nproc)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start PORT PIN [emulator args...]: starts a replica (PIN: "taskset -c N" or "") and waits until it listens.
start() {
  local port=$1 pin=$2; shift 2
  $pin "$EMU" serve Qwen/Qwen3-0.6B --host 127.0.0.1 --port "$port" --emu-instant --disable-uvicorn-access-log "$@" >/dev/null &
  PIDS+=($!)
  for _ in $(seq 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "replica on $port did not start" >&2; exit 1
}
field() { python3 -c "import json,sys; print(round(json.loads(sys.argv[1])['$2'], 3))" "$1"; }
stop_all() { cleanup; wait 2>/dev/null || true; PIDS=(); }

echo "# vllm-emulator overhead ($(uname -m), $CORES cores, ${SECONDS_PER_RUN}s per run)"
echo
echo "## 1. one replica on one core, cost model zero vs the default cost model"
P0=$(free_port); start "$P0" "taskset -c 0" --emu-zero-cost
P1=$(free_port); start "$P1" "taskset -c 0"
LOADCORE=$(( CORES > 1 ? 1 : 0 ))
zero1=$(taskset -c $LOADCORE $LOAD --ports "$P0" --per-port 1 --seconds "$SECONDS_PER_RUN")
zero32=$(taskset -c $LOADCORE $LOAD --ports "$P0" --per-port 32 --seconds "$SECONDS_PER_RUN")
costed=$(taskset -c $LOADCORE $LOAD --ports "$P1" --per-port 1 --seconds "$SECONDS_PER_RUN")
printf '%-44s %10s %10s %10s\n' "run (16-token completion)" "req/s" "mean ms" "p99 ms"
printf '%-44s %10s %10s %10s\n' "zero cost, 1 client" "$(field "$zero1" rps)" "$(field "$zero1" mean_ms)" "$(field "$zero1" p99_ms)"
printf '%-44s %10s %10s %10s\n' "zero cost, 32 clients" "$(field "$zero32" rps)" "$(field "$zero32" mean_ms)" "$(field "$zero32" p99_ms)"
printf '%-44s %10s %10s %10s\n' "default cost model, 1 client" "$(field "$costed" rps)" "$(field "$costed" mean_ms)" "$(field "$costed" p99_ms)"
python3 - "$zero1" "$costed" <<'PY'
import json, sys
z, c = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"added latency per request: {z['mean_ms']:.3f} ms = {z['mean_ms'] / c['mean_ms']:.2%} of the {c['mean_ms']:.1f} ms it emulates")
PY
echo
echo "## 2. per streamed token (zero cost, one client)"
s1=$(taskset -c $LOADCORE $LOAD --ports "$P0" --per-port 1 --seconds "$SECONDS_PER_RUN" --stream --max-tokens 1)
s64=$(taskset -c $LOADCORE $LOAD --ports "$P0" --per-port 1 --seconds "$SECONDS_PER_RUN" --stream --max-tokens 64)
python3 - "$s1" "$s64" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
per_token = (b['mean_ms'] - a['mean_ms']) / 63
print(f"1-token stream {a['mean_ms']:.3f} ms, 64-token stream {b['mean_ms']:.3f} ms")
print(f"overhead per streamed token: {per_token * 1000:.1f} us = {per_token / 8.0:.2%} of the default 8 ms inter-token latency")
PY
stop_all

echo
echo "## 3. replicas on this machine, default cost model, one closed-loop client each"
printf '%-10s %10s %10s %10s %12s %14s\n' replicas "req/s" "mean ms" "p99 ms" "vs alone" "RSS MiB each"
alone=""
for n in 1 "${REPLICA_COUNTS[@]}"; do
  ports=()
  for _ in $(seq "$n"); do p=$(free_port); start "$p" ""; ports+=("$p"); done
  joined=$(IFS=,; echo "${ports[*]}")
  r=$($LOAD --ports "$joined" --per-port 1 --seconds "$SECONDS_PER_RUN")
  rss=$(for p in "${PIDS[@]}"; do awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null; done | awk '{s+=$1; n++} END {printf "%.1f", s/n/1024}')
  mean=$(field "$r" mean_ms)
  [ -z "$alone" ] && alone=$mean
  ratio=$(python3 -c "print(f'{$mean / $alone:.2f}x')")
  printf '%-10s %10s %10s %10s %12s %14s\n' "$n" "$(field "$r" rps)" "$mean" "$(field "$r" p99_ms)" "$ratio" "$rss"
  stop_all
done
