#!/usr/bin/env bash
# Ascend (npu) backend CI without an NPU: the torch_npu test double (tests/npu_double, never
# shipped) on PYTHONPATH runs every line of backends/npu on CPU tensors: the conformance suite
# for `npu` and the NPU tests. Nothing here runs on an Ascend device.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-.venv/bin/python}"
export TOKENIZERS_PARALLELISM=false

check() { echo "+ $*"; "$@"; }

check env PYTHONPATH="tests/npu_double${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m polyrunner backends
check env PYTHONPATH="tests/npu_double${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m polyrunner conformance --backend npu
check "$PY" -m pytest -q tests/test_npu_backend.py tests/test_npu_double.py tests/test_npu_double_rules.py tests/test_npu_capture.py
