#!/usr/bin/env bash
# The demo on a machine without Docker: throwaway PostgreSQL and Redis, two
# instances (app1, app2) behind HAProxy, which takes an instance out of the
# pool as soon as its /health/ready answers 503. Ctrl+C stops and removes
# everything.
#
#   scripts/demo.sh
#   curl localhost:8080/api/slow?ms=2000        # through the load balancer
#   kill -TERM "$(cat .demo/app1.pid)"          # watch app1 drain while app2 serves
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

LB_PORT=${LB_PORT:-8080} PG_PORT=${PG_PORT:-55432} REDIS_PORT=${REDIS_PORT:-56379} DIR="$PWD/.demo"
source scripts/lib.sh
trap 'echo; echo "stopping the demo"; cleanup; exit 0' EXIT INT TERM

echo "starting PostgreSQL on :$PG_PORT and Redis on :$REDIS_PORT"
start_services
export KUMIKO_ADMIN_TOKEN="${KUMIKO_ADMIN_TOKEN:-demo-admin-token-change-me}"
start_app 1
start_app 2
start_lb

cat <<MSG

  load balancer   http://127.0.0.1:$LB_PORT/api/slow?ms=2000
  app1            api http://127.0.0.1:8081   ops http://127.0.0.1:9091/health/ready
  app2            api http://127.0.0.1:8082   ops http://127.0.0.1:9092/health/ready
  admin           curl -H 'Authorization: Bearer $KUMIKO_ADMIN_TOKEN' http://127.0.0.1:9091/admin/lifecycle
  event stream    curl -N http://127.0.0.1:8081/api/events
  an order        curl -XPOST http://127.0.0.1:$LB_PORT/api/orders -H 'Content-Type: application/json' \\
                    -d '{"customer":"Ada","items":[{"sku":"tea","qty":2,"priceCents":250}]}'

  watch a drain:  kill -TERM \$(cat .demo/app1.pid)
  Ctrl+C stops everything.

MSG
wait "$(cat "$DIR/app1.pid")" "$(cat "$DIR/app2.pid")" || true
echo "both instances have exited; Ctrl+C to clean up"
wait
