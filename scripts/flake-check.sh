#!/usr/bin/env bash
# Runs the README's test command (scripts/test.sh: vet, gofmt, fuzz, the race
# suite) N times in a row and prints pass/fail and the duration of each run,
# then a summary line. A suite that is green once is not yet proof: a test
# that fails one run in ten is a defect.
#
#   scripts/flake-check.sh 10            # ten runs on an otherwise quiet machine
#   scripts/flake-check.sh 5 --hog       # five runs while two other processes keep both cores busy
#   scripts/flake-check.sh 5 --hog=1     # ... keep one core busy
#   RUN='TestProcess' scripts/flake-check.sh 20   # only go test -race -run PATTERN, no vet or fuzz
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

hogs=0
case "$hog" in
--hog) hogs=2 ;;
--hog=[0-9]*) hogs=${hog#--hog=} ;;
"") ;;
*) echo "flake-check: unknown option $hog (--hog or --hog=N)" >&2 && exit 2 ;;
esac
hog_pids=()
stop_hogs() { [ ${#hog_pids[@]} -gt 0 ] && kill "${hog_pids[@]}" 2>/dev/null || true; }
trap stop_hogs EXIT
trap 'exit 130' INT TERM # the EXIT trap still stops the hogs
for _ in $(seq 1 "$hogs"); do
  yes >/dev/null &
  hog_pids+=($!)
done
((hogs > 0)) && echo "$hogs CPU hogs (yes > /dev/null, pids ${hog_pids[*]}) keep $hogs of $(nproc) cores busy"

suite() {
  if [ -n "${RUN:-}" ]; then
    go test -race -count=1 -timeout 30m -run "$RUN" ./...
  else
    scripts/test.sh
  fi
}
passed=0 failed=0
for i in $(seq 1 "$runs"); do
  log="$dir/run-$i.log"
  start=$(date +%s)
  if suite >"$log" 2>&1; then
    passed=$((passed + 1))
    printf 'run %2d/%d  pass  %4ds  %s\n' "$i" "$runs" "$(($(date +%s) - start))" \
      "$(grep -o 'stages: .*' "$log" || true)"
    rm -f "$log"
  else
    failed=$((failed + 1))
    printf 'run %2d/%d  FAIL  %4ds  %s  (output: %s)\n' "$i" "$runs" "$(($(date +%s) - start))" \
      "$(grep -o -- '--- FAIL: [^ ]*' "$log" | cut -d' ' -f3 | sort -u | paste -sd' ' -)" "$log"
  fi
done
echo "flake-check: $passed passed, $failed failed$( ((hogs > 0)) && echo " (with $hogs CPU hogs)")"
((failed == 0))
