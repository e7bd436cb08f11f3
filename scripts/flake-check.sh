#!/usr/bin/env bash
# Runs the test suite N times in a row and prints pass/fail and the duration of
# each run, then a summary line. A suite that is green once is not yet proof:
# a test that fails one run in ten is a defect.
#
#   scripts/flake-check.sh 10            # ten runs on an otherwise quiet machine
#   scripts/flake-check.sh 3 --hog       # three runs while another process keeps one core busy
#   RUN='TestProcess' scripts/flake-check.sh 20   # only the tests matching a -run pattern
#
# The output of every failed run is kept in $FLAKE_DIR (default .flake/) and
# its failing tests are named on the run's line.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:-10}
hog=${2:-}
dir=${FLAKE_DIR:-$PWD/.flake}
export KUMIKO_REQUIRE_SERVICES=${KUMIKO_REQUIRE_SERVICES:-1}
export PATH="$PATH:$(go env GOPATH)/bin"
scripts/install-deps.sh
mkdir -p "$dir"

hog_pid=
stop_hog() { [ -n "$hog_pid" ] && kill "$hog_pid" 2>/dev/null || true; }
trap stop_hog EXIT
trap 'exit 130' INT TERM # the EXIT trap still stops the hog
if [ "$hog" = "--hog" ]; then
  yes >/dev/null &
  hog_pid=$!
  echo "a CPU hog (yes > /dev/null, pid $hog_pid) keeps one core busy"
fi

args=(-race -count=1 -timeout 15m)
[ -n "${RUN:-}" ] && args+=(-run "$RUN")
passed=0 failed=0
for i in $(seq 1 "$runs"); do
  log="$dir/run-$i.log"
  start=$(date +%s)
  if go test "${args[@]}" ./... >"$log" 2>&1; then
    passed=$((passed + 1))
    printf 'run %2d/%d  pass  %4ds\n' "$i" "$runs" "$(($(date +%s) - start))"
    rm -f "$log"
  else
    failed=$((failed + 1))
    printf 'run %2d/%d  FAIL  %4ds  %s  (output: %s)\n' "$i" "$runs" "$(($(date +%s) - start))" \
      "$(grep -o -- '--- FAIL: [^ ]*' "$log" | cut -d' ' -f3 | sort -u | paste -sd' ' -)" "$log"
  fi
done
echo "flake-check: $passed passed, $failed failed${hog:+ (with a CPU hog)}"
((failed == 0))
