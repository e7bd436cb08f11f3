#!/usr/bin/env bash
# Event-stream fan-out on one instance: for each N in STREAMS, a fresh
# instance, N streams held open by scripts/sseload, orders posted at RATE/s
# for DURATION; prints post → stream latency (p50/p99 across every stream),
# RSS per idle stream, CPU, and SIGTERM → exit with the N streams open.
#
#   scripts/bench-sse.sh                                # 1,000, 5,000 and 10,000 streams
#   STREAMS="200 1000" RATE=100 scripts/bench-sse.sh
#
# The load generator runs on the same 2 cores as the instance, PostgreSQL and
# Redis: the figures are what one machine does with all of them on it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export PATH="$PATH:$(go env GOPATH)/bin"

STREAMS=${STREAMS:-"1000 5000 10000"} RATE=${RATE:-200} DURATION=${DURATION:-10s}
LB_PORT=0 PG_PORT=${PG_PORT:-25437} REDIS_PORT=${REDIS_PORT:-26384}
API_PORT1=${API_PORT1:-18093} OPS_PORT1=${OPS_PORT1:-18094} DIR=${BENCH_DIR:-$PWD/.bench-sse}
ulimit -n "$(ulimit -Hn)" # every stream is a descriptor in the instance and in the load tool
source scripts/lib.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1" || exit 1
trap cleanup EXIT INT TERM

start_services
go build -o "$DIR/sseload" ./scripts/sseload
# One client address opens every stream and posts every order: lift the
# per-address caps; the instance-wide cap stays above the largest N.
export KUMIKO_LOG_FORMAT=json KUMIKO_SSE_MAX_STREAMS=20000 KUMIKO_SSE_MAX_STREAMS_PER_IP=0 KUMIKO_API_RATE_LIMIT=0
export KUMIKO_LINGER=${KUMIKO_LINGER:-0}

for n in $STREAMS; do
  echo
  if ((n + 100 > $(ulimit -n))); then
    echo "skipping $n streams: the open-file limit is $(ulimit -n) (raise the hard limit: ulimit -Hn)"
    continue
  fi
  start_app 1 "$DIR/app1-$n.log"
  wait_ready 1
  "$DIR/sseload" -api "http://127.0.0.1:$API_PORT1" -pid "${app_pids[1]}" -streams "$n" -rate "$RATE" \
    -duration "$DURATION" -linger "$KUMIKO_LINGER" -metrics "http://127.0.0.1:$OPS_PORT1/metrics"
  wait "${app_pids[1]}" && code=0 || code=$?
  echo "exit code      $code"
  unset 'app_pids[1]'
done
