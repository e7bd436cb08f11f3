#!/usr/bin/env bash
# The drain, live: one instance, a few slow requests in flight, then SIGTERM.
# Its log shows readiness turning 503, the linger, the listener closing, the
# in-flight requests completing with 200, the release of every resource in
# reverse boot order, and the exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
LB_PORT=0 PG_PORT=${PG_PORT:-25434} REDIS_PORT=${REDIS_PORT:-26381} DIR=${DEMO_DIR:-$PWD/.sigterm-demo}
source scripts/lib.sh
trap cleanup EXIT INT TERM

start_services
start_app 1
wait_ready 1
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
wait "$(cat "$DIR/app1.pid")" && code=0 || code=$?
wait "${requests[@]}"
echo; echo ">>> exit code $code"
