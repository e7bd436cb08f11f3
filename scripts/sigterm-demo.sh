#!/usr/bin/env bash
# Usage: scripts/sigterm-demo.sh
#
# The drain, live: one instance, a few slow requests in flight, then SIGTERM.
# Its log shows readiness turning 503, the linger, the listener closing, the
# in-flight requests completing with 200, the release of every resource in
# reverse boot order, and the exit code. About 10 s once built; Ctrl+C
# stops everything and exits 130. Ports: PG_PORT (25434), REDIS_PORT (26381),
# API_PORT1 (8081), OPS_PORT1 (9091); DEMO_DIR (.sigterm-demo).
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh demo
LB_PORT=0 PG_PORT=${PG_PORT:-25434} REDIS_PORT=${REDIS_PORT:-26381} DIR=${DEMO_DIR:-$PWD/.sigterm-demo}
source scripts/lib/stack.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" API_PORT1="${API_PORTS[1]}" OPS_PORT1="${OPS_PORTS[1]}" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

start_services
begin "booting app1" "api :${API_PORTS[1]}, ops :${OPS_PORTS[1]}: a few seconds"
start_app 1
wait_ready 1
stage="showing the drain"
api="http://127.0.0.1:${API_PORTS[1]}"
echo; echo ">>> three requests of 2s in flight, then SIGTERM"; echo
requests=()
for _ in 1 2 3; do
  curl -s -o /dev/null -w "    request finished: %{http_code}\n" "$api/api/slow?ms=2000" &
  requests+=($!)
done
sleep 0.3
kill -TERM "$(cat "$DIR/app1.pid")"
sleep 0.1
echo "    readiness right after SIGTERM: $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${OPS_PORTS[1]}/health/ready")"
reap "${app_pids[1]}"
code=$reaped
wait "${prefixer_pids[1]}" || true # its last lines first
unset 'app_pids[1]'
wait "${requests[@]}"
echo; echo ">>> exit code $code"
