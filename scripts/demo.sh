#!/usr/bin/env bash
# Usage: scripts/demo.sh
#
# The demo on a machine without Docker: throwaway PostgreSQL and Redis, two
# instances (app1, app2) behind HAProxy, which takes an instance out of the
# pool as soon as its /health/ready answers 503. Installs what it runs when
# missing (PostgreSQL, Redis, HAProxy, curl, jq), says each step as it begins
# (the first build compiles everything: 4 min on a busy two-core machine),
# and prints a banner once HAProxy's checks pass on both instances (about 10 s
# later, the build cached).
#
# Ctrl+C before the banner stops whatever started, removes .demo/ and exits
# 130 ("interrupted while …"). Ctrl+C after it drains both instances (their
# drain log is printed), then stops HAProxy, Redis and PostgreSQL, removes
# .demo/ and exits 0; Ctrl+C a second time cuts the drain short (exit 1). A
# part that fails to start (an instance with a bad setting, a port taken)
# stops the demo within a second, with its last log lines; the logs are kept.
#
#   curl localhost:8080/api/slow?ms=2000        # through the load balancer
#   kill -TERM "$(cat .demo/app1.pid)"          # watch app1 drain while app2 serves
#
# Ports: LB_PORT (8080), PG_PORT (25432), REDIS_PORT (26379), API_PORT1/2
# (8081/8082), OPS_PORT1/2 (9091/9092); DEMO_DIR (.demo) holds logs and data.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh demo

LB_PORT=${LB_PORT:-8080} PG_PORT=${PG_PORT:-25432} REDIS_PORT=${REDIS_PORT:-26379} DIR=${DEMO_DIR:-$PWD/.demo}
source scripts/lib/stack.sh
check_ports LB_PORT="$LB_PORT" PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" \
  API_PORT1="${API_PORTS[1]}" API_PORT2="${API_PORTS[2]}" OPS_PORT1="${OPS_PORTS[1]}" OPS_PORT2="${OPS_PORTS[2]}" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

start_services
export KUMIKO_ADMIN_TOKEN="${KUMIKO_ADMIN_TOKEN:-demo-admin-token-change-me}"
begin "booting app1 and app2" "api :${API_PORTS[1]} and :${API_PORTS[2]}, ops :${OPS_PORTS[1]} and :${OPS_PORTS[2]}: a few seconds"
start_app 1
start_app 2
wait_ready 1 2
# The banner comes once HAProxy routes to both: a request pasted at once must
# not meet a load balancer whose checks have not yet marked an instance UP.
begin "waiting for HAProxy" "on :$LB_PORT, until it marks both instances UP: a second or two"
start_lb
wait_lb 1 UP
wait_lb 2 UP

stage=running
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
# Until Ctrl+C (on_signal exits, and cleanup drains and stops everything in
# order), or until both instances have exited by themselves.
for n in 1 2; do
  reap "${app_pids[$n]}"
  wait "${prefixer_pids[$n]}" 2>/dev/null || true # its last lines first
  echo "app$n exited with code $reaped"
  unset 'app_pids[n]'
done
echo "both instances have exited; stopping the rest"
