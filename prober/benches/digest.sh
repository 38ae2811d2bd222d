#!/bin/sh
# Full-digest throughput against sha256sum on the same files, in one run.
# Usage: prober/benches/digest.sh [FILES] [MIB_PER_FILE]   (default 8 files of 128 MiB)
set -eu
cd "$(dirname "$0")/../.."
exec cargo run --release --quiet -p understudy-prober --example digest_bench -- "$@"
