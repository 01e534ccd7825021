# shellcheck shell=bash
# Shared by the run_*_gpu.sh scripts (sourced, not run): each case as its own chunkloss-bench
# call writing OUT/NAME.json, OUT/NAME.txt (details and table) and OUT/NAME.err; a failing case
# is reported and the rest still run.

# Sets out and bench from the script's arguments (OUT_DIR [path/to/chunkloss-bench]), makes
# OUT and zeroes the failure count.
parse_case_args() {
  out=${1:?usage: $0 OUT_DIR [path/to/chunkloss-bench]}
  bench=${2:-./build-gpu/apps/bench/chunkloss-bench}
  mkdir -p "$out"
  [ -x "$bench" ] || { echo "$0: no executable bench at $bench" >&2; exit 1; }
  failed=0
}

run() {
  local name=$1
  shift
  echo "== $name: $bench $*"
  if "$bench" "$@" --json "$out/$name.json" >"$out/$name.txt" 2>"$out/$name.err"; then
    grep -E '^\| [a-z]+( \(token [a-z]+\))? \| cuda' "$out/$name.txt"
  else
    echo "FAILED (exit $?): $name; last lines of $out/$name.err:"
    tail -n 5 "$out/$name.err"
    failed=$((failed + 1))
  fi
}

# The machine, the date and the source revision, into OUT/machine.txt.
describe_machine() {
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    git rev-parse HEAD 2>/dev/null
    git status --short 2>/dev/null | head -n 40
  } >"$out/machine.txt" 2>&1
}

# OUT/summary.md: every case's table row, then the plans, extra details and float64 errors.
# $1: a title.
summarize() {
  {
    echo "# $1, $(head -n 1 "$out/machine.txt")"
    echo
    local first=1 f
    for f in "$out"/*.json; do
      f=${f%.json}.txt
      if [ $first = 1 ]; then
        grep -m 2 -E '^\| loss|^\|---' "$f"
        first=0
      fi
      grep -E '^\| [a-z]+( \(token [a-z]+\))? \| cuda' "$f"
    done
    echo
    echo "plans, floors and float64 errors:"
    for f in "$out"/*.json; do
      grep -h -E '^case:|^  plan:|^  floor|^  error vs|^  dX rows' "${f%.json}.txt"
    done
  } >"$out/summary.md" 2>/dev/null
  echo "wrote $out (summary.md); $failed case(s) failed"
}
