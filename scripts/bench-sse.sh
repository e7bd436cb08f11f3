#!/usr/bin/env bash
# Usage: scripts/bench-sse.sh [fanout|drain]   (settings in the environment, below)
#
# Event-stream benchmarks, two modes.
#
# fanout (the default): for each N in STREAMS, a fresh instance, N streams
# held open by scripts/sseload, orders posted at RATE/s for DURATION; prints
# post → stream latency (p50/p99 across every stream), RSS per idle stream,
# CPU, and SIGTERM → exit with the N streams open.
#
# drain: two instances; DRAIN_STREAMS (5,000) streams on instance 1, SIGTERM
# it, and every client moves to instance 2, the survivor, once its goodbye's
# retry hint has passed, resuming with Last-Event-ID, while orders go to the
# survivor at DRAIN_RATE/s. Run with the reconnect spread on and off
# (JITTER="on off"); prints, for each, the peak rate at which the survivor
# is asked for streams and at which it opens them (per 100 ms), its CPU peak
# (per 250 ms), the reconnect p99 (goodbye → new stream), the
# too_many_streams answers, all refusals, and the orders any client missed
# or got twice. The survivor keeps KUMIKO_SSE_MAX_STREAMS
# at its default, 5,000: exactly what it has to take.
#
#   scripts/bench-sse.sh                                # fanout: 1,000, 5,000 and 10,000 streams
#   STREAMS="200 1000" RATE=100 scripts/bench-sse.sh
#   scripts/bench-sse.sh drain                          # 5,000 streams, jitter on, then off
#   DRAIN_STREAMS=1000 JITTER=off scripts/bench-sse.sh drain
#
# The load generator runs on the same 2 cores as the instances, PostgreSQL and
# Redis: the figures are what one machine does with all of them on it.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
MODE=${1:-${MODE:-fanout}}
case $MODE in
fanout | drain) ;;
*)
  echo "usage: scripts/bench-sse.sh [fanout|drain]" >&2
  exit 2
  ;;
esac
scripts/install-deps.sh demo
export PATH="$PATH:$(go env GOPATH)/bin"

STREAMS=${STREAMS:-"1000 5000 10000"} RATE=${RATE:-200} DURATION=${DURATION:-10s}
DRAIN_STREAMS=${DRAIN_STREAMS:-5000} DRAIN_RATE=${DRAIN_RATE:-20} JITTER=${JITTER:-"on off"}
LB_PORT=0 PG_PORT=${PG_PORT:-25437} REDIS_PORT=${REDIS_PORT:-26384}
API_PORT1=${API_PORT1:-18093} OPS_PORT1=${OPS_PORT1:-18094} API_PORT2=${API_PORT2:-18095} OPS_PORT2=${OPS_PORT2:-18096}
DIR=${BENCH_DIR:-$PWD/.bench-sse}
ulimit -n "$(ulimit -Hn)" # every stream is a descriptor in the instance and in the load tool
source scripts/lib/stack.sh
ports=(PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1")
[ "$MODE" = drain ] && ports+=(API_PORT2="$API_PORT2" OPS_PORT2="$OPS_PORT2")
check_ports "${ports[@]}" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

start_services
go build -o "$DIR/sseload" ./scripts/sseload
# One client address opens every stream and posts every order: lift the
# per-address caps.
export KUMIKO_LOG_FORMAT=json KUMIKO_SSE_MAX_STREAMS_PER_IP=0 KUMIKO_API_RATE_LIMIT=0
export KUMIKO_LINGER=${KUMIKO_LINGER:-0}

if [ "$MODE" = fanout ]; then
  export KUMIKO_SSE_MAX_STREAMS=20000 KUMIKO_API_MAX_CONNS=21000 # above the largest N; the connection cap above the streams
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
  exit 0
fi

export KUMIKO_SSE_MAX_STREAMS=${KUMIKO_SSE_MAX_STREAMS:-5000}
export KUMIKO_API_MAX_CONNS=${KUMIKO_API_MAX_CONNS:-$((KUMIKO_SSE_MAX_STREAMS + 1000))}
spread=${KUMIKO_SSE_RECONNECT_SPREAD:-}
declare -A results
for jitter in $JITTER; do
  echo
  echo "== $DRAIN_STREAMS streams drained from app1 to app2, reconnect spread $jitter"
  if [ "$jitter" = off ]; then export KUMIKO_SSE_RECONNECT_SPREAD=0; elif [ -n "$spread" ]; then
    export KUMIKO_SSE_RECONNECT_SPREAD=$spread
  else unset KUMIKO_SSE_RECONNECT_SPREAD; fi
  start_app 1 "$DIR/app1-$jitter.log"
  start_app 2 "$DIR/app2-$jitter.log"
  wait_ready 1 2
  "$DIR/sseload" -drain -api "http://127.0.0.1:$API_PORT1,http://127.0.0.1:$API_PORT2" -pid "${app_pids[1]}" \
    -survivor-pid "${app_pids[2]}" -streams "$DRAIN_STREAMS" -rate "$DRAIN_RATE" | tee "$DIR/sseload-$jitter.out"
  wait "${app_pids[1]}" && code=0 || code=$?
  echo "app1 exit code  $code"
  grep '"component":"sseHub"' "$DIR/app1-$jitter.log" | grep -E 'event streams closed|force-closed' | tail -1
  grep '"step":"sseClose"' "$DIR/app1-$jitter.log" | tail -1
  echo "survivor's warnings and errors (count, message):"
  grep -v '"level":"info"' "$DIR/app2-$jitter.log" | grep -o '"msg":"[^"]*"' | sort | uniq -c || echo "  none"
  unset 'app_pids[1]'
  kill -TERM "${app_pids[2]}" && wait "${app_pids[2]}" || true
  unset 'app_pids[2]'
  results[$jitter]=$(grep '^RESULT' "$DIR/sseload-$jitter.out" | cut -d' ' -f2-)
done

echo
echo "| reconnect spread | reconnects asked of the survivor, peak (/s, 100 ms) | streams it opened, peak (/s, 100 ms) | its CPU peak (% of a core, 250 ms) | reconnect p99 (goodbye → stream) | of it beyond the hint, p99 | too_many_streams | reconnects refused | missed / repeated | app1 SIGTERM → exit |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for jitter in $JITTER; do
  declare -A r=()
  for kv in ${results[$jitter]}; do r[${kv%%=*}]=${kv#*=}; done
  echo "| $jitter | ${r[attempt_peak_per_s]} | ${r[accept_peak_per_s]} | ${r[cpu_peak_pct]} % | ${r[reconnect_p99_ms]} ms | ${r[beyond_hint_p99_ms]} ms | ${r[too_many_streams]} | ${r[refused]} | ${r[missed]} / ${r[repeated]} | ${r[exit_ms]} ms |"
done
