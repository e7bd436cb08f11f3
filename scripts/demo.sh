#!/usr/bin/env bash
# The demo on a machine without Docker: throwaway PostgreSQL and Redis, two
# instances (app1, app2) behind HAProxy, which takes an instance out of the
# pool as soon as its /health/ready answers 503. Ctrl+C drains both instances
# (their drain log is printed), then stops HAProxy, Redis and PostgreSQL and
# removes everything; Ctrl+C a second time cuts the drain short (exit 1).
#
#   scripts/demo.sh
#   curl localhost:8080/api/slow?ms=2000        # through the load balancer
#   kill -TERM "$(cat .demo/app1.pid)"          # watch app1 drain while app2 serves
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

LB_PORT=${LB_PORT:-8080} PG_PORT=${PG_PORT:-25432} REDIS_PORT=${REDIS_PORT:-26379} DIR=${DEMO_DIR:-$PWD/.demo}
source scripts/lib.sh
check_ports LB_PORT="$LB_PORT" PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" \
  API_PORT1="${API_PORTS[1]}" API_PORT2="${API_PORTS[2]}" OPS_PORT1="${OPS_PORTS[1]}" OPS_PORT2="${OPS_PORTS[2]}" || exit 1
trap cleanup EXIT
trap 'echo; echo "stopping the demo: the instances drain first"; exit 0' INT TERM

echo "starting PostgreSQL on :$PG_PORT and Redis on :$REDIS_PORT"
start_services
export KUMIKO_ADMIN_TOKEN="${KUMIKO_ADMIN_TOKEN:-demo-admin-token-change-me}"
start_app 1
start_app 2
start_lb
# The banner comes once HAProxy routes to both: a request pasted at once must
# not meet a load balancer whose checks have not yet marked an instance UP.
for n in 1 2; do wait_ready "$n"; wait_lb "$n" UP; done

cat <<MSG

  load balancer   http://127.0.0.1:$LB_PORT/  (the dashboard), http://127.0.0.1:$LB_PORT/api/slow?ms=2000
  app1            api http://127.0.0.1:${API_PORTS[1]}   ops http://127.0.0.1:${OPS_PORTS[1]}/health/ready
  app2            api http://127.0.0.1:${API_PORTS[2]}   ops http://127.0.0.1:${OPS_PORTS[2]}/health/ready
  admin           curl -H 'Authorization: Bearer $KUMIKO_ADMIN_TOKEN' http://127.0.0.1:${OPS_PORTS[1]}/admin/lifecycle
  event stream    curl -N http://127.0.0.1:$LB_PORT/api/events
MSG
# demo:begin (the orders demo; scripts/new-service.sh --bare removes this block)
cat <<MSG
  an order        curl -XPOST http://127.0.0.1:$LB_PORT/api/orders -H 'Content-Type: application/json' \\
                    -d '{"customer":"Ada","items":[{"sku":"tea","qty":2,"priceCents":250}]}'
MSG
# demo:end
cat <<MSG

  watch a drain:  kill -TERM \$(cat $DIR/app1.pid)
  Ctrl+C drains both instances, then stops everything.

MSG
# Until Ctrl+C (the INT trap exits, and the EXIT trap stops everything in
# order), or until both instances have exited by themselves.
for n in 1 2; do wait "$(cat "$DIR/app$n.pid")" || true; done
echo "both instances have exited; stopping the rest"
