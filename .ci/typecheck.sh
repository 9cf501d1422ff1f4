#!/usr/bin/env bash
# mypy --strict on the packages pyproject.toml's [tool.mypy] names. The `polyrunner` package is
# core/ plus backends/ (setuptools package-dir), which mypy cannot follow through the editable
# install's import hook: it reads a tree of links laid out as the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
TREE="$(mktemp -d)"
trap 'rm -rf "$TREE"' EXIT
mkdir -p "$TREE/polyrunner"
for entry in core/*; do ln -s "$ROOT/$entry" "$TREE/polyrunner/$(basename "$entry")"; done
ln -s "$ROOT/backends" "$TREE/polyrunner/backends"
PY="${PY:-.venv/bin/python}"
MYPYPATH="$TREE" "$PY" -m mypy --config-file "$ROOT/pyproject.toml" "$@"
