#!/usr/bin/env bash
# Usage: DATABASE_URL=postgres://… scripts/migrate-force.sh VERSION   (-1: nothing applied)
#
# Mends a schema marked dirty: records VERSION as the schema's version and
# clears the flag, without running anything. The boot's error names VERSION
# (the dirty migration when its changes are present, the one before it when
# they are absent); the next boot then applies whatever is pending.
#
#   DATABASE_URL=postgres://… scripts/migrate-force.sh VERSION
#
# Runs the built binary when KUMIKO_BIN points at it, else `go run .`.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
[ $# -eq 1 ] || { echo "usage: DATABASE_URL=… $0 VERSION   (-1: nothing applied)" >&2; exit 2; }
: "${DATABASE_URL:?set DATABASE_URL to the database to mend}"
cd "$(dirname "$0")/.."
if [ -n "${KUMIKO_BIN:-}" ]; then
  exec "$KUMIKO_BIN" migrate force "$1"
fi
exec go run . migrate force "$1"
