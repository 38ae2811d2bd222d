#!/usr/bin/env bash
# Runs every fuzz target for a bounded time each (default 60 s): cargo-fuzz (libFuzzer, with
# AddressSanitizer) on the nightly toolchain. Installs cargo-fuzz into ~/.cargo/bin if it is
# missing. The corpus grows under fuzz/corpus/<target> (seeded from the repo's examples and
# fixtures on the first run; not committed); a crash is written under fuzz/artifacts/<target>/
# and fails the script: make it a regression test in the crate it crashed, then fix it.
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(http1_response sse route_json policy_yaml vllm_log)

rustup toolchain list | grep -q '^nightly' || {
  echo "fuzz/run.sh: no nightly toolchain (rustup toolchain install nightly --profile minimal)" >&2
  exit 2
}
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz --version 0.13.1

# Seeds: what these readers see in this repo's own examples and test fixtures.
seed() {
  local target=$1; shift
  mkdir -p "corpus/$target"
  [ -n "$(ls -A "corpus/$target")" ] && return
  for f in "$@"; do [ -f "$f" ] && cp "$f" "corpus/$target/$(basename "$(dirname "$f")")-$(basename "$f")"; done
}
seed policy_yaml ../examples/*.yaml ../examples/invalid/*.yaml
seed vllm_log ../prober/tests/fixtures/coldstart/*/*
mkdir -p corpus/http1_response corpus/sse corpus/route_json
printf '{"pool":"b","epoch":5,"endpoints":["127.0.0.1:8000"],"admission":{"window_s":30}}' > corpus/route_json/route
printf '\x20HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello' > corpus/http1_response/length
printf '\x05HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n' > corpus/http1_response/chunked
printf '\x07data: {"choices":[{"text":"Paris"}]}\n\ndata: [DONE]\n\n' > corpus/sse/completion

for target in "${targets[@]}"; do
  echo "fuzzing $target for ${seconds}s ..." >&2
  cargo +nightly fuzz run "$target" "corpus/$target" -- -max_total_time="$seconds" -rss_limit_mb=4096 \
    2>&1 | grep -E '^(Done [0-9]+ runs|==[0-9]+==|SUMMARY|artifact_prefix|Test unit written)|panicked' || true
  if [ -n "$(ls -A "artifacts/$target" 2>/dev/null)" ]; then
    echo "fuzz/run.sh: $target crashed; the input is in fuzz/artifacts/$target/" >&2
    exit 1
  fi
done
echo "every target ran ${seconds}s without a crash" >&2
