#!/usr/bin/env bash
# Usage: scripts/demo.sh
#        scripts/demo.sh start app1|app2
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
#   curl localhost:8081/api/slow?ms=5000 &      # on app1's own API port
#   kill -TERM "$(cat .demo/app1.pid)"          # watch app1 drain while app2 serves
#   scripts/demo.sh start app1                  # bring it back
#
# `start appN`, from a second terminal while the demo runs: the demo starts
# appN again (an instance that has exited: drained or killed), with the same
# ports and settings, against the same PostgreSQL and Redis; its log goes to
# the demo's terminal and .demo/appN.log. The command waits until appN is
# ready and HAProxy sends it requests again, then exits 0; it starts nothing
# itself, so the demo's Ctrl+C still stops everything. It finds the demo in
# DEMO_DIR: give it the demo's, if that was set.
#
# Ports: LB_PORT (8080), PG_PORT (25432), REDIS_PORT (26379), API_PORT1/2
# (8081/8082), OPS_PORT1/2 (9091/9092); DEMO_DIR (.demo) holds logs and data.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
DIR=${DEMO_DIR:-$PWD/.demo}
case "$*" in
"start app1" | "start app2")
  # stack.sh's functions, then the running demo's pids and ports; no trap:
  # this command owns nothing it could stop.
  source scripts/lib/stack.sh
  [ ! -f "$DIR/demo.run" ] || source "$DIR/demo.run"
  request_start "${2#app}"
  exit
  ;;
"") ;;
*) echo "usage: scripts/demo.sh, or scripts/demo.sh start app1|app2 while it runs (--help)" >&2 && exit 2 ;;
esac
scripts/install-deps.sh demo

LB_PORT=${LB_PORT:-8080} PG_PORT=${PG_PORT:-25432} REDIS_PORT=${REDIS_PORT:-26379}
source scripts/lib/stack.sh
check_ports LB_PORT="$LB_PORT" PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" \
  API_PORT1="${API_PORTS[1]}" API_PORT2="${API_PORTS[2]}" OPS_PORT1="${OPS_PORTS[1]}" OPS_PORT2="${OPS_PORTS[2]}" || exit 1
trap cleanup EXIT
trap on_signal INT TERM
trap on_start_request USR1

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
# What `scripts/demo.sh start appN` needs to find this demo from another terminal.
echo "demo_pid=$$ lb_pid=$lb_pid LB_PORT=$LB_PORT API_PORTS=(${API_PORTS[*]}) OPS_PORTS=(${OPS_PORTS[*]})" >"$DIR/demo.run"
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
  bring it back:  scripts/demo.sh start app1    (from another terminal)
  Ctrl+C drains both instances, then stops everything.

MSG
# Until Ctrl+C (on_signal exits, and cleanup drains and stops everything in
# order), or until no instance runs any more. An instance that exits is said
# at once; `scripts/demo.sh start appN` (on_start_request) may start it again
# meanwhile, and it is watched here like the others.
while ((${#app_pids[@]})); do
  for n in "${!app_pids[@]}"; do
    [ -z "${app_pids[$n]:-}" ] || kill -0 "${app_pids[$n]}" 2>/dev/null || app_exited "$n"
  done
  sleep 0.2
done
echo "no instance runs any more; stopping the rest"
