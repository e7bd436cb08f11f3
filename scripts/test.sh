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
exec go test -race -count=1 -timeout 15m "$@" ./...
