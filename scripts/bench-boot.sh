#!/usr/bin/env bash
# Usage: scripts/bench-boot.sh   (RUNS in the environment)
#
# Boot to ready, phase by phase: RUNS boots of one instance against a
# throwaway PostgreSQL and Redis with the schema applied; prints the median
# and max of each phase's duration_ms and of boot_complete (from the JSON
# logs), so what the boot waits for is visible.
#
#   scripts/bench-boot.sh              # 15 boots
#   RUNS=30 scripts/bench-boot.sh
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh demo
export PATH="$PATH:$(go env GOPATH)/bin"

RUNS=${RUNS:-15}
LB_PORT=0 PG_PORT=${PG_PORT:-25438} REDIS_PORT=${REDIS_PORT:-26385}
API_PORT1=${API_PORT1:-18095} OPS_PORT1=${OPS_PORT1:-18096} DIR=${BENCH_DIR:-$PWD/.bench-boot}
export KUMIKO_LOG_FORMAT=json KUMIKO_LINGER=0
source scripts/lib/stack.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

start_services
"$DIR/kumiko-lifecycle-demo" migrate up >/dev/null 2>&1
for i in $(seq 1 "$RUNS"); do
  start_app 1 "$DIR/boot-$i.log"
  wait_ready 1
  stop_apps >/dev/null
done

echo
echo "boot phases over $RUNS boots (duration_ms from the JSON logs), $(nproc) cores"
cat "$DIR"/boot-*.log | jq -r 'select(.component == "lifecycle") |
    if .event == "boot_complete" then "~boot_complete \(.duration_ms)"
    elif .phase != null and .duration_ms != null and .step == null then "\(.phase) \(.duration_ms)" else empty end' |
  sort -k1,1 -k2,2n | awk '
    function flush() { if (n) printf "%-22s p50 %5d ms   max %5d ms\n", name, v[int((n - 1) / 2) + 1], v[n] }
    $1 != name { flush(); name = $1; n = 0 }
    { v[++n] = $2 }
    END { flush() }' | sed 's/^~//'
