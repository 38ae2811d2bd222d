#!/usr/bin/env bash
# The soak: ten minutes (by default) of mixed streaming and non-streaming load through two gateway
# processes in front of three emulated replicas, on loopback only, with a fault every 30 s taken
# in turn: a replica killed (and started again), a replica stopped (SIGSTOP, then SIGCONT), a
# gateway restarted by SIGTERM (its drain, then a new process on the same ports). Exits non-zero
# unless no request failed before a replica took it and no cut answer looked finished.
#
#   tests/soak/run.sh [DURATION] [FAULT_EVERY] [RATE]      e.g. tests/soak/run.sh 10m 30s 20
#
# The report is printed and written as JSON to target/soak/report.json.
set -euo pipefail
cd "$(dirname "$0")/../.."

duration=${1:-10m}
fault_every=${2:-30s}
rate=${3:-20}

cargo build -q --release --locked -p understudy-gameday --bin understudy-gameday
mkdir -p target/soak
exec target/release/understudy-gameday soak --duration "$duration" --fault-every "$fault_every" \
  --rate "$rate" --json target/soak/report.json
