#!/usr/bin/env bash
# The real-vLLM tier: installs vLLM's CPU build and the tiny model once (install.sh, cached
# outside the repo), then runs the conformance suite against a real server and the emulator
# (gameday/tests/vllm_conformance.rs, its real half ignored by a plain `cargo test`), and two
# local game days on real servers: the hung engine beside its /health-checked baseline, and the
# crashed primary.
#
# When the tier cannot be installed here (no Python 3.11+, or a registry without a pinned
# package), it says SKIPPED with the reason and exits 0: nothing was checked against real vLLM.
# Measured on 2 cores: the install about 2 minutes cold; the suite about 1.5 minutes; the game
# days about 4 and 1.5 (six server starts of about half a minute to a minute each, two at a time). Each server holds about
# 4 GB of memory; at most two run at once.
set -euo pipefail
cd "$(dirname "$0")/../.."

status=0
tests/vllm/install.sh >/dev/null || status=$?
if [ "$status" -eq 2 ]; then
  echo "SKIPPED: the real-vLLM tier (see the line above); nothing was checked against real vLLM" >&2
  exit 0
fi
[ "$status" -eq 0 ] || exit "$status"

echo "conformance: the same checks against real vLLM and the emulator" >&2
cargo test -q --locked -p understudy-gameday --test vllm_conformance -- --include-ignored --nocapture --test-threads 1

report_dir=$(mktemp -d)
trap 'rm -rf "$report_dir"' EXIT
for scenario in vllm-hung-engine vllm-crash; do
  echo "the $scenario game day on real vLLM servers" >&2
  # Exit 3 is an inconclusive run on a loaded machine (its report says how late its timers
  # fired): run once more, and fail on a second.
  for attempt in 1 2; do
    status=0
    cargo run -q --locked -p understudy-gameday -- run "examples/gamedays/local/$scenario.yaml" --out "$report_dir" || status=$?
    [ "$status" -eq 3 ] && [ "$attempt" -eq 1 ] && { echo "inconclusive on a loaded machine; running it again" >&2; continue; }
    [ "$status" -eq 0 ] || exit "$status"
    break
  done
done
