#!/usr/bin/env bash
# Runs the whole test suite against real PostgreSQL, Redis and S3 servers that
# the tests start themselves on free loopback ports. Prints each stage's time
# at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
stages=()
stage_start=$SECONDS
# stage NAME: the time since the previous stage ended is NAME's.
stage() { stages+=("$1=$((SECONDS - stage_start))s"); stage_start=$SECONDS; }

scripts/install-deps.sh
export PATH="$PATH:$(go env GOPATH)/bin"
stage install
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
for target in $(go test -list '^Fuzz' . | grep '^Fuzz'); do
  go test -run '^$' -fuzz "^${target}\$" -fuzztime "${KUMIKO_FUZZTIME:-2000x}" -timeout 30m .
done
stage fuzz
go test -race -count=1 -timeout 30m "$@" ./...
stage "go test"
echo "test.sh stages: ${stages[*]} total=${SECONDS}s"
