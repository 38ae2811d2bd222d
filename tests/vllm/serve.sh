#!/usr/bin/env bash
# vLLM's CPU image as the cluster tier's emulated nodes run it (`understudy-gpu-nodes
# --vllm-cpu`): the image's `vllm serve MODEL [FLAGS...]`, its entrypoint left out, becomes the
# tier's real server of its tiny model (tests/vllm/install.sh), served under MODEL, with the
# tier's flags first, so that the pod's own (`--port`, `--host`, `--max-model-len`) win.
# The same flags and environment as `VllmTier::command` in gameday/src/local/vllm.rs.
set -euo pipefail
cache=${UNDERSTUDY_VLLM_CACHE:-$HOME/.cache/understudy-vllm}
[ "${1:-}" = serve ] && [ $# -ge 2 ] || { echo "usage: serve.sh serve MODEL [FLAGS...]" >&2; exit 2; }
model=$2
shift 2
[ -x "$cache/venv/bin/python" ] || { echo "serve.sh: the real-vLLM tier is not installed in $cache: run tests/vllm/install.sh" >&2; exit 1; }
export VLLM_CPU_KVCACHE_SPACE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
exec "$cache/venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$cache/model" \
  --served-model-name "$model" --enforce-eager --dtype float32 --max-model-len 512 "$@"
