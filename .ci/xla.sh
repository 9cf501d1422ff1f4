#!/usr/bin/env bash
# XLA backend CI on the CPU PJRT device (no TPU needed).
#
# Creates, or reuses, a cached virtual environment with torch 2.9.0 + torch_xla
# 2.9.0 under ${POLYRUNNER_CACHE:-$HOME/.cache/polyrunner}/venvs/xla-2.9.0,
# installs this checkout into it, and runs the XLA checks with PJRT_DEVICE=CPU.
# Each check is one `check ...` line below. About 1-2 minutes on 2 cores once
# the venv exists.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${POLYRUNNER_CACHE:-$HOME/.cache/polyrunner}"
VENV="$CACHE/venvs/xla-2.9.0"
PY="$VENV/bin/python"
TORCH_PINS=(torch==2.9.0 torch_xla==2.9.0)   # torch_xla pins the exact torch release
DEPS=(numpy pydantic pluggy safetensors tokenizers jinja2 gguf tqdm pytest hypothesis transformers)

if [ ! -x "$PY" ]; then
  echo "xla.sh: creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$PY" -c "import torch, torch_xla; assert torch.__version__.split('+')[0] == '2.9.0'" >/dev/null 2>&1; then
  echo "xla.sh: installing ${TORCH_PINS[*]}"
  "$PY" -m pip install -q "${TORCH_PINS[@]}"
fi
if ! "$PY" -c "import numpy, pydantic, pluggy, safetensors, tokenizers, jinja2, gguf, tqdm, pytest, hypothesis, transformers" >/dev/null 2>&1; then
  echo "xla.sh: installing ${DEPS[*]}"
  "$PY" -m pip install -q "${DEPS[@]}"
fi
"$PY" -m pip install -q --no-deps -e . >"$VENV/polyrunner-install.log" 2>&1 \
  || { cat "$VENV/polyrunner-install.log"; exit 1; }

export PJRT_DEVICE=CPU
export TOKENIZERS_PARALLELISM=false

check() { echo "+ $*"; "$@"; }

check "$PY" -m pytest -q tests/test_xla*.py
check "$VENV/bin/polyrunner" conformance --backend xla
