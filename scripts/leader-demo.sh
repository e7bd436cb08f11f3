#!/usr/bin/env bash
# Usage: scripts/leader-demo.sh
#
# Leader election, live: two instances with short TTLs and the outbox purge
# cron ticking every second; the leader is killed with SIGKILL and the
# follower takes over once the lock expires; then the new leader gets SIGTERM
# and hands over at once. Every tick is enqueued exactly once. About 15 s
# once built; Ctrl+C stops everything and exits 130. Ports: PG_PORT
# (25435), REDIS_PORT (26382), API_PORT1/2 (8081/8082), OPS_PORT1/2
# (9091/9092); DEMO_DIR (.leader-demo) holds the instances' logs.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh demo
LB_PORT=0 PG_PORT=${PG_PORT:-25435} REDIS_PORT=${REDIS_PORT:-26382} DIR=${DEMO_DIR:-$PWD/.leader-demo}
export KUMIKO_LEADER_LOCK_TTL=${KUMIKO_LEADER_LOCK_TTL:-3s} KUMIKO_LEADER_RENEW_INTERVAL=${KUMIKO_LEADER_RENEW_INTERVAL:-1s}
export KUMIKO_OUTBOX_PURGE_CRON=${KUMIKO_OUTBOX_PURGE_CRON:-@every 1s} KUMIKO_LINGER=0
source scripts/lib/stack.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" API_PORT1="${API_PORTS[1]}" API_PORT2="${API_PORTS[2]}" \
  OPS_PORT1="${OPS_PORTS[1]}" OPS_PORT2="${OPS_PORTS[2]}" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

leader() { redis-cli -p "$REDIS_PORT" GET kumiko:leader; }
start_services
begin "booting app1, then app2" "logs in $DIR/app1.log and app2.log: a few seconds"
start_app 1 "$DIR/app1.log"
wait_ready 1
start_app 2 "$DIR/app2.log"
wait_ready 2
stage="showing the take-over"
sleep 1
first=$(leader); echo ">>> leader: $first (instance:fencing token)"
victim=${first%%:*}
echo ">>> kill -9 $victim: the follower waits for the lock to expire ($KUMIKO_LEADER_LOCK_TTL)"
n=${victim#app}
# Disowned first: the shell then says nothing when it reaps it (otherwise a
# "Killed" line, whenever it happens to notice, even before reap's wait).
disown "${app_pids[$n]}" 2>/dev/null || true
kill -9 "${app_pids[$n]}"
while kill -0 "${app_pids[$n]}" 2>/dev/null; do sleep 0.05; done
unset 'app_pids[n]'
start=$(date +%s.%N)
while [ "$(leader)" = "$first" ] || [ -z "$(leader)" ]; do sleep 0.05; done
echo ">>> new leader after $(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $start}")s: $(leader)"
echo "    (why the token jumped: every attempt to take the lock first draws the next token (Redis INCR),"
echo "    then tries SET NX; the follower tried every $KUMIKO_LEADER_RENEW_INTERVAL while it waited, and each failed attempt"
echo "    used up a number. Tokens only grow: a newer leader always holds a larger one.)"
second=$(leader); survivor=${second%%:*}
start_app "$n" "$DIR/$victim.log"
wait_ready "$n"
echo ">>> SIGTERM $survivor: it releases the lock and tells the follower"
kill -TERM "$(cat "$DIR/$survivor.pid")"
start=$(date +%s.%N)
while [ "$(leader)" = "$second" ] || [ -z "$(leader)" ]; do sleep 0.01; done
echo ">>> new leader after $(awk "BEGIN{printf \"%.3f\", $(date +%s.%N) - $start}")s: $(leader)"
echo ">>> purge ticks enqueued, each exactly once:"
"$(command -v psql || echo "$pgbin/psql")" -h 127.0.0.1 -p "$PG_PORT" -U postgres -Atc \
  "SELECT count(*) || ' ticks, ' || count(DISTINCT args->>'scheduledAt') || ' distinct' FROM river_job WHERE kind = 'purgeOutbox' AND NOT coalesce((args->>'manual')::bool, false)" postgres
