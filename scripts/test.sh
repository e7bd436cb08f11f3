#!/usr/bin/env bash
# Usage: scripts/test.sh [go test flags]
#
# Runs the whole test suite against real PostgreSQL, Redis and S3 servers that
# the tests start themselves on free loopback ports. Prints each stage's time
# at the end, and says each stage as it begins: on a fresh machine the
# installs take a few minutes, the first vet a few more (it compiles every
# package), the fuzzing three to five and the race suite seven to ten
# (docs/testing.md has the figures).
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
stages=()
stage_start=$SECONDS
# stage NAME: the time since the previous stage ended is NAME's.
stage() { stages+=("$1=$((SECONDS - stage_start))s"); stage_start=$SECONDS; }
# say LINE: what begins now, on stderr (stdout may be go test -json's).
say() { echo "test.sh: $*…" >&2; }

say "checking the servers and the test tools (installing what is missing)"
scripts/install-deps.sh tests
export PATH="$PATH:$(go env GOPATH)/bin"
stage install
say "go vet and gofmt (the first run compiles every package: a few minutes)"
go vet ./...
unformatted=$(gofmt -l .)
if [ -n "$unformatted" ]; then
  echo "gofmt would change: $unformatted" >&2
  exit 1
fi
stage vet
# A short fuzz run of every fuzz target (the parsers of client input, such as
# the key check and the Last-Event-ID parser, and the encoders of answers),
# bounded by executions, not by time: a time budget can run out inside the fuzzer's
# own start-up on a busy machine and fail the run for the harness's sake,
# while a count only makes a slow machine slower. A failing input still fails
# the run and is written to testdata/fuzz/, where every later go test replays
# it. Fuzz for longer with KUMIKO_FUZZTIME=200000x (or a time, 5m: then a
# deadline inside start-up is the fuzzer's, not a finding).
targets=$(go test -list '^Fuzz' . | grep '^Fuzz')
say "fuzzing $(wc -w <<<"$targets") targets, ${KUMIKO_FUZZTIME:-2000x} each"
for target in $targets; do
  go test -run '^$' -fuzz "^${target}\$" -fuzztime "${KUMIKO_FUZZTIME:-2000x}" -timeout 30m .
done
stage fuzz
say "go test -race ./... (seven to ten minutes)"
# -parallel 4: the parallel tests are process-level; they wait on children
# and servers, not on this process's CPU, so the default (GOMAXPROCS, 2 here)
# would leave the cores idle while the slowest of them waits out its timers.
skip=()
# template:begin (scripts/new-service.sh removes these lines from a copy)
# The tests of scripts/new-service.sh compile two copies of the service, most
# of the suite's CPU: they run in scripts/bare-smoke.sh, CI's copy stage.
skip=(-skip '^TestNewServiceScript')
# template:end
go test -race -count=1 -parallel 4 -timeout 30m "${skip[@]}" "$@" ./...
stage "go test"
echo "test.sh stages: ${stages[*]} total=${SECONDS}s"
