#!/usr/bin/env bash
# Runs the whole test suite against real PostgreSQL, Redis and S3 servers that
# the tests start themselves on free loopback ports.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export PATH="$PATH:$(go env GOPATH)/bin"
go vet ./...
unformatted=$(gofmt -l .)
if [ -n "$unformatted" ]; then
  echo "gofmt would change: $unformatted" >&2
  exit 1
fi
# A few seconds of fuzzing on the parsers of client input (the order decoder,
# the key check, the Last-Event-ID parser) and on the order answer's encoder.
# A failing input is written to testdata/fuzz/,
# where every later plain go test replays it.
for target in $(go test -list '^Fuzz' . | grep '^Fuzz'); do
  go test -run '^$' -fuzz "^${target}\$" -fuzztime "${KUMIKO_FUZZTIME:-10s}" .
done
exec go test -race -count=1 -timeout 15m "$@" ./...
