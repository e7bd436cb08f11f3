#!/usr/bin/env bash
# Leader election, live: two instances with short TTLs and the outbox purge
# cron ticking every second; the leader is killed with SIGKILL and the
# follower takes over once the lock expires; then the new leader gets SIGTERM
# and hands over at once. Every tick is enqueued exactly once.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
LB_PORT=0 PG_PORT=${PG_PORT:-25435} REDIS_PORT=${REDIS_PORT:-26382} DIR=${DEMO_DIR:-$PWD/.leader-demo}
export KUMIKO_LEADER_LOCK_TTL=${KUMIKO_LEADER_LOCK_TTL:-3s} KUMIKO_LEADER_RENEW_INTERVAL=${KUMIKO_LEADER_RENEW_INTERVAL:-1s}
export KUMIKO_OUTBOX_PURGE_CRON=${KUMIKO_OUTBOX_PURGE_CRON:-@every 1s} KUMIKO_LINGER=0
source scripts/lib.sh
trap cleanup EXIT INT TERM

leader() { redis-cli -p "$REDIS_PORT" GET kumiko:leader; }
start_services
start_app 1 "$DIR/app1.log"
wait_ready 1
start_app 2 "$DIR/app2.log"
wait_ready 2
sleep 1
first=$(leader); echo ">>> leader: $first (instance:fencing token)"
victim=${first%%:*}
echo ">>> kill -9 $victim: the follower waits for the lock to expire ($KUMIKO_LEADER_LOCK_TTL)"
kill -9 "$(cat "$DIR/$victim.pid")"
start=$(date +%s.%N)
while [ "$(leader)" = "$first" ] || [ -z "$(leader)" ]; do sleep 0.05; done
echo ">>> new leader after $(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $start}")s: $(leader)"
second=$(leader); survivor=${second%%:*}
other=$([ "$victim" = app1 ] && echo 1 || echo 2)
start_app "$other" "$DIR/$victim.log"
wait_ready "$other"
echo ">>> SIGTERM $survivor: it releases the lock and tells the follower"
kill -TERM "$(cat "$DIR/$survivor.pid")"
start=$(date +%s.%N)
while [ "$(leader)" = "$second" ] || [ -z "$(leader)" ]; do sleep 0.01; done
echo ">>> new leader after $(awk "BEGIN{printf \"%.3f\", $(date +%s.%N) - $start}")s: $(leader)"
echo ">>> purge ticks enqueued, each exactly once:"
"$(command -v psql || echo "$pgbin/psql")" -h 127.0.0.1 -p "$PG_PORT" -U postgres -Atc \
  "SELECT count(*) || ' ticks, ' || count(DISTINCT args->>'scheduledAt') || ' distinct' FROM river_job WHERE kind = 'purgeOutbox' AND NOT coalesce((args->>'manual')::bool, false)" postgres
