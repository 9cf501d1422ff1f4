#!/usr/bin/env bash
# Resolve every backend extra in a fresh venv (dry runs: nothing is downloaded beyond
# metadata, nothing installed) and check the resolved versions against the table of
# supported pairs, backends/supported_versions.py (.ci/check_resolution.py).
# The `cpu` stack is resolved with the README's first step: the CPU torch, from
# $TORCH_CPU_INDEX when set (https://download.pytorch.org/whl/cpu), else from the
# configured indexes. About 45 s per extra, three at a time; pip's downloads (whole wheels where
# the index has no metadata files) stay in $TMP, deleted at exit, not in pip's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"${PYTHON:-python3}" -m venv "$TMP/venv"
export TMPDIR="$TMP"
PY="$TMP/venv/bin/python"
EXTRAS=("" xla cpu cuda tpu npu)   # xla before tpu, two apart: never resolved at once (~3.5 GB of
                                    # wheels each where the index serves no metadata files)
CPU_INDEX=()
if [ -n "${TORCH_CPU_INDEX:-}" ]; then CPU_INDEX=(--extra-index-url "$TORCH_CPU_INDEX"); fi
status=0
resolve() {   # resolve one extra into its report and check it; output kept in its own log
  local extra="$1" spec="." log="$TMP/log-${1:-base}"
  [ -n "$extra" ] && spec=".[$extra]"
  local args=("$spec")
  if [ "$extra" = cpu ]; then
    local torch
    torch=$("$PY" -c "import re; print(re.search(r'TORCH_TESTED = \"([^\"]+)\"', open('backends/supported_versions.py').read()).group(1))")
    args=("torch==$torch" "${CPU_INDEX[@]}" "$spec")
  fi
  local report="$TMP/report-${extra:-base}.json"
  if ! "$PY" -m pip install -q --no-cache-dir --dry-run --ignore-installed --report "$report" "${args[@]}" >"$log" 2>&1; then
    { echo "resolve_extras.sh: pip cannot resolve '$spec':"; grep -v '^WARNING: Location' "$log" | tail -20; } >&2
    return 1
  fi
  "${PYTHON:-python3}" .ci/check_resolution.py "$extra" "$report"
}
# pip's resolver waits mostly on the index: three at a time roughly halves the wall time on 2 cores
pids=()
for extra in "${EXTRAS[@]}"; do
  resolve "$extra" & pids+=($!)
  if [ ${#pids[@]} -ge 3 ]; then wait "${pids[0]}" || status=1; pids=("${pids[@]:1}"); fi
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
