#!/usr/bin/env bash
# Usage: scripts/bench-orders.sh   (settings in the environment, below)
#
# POST /api/orders at the limit, three ways, on the same machine and the same
# throwaway PostgreSQL, one after the other:
#   1. the service (one instance; tracing, metrics and the outbox on),
#   2. scripts/refhandler, plain net/http + pgx doing the same insert,
#   3. pgbench running that insert as a transaction,
# each under WORKERS concurrent clients at full speed for DURATION, first with
# PostgreSQL's fsync off (the disk out of the picture: what is measured is the
# processes' CPU), then with fsync on (what a durable commit adds). fsync is a
# reload-time setting, so both modes share one cluster. For each mode it
# prints orders/s, p50/p99, the process's CPU time per order (for the
# service: the request and the delivery of the orders it took) and
# PostgreSQL's over the same span, the outbox backlog when the load stopped,
# and the ratios against the goals.
#
#   scripts/bench-orders.sh                         # 32 workers, 10 s each, both modes
#   WORKERS=8 DURATION=5s scripts/bench-orders.sh
#   FSYNC_MODES=off scripts/bench-orders.sh         # one mode only
#   PROFILE=/tmp/prof scripts/bench-orders.sh       # also keep the service's CPU and allocation
#                                                   # profiles of each mode's run in /tmp/prof/fsync-MODE
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh bench
export PATH="$PATH:$(go env GOPATH)/bin"

WORKERS=${WORKERS:-32} DURATION=${DURATION:-10s} FSYNC_MODES=${FSYNC_MODES:-off on}
LB_PORT=0 PG_PORT=${PG_PORT:-25436} REDIS_PORT=${REDIS_PORT:-26383} REF_PORT=${REF_PORT:-18090}
API_PORT1=${API_PORT1:-18091} OPS_PORT1=${OPS_PORT1:-18092} DIR=${BENCH_DIR:-$PWD/.bench-orders}
# All the load comes from one client address: the per-address rate limit is
# lifted, or the figure would be the limit's.
export KUMIKO_LOG_FORMAT=json KUMIKO_API_RATE_LIMIT=0
source scripts/lib/stack.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" REF_PORT="$REF_PORT" API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

start_services
go build -o "$DIR/refhandler" ./scripts/refhandler
pending() { sql "SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL"; }
echo '{"customer":"Ada Lovelace","items":[{"sku":"tea","qty":2,"priceCents":250},{"sku":"cake","qty":1,"priceCents":400}]}' >"$DIR/order.json"
cat >"$DIR/order.sql" <<'SQL'
BEGIN;
WITH o AS (
  INSERT INTO orders (customer, items, total_cents)
  VALUES ('Ada Lovelace', '[{"sku":"tea","qty":2,"priceCents":250},{"sku":"cake","qty":1,"priceCents":400}]', 900)
  RETURNING id, created_at
)
INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', o.id::text, 'order.created', jsonb_build_object('id', o.id, 'totalCents', 900, 'createdAt', o.created_at) FROM o;
END;
SQL

# attack PORT NAME: full speed from WORKERS clients; leaves NAME.json (vegeta's report).
attack() {
  printf 'POST http://127.0.0.1:%s/api/orders\nContent-Type: application/json\n@%s\n' "$1" "$DIR/order.json" >"$DIR/$2.target"
  vegeta attack -targets="$DIR/$2.target" -rate=0 -max-workers="$WORKERS" -workers="$WORKERS" \
    -duration="$DURATION" -timeout=10s >"$DIR/$2.bin"
  vegeta report -type=json "$DIR/$2.bin" >"$DIR/$2.json"
}
field() { grep -o "\"$2\":[0-9.]*" "$DIR/$1.json" | head -1 | cut -d: -f2; } # field NAME KEY
created() { grep -o '"201":[0-9]*' "$DIR/$1.json" | cut -d: -f2; }

# settle: every measurement starts from the same state. The reference
# handler's and pgbench's events are nobody's to deliver: they are deleted
# before the service starts, or it would deliver them during its own run.
# The checkpoint keeps one run's dirty pages (and the full-page writes after
# a checkpoint) from landing in the next.
settle() {
  [ "$(sql "SELECT to_regclass('outbox_events') IS NOT NULL")" = t ] || return 0 # before the first run's migrations
  sql "DELETE FROM outbox_events WHERE delivered_at IS NULL" >/dev/null
  sql "VACUUM ANALYZE orders, outbox_events" >/dev/null
  sql "CHECKPOINT" >/dev/null
}

# measure MODE: the three measurements with fsync=MODE, and their table.
measure() {
  local mode=$1 prof=
  pg_fsync "$mode"
  settle

  # 1. The service. Its CPU is read before the load and again once the outbox
  #    has delivered every order the load created: the whole pipeline.
  if [ -n "${PROFILE:-}" ]; then
    export KUMIKO_ADMIN_TOKEN=bench-profile-token
    prof=$PROFILE/fsync-$mode && mkdir -p "$prof"
  fi
  start_app 1 "$DIR/app1-$mode.log"
  wait_ready 1
  local app=${app_pids[1]} profiler=
  pprof() { curl -fsS -H "Authorization: Bearer bench-profile-token" -o "$prof/$1" "http://127.0.0.1:$OPS_PORT1/debug/pprof/$2"; }
  if [ -n "$prof" ]; then
    pprof allocs-before.pb.gz allocs
    pprof cpu.pb.gz "profile?seconds=$((${DURATION%s} - 1))" &
    profiler=$!
  fi
  local cpu0 cpu1 pg0 pg1 backlog left
  cpu0=$(cpu_seconds "$app") pg0=$(pg_cpu_seconds)
  attack "$API_PORT1" "service-$mode"
  if [ -n "$prof" ]; then
    wait "$profiler"
    pprof allocs.pb.gz allocs
    cp "$DIR/kumiko-lifecycle-demo" "$prof/"
  fi
  backlog=$(pending)
  for _ in $(seq 1 600); do [ "$(pending)" = 0 ] && break; sleep 0.1; done
  cpu1=$(cpu_seconds "$app") pg1=$(pg_cpu_seconds)
  left=$(pending)
  stop_apps >/dev/null
  settle

  # 2. The reference handler.
  DATABASE_URL="$DATABASE_URL" ADDR="127.0.0.1:$REF_PORT" setsid "$DIR/refhandler" &
  local ref=$! rcpu0 rcpu1 rpg0 rpg1
  until curl -s -o /dev/null "http://127.0.0.1:$REF_PORT/"; do sleep 0.05; done
  rcpu0=$(cpu_seconds "$ref") rpg0=$(pg_cpu_seconds)
  attack "$REF_PORT" "reference-$mode"
  rcpu1=$(cpu_seconds "$ref") rpg1=$(pg_cpu_seconds)
  kill -TERM "$ref" && wait "$ref" || true
  settle

  # 3. pgbench: the same statement in its own transaction, WORKERS clients.
  local tps
  tps=$(pgbench -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -c "$WORKERS" -j 2 -T "${DURATION%s}" -f "$DIR/order.sql" postgres 2>/dev/null |
    awk '/^tps/ { print int($3); exit }')
  settle

  local svc refn svc_rate ref_rate svc_cpu ref_cpu per
  svc=$(created "service-$mode") refn=$(created "reference-$mode")
  svc_rate=$(awk "BEGIN { printf \"%d\", ${svc:-0} / ${DURATION%s} }")
  ref_rate=$(awk "BEGIN { printf \"%d\", ${refn:-0} / ${DURATION%s} }")
  svc_cpu=$(awk "BEGIN { printf \"%.0f\", ($cpu1 - $cpu0) * 1e6 / (${svc:-0} > 0 ? ${svc:-0} : 1) }")
  ref_cpu=$(awk "BEGIN { printf \"%.0f\", ($rcpu1 - $rcpu0) * 1e6 / (${refn:-0} > 0 ? ${refn:-0} : 1) }")
  per() { awk "BEGIN { printf \"%.0f\", ($2 - $1) * 1e6 / (${3:-0} > 0 ? ${3:-0} : 1) }"; } # per START END ORDERS: µs
  line() { # NAME RATE REPORT CPU_US ORDERS PG_US
    local total
    total=$(grep -o '"requests":[0-9]*' "$DIR/$3.json" | cut -d: -f2)
    awk -v n="$1" -v r="$2" -v p50="$(field "$3" 50th)" -v p99="$(field "$3" 99th)" -v cpu="$4" -v o="$5" -v t="$total" -v pg="$6" 'BEGIN {
      printf "  %-10s %6d orders/s   p50 %6.2f ms   p99 %6.2f ms   CPU %5d µs/order (PostgreSQL %4d)   not 201: %d\n",
        n, r, p50 / 1e6, p99 / 1e6, cpu, pg, t - o }'
  }
  local goal=0.75
  [ "$mode" = on ] && goal=0.9
  echo
  echo "fsync=$mode: POST /api/orders, $WORKERS workers, $DURATION each, $(nproc) cores"
  line service "$svc_rate" "service-$mode" "$svc_cpu" "${svc:-0}" "$(per "$pg0" "$pg1" "$svc")"
  line reference "$ref_rate" "reference-$mode" "$ref_cpu" "${refn:-0}" "$(per "$rpg0" "$rpg1" "$refn")"
  printf '  %-10s %6d tps (the same insert as a transaction)\n' pgbench "${tps:-0}"
  printf '  outbox     %d events pending when the load stopped, %d after waiting for delivery\n' "$backlog" "$left"
  awk -v s="$svc_rate" -v r="$ref_rate" -v p="${tps:-0}" -v sc="$svc_cpu" -v rc="$ref_cpu" -v g="$goal" 'BEGIN {
    printf "  ratios     orders/s service/reference %.2f (goal >= %s)   CPU/order service/reference %.2f (goal <= 1.3)   service/pgbench %.2f\n",
      s / (r > 0 ? r : 1), g, sc / (rc > 0 ? rc : 1), s / (p > 0 ? p : 1) }'
  [ -n "$prof" ] && echo "  profiles in $prof: go tool pprof -top $prof/kumiko-lifecycle-demo $prof/cpu.pb.gz" || true
}

for mode in $FSYNC_MODES; do
  case $mode in
  on | off) measure "$mode" ;;
  *) echo "FSYNC_MODES: on and off only, not $mode" >&2 && exit 1 ;;
  esac
done
