#!/usr/bin/env bash
# Usage: scripts/stress-test.sh [-n N] [--hogs K] [--suite] [go test flags]
#
# The flake finder: runs tests N times in a row while K other processes keep
# cores busy, in the suite's own parallelism, and prints a table of the tests
# that failed, in how many runs, and the first line each failure printed. A
# test that fails one run in ten is a defect; a busy machine (a laptop, a
# shared CI runner) shows it in a few runs.
#
#   scripts/stress-test.sh -n 5 --hogs 1 --suite     # the README's test command five times, one core busy
#   scripts/stress-test.sh -n 20 --hogs 2 -run 'Process|Demo|Rolling|Chromium'
#   scripts/stress-test.sh -n 10 -run TestSomething -v   # anything after the options goes to go test
#
# Options: -n N runs (default 5); --hogs K CPU hogs, `yes > /dev/null` each
# (default 1); --suite runs scripts/test.sh (vet, gofmt, fuzz, the race suite)
# instead of `go test -race -count=1 ./...`. Every run's output is kept in
# $STRESS_DIR (default .stress/) as run-N.log; exit 1 when any run failed.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."

runs=5 hogs=1 suite=0
while (($#)); do
  case "$1" in
  -n) runs=$2 && shift 2 ;;
  --hogs) hogs=$2 && shift 2 ;;
  --suite) suite=1 && shift ;;
  *) break ;; # the rest is go test's
  esac
done
dir=${STRESS_DIR:-$PWD/.stress}
export KUMIKO_REQUIRE_SERVICES=${KUMIKO_REQUIRE_SERVICES:-1}
export PATH="$PATH:$(go env GOPATH)/bin"
scripts/install-deps.sh
rm -rf "$dir" && mkdir -p "$dir"
go build -o "$dir/flaketable" ./scripts/flaketable

hog_pids=()
stop_hogs() { ((${#hog_pids[@]} == 0)) || kill "${hog_pids[@]}" 2>/dev/null || true; }
trap stop_hogs EXIT
trap 'exit 130' INT TERM # the EXIT trap still stops the hogs
for _ in $(seq 1 "$hogs"); do
  yes >/dev/null &
  hog_pids+=($!)
done
echo "stress-test: $runs runs of $( ((suite)) && echo "scripts/test.sh" || echo "go test -race ./... $*"), $hogs CPU hogs on $(nproc) cores"

logs=()
failed=0
for i in $(seq 1 "$runs"); do
  log="$dir/run-$i.log"
  logs+=("$log")
  start=$SECONDS
  # -json: flaketable reads which test failed and what it printed first.
  # -parallel 4: the suite's own parallelism (scripts/test.sh).
  if ((suite)); then
    scripts/test.sh -json "$@" >"$log" 2>&1 && ok=1 || ok=0
  else
    go test -race -count=1 -parallel 4 -timeout 30m -json "$@" ./... >"$log" 2>&1 && ok=1 || ok=0
  fi
  ((ok)) || failed=$((failed + 1))
  printf 'run %2d/%d  %s  %4ds\n' "$i" "$runs" "$( ((ok)) && echo pass || echo FAIL)" "$((SECONDS - start))"
done
"$dir/flaketable" "${logs[@]}" || true
echo "stress-test: $((runs - failed)) passed, $failed failed (runs; $hogs CPU hogs; logs in $dir)"
((failed == 0))
