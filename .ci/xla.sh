#!/usr/bin/env bash
# XLA backend CI on the CPU PJRT device (no TPU needed).
#
# Creates, or reuses, a cached virtual environment under
# ${POLYRUNNER_CACHE:-$HOME/.cache/polyrunner}/venvs/xla-2.9.0, installs this
# checkout with its `xla` extra into it (torch_xla and the torch it was built for,
# as backends/supported_versions.py pairs them: what a user gets from
# `pip install 'polyrunner[xla]'`), and runs the XLA checks with PJRT_DEVICE=CPU.
# Each check is one `check ...` line below. About 1-2 minutes on 2 cores once
# the venv exists.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${POLYRUNNER_CACHE:-$HOME/.cache/polyrunner}"
VENV="$CACHE/venvs/xla-2.9.0"
PY="$VENV/bin/python"
TEST_DEPS=(pytest hypothesis transformers)

if [ ! -x "$PY" ]; then
  echo "xla.sh: creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# the user's install command; a no-op for torch/torch_xla once the cached venv holds the pair
"$PY" -m pip install -q --no-cache-dir -e ".[xla]" >"$VENV/polyrunner-install.log" 2>&1 \
  || { cat "$VENV/polyrunner-install.log"; exit 1; }
if ! "$PY" -c "import pytest, hypothesis, transformers" >/dev/null 2>&1; then
  echo "xla.sh: installing ${TEST_DEPS[*]}"
  "$PY" -m pip install -q --no-cache-dir "${TEST_DEPS[@]}"
fi

export PJRT_DEVICE=CPU
export TOKENIZERS_PARALLELISM=false

check() { echo "+ $*"; "$@"; }

check "$VENV/bin/polyrunner" backends   # lists xla as available on the CPU XLA device
check "$PY" -m pytest -q tests/test_xla*.py
check "$VENV/bin/polyrunner" conformance --backend xla
