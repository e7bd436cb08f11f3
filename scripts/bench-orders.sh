#!/usr/bin/env bash
# POST /api/orders at the limit, three ways, on the same machine and the same
# throwaway PostgreSQL, one after the other:
#   1. the service (one instance; tracing, metrics and the outbox on),
#   2. scripts/refhandler, plain net/http + pgx doing the same insert,
#   3. pgbench running that insert as a transaction,
# each under WORKERS concurrent clients at full speed for DURATION. Prints
# orders/s, p50/p99, the process's CPU time per order (for the service: the
# request and the delivery of the orders it took), the outbox backlog when the
# load stopped, and the ratios against the goals of issue 13.
#
#   scripts/bench-orders.sh                         # 32 workers, 10 s each
#   WORKERS=8 DURATION=5s scripts/bench-orders.sh
#   PROFILE=/tmp/prof scripts/bench-orders.sh       # also keep the service's CPU and
#                                                   # allocation profiles of the run there
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export PATH="$PATH:$(go env GOPATH)/bin"

WORKERS=${WORKERS:-32} DURATION=${DURATION:-10s}
LB_PORT=0 PG_PORT=${PG_PORT:-25436} REDIS_PORT=${REDIS_PORT:-26383} REF_PORT=${REF_PORT:-18090}
API_PORT1=${API_PORT1:-18091} OPS_PORT1=${OPS_PORT1:-18092} DIR=${BENCH_DIR:-$PWD/.bench-orders}
# All the load comes from one client address: the per-address rate limit is
# lifted, or the figure would be the limit's.
export KUMIKO_LOG_FORMAT=json KUMIKO_API_RATE_LIMIT=0
source scripts/lib.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" REF_PORT="$REF_PORT" API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1" || exit 1
trap cleanup EXIT INT TERM

start_services
go build -o "$DIR/refhandler" ./scripts/refhandler
sql() { psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -qAtc "$1"; }
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat"; }
pending() { sql "SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL"; }
echo '{"customer":"Ada Lovelace","items":[{"sku":"tea","qty":2,"priceCents":250},{"sku":"cake","qty":1,"priceCents":400}]}' >"$DIR/order.json"

# attack PORT NAME: full speed from WORKERS clients; leaves NAME.json (vegeta's report).
attack() {
  printf 'POST http://127.0.0.1:%s/api/orders\nContent-Type: application/json\n@%s\n' "$1" "$DIR/order.json" >"$DIR/$2.target"
  vegeta attack -targets="$DIR/$2.target" -rate=0 -max-workers="$WORKERS" -workers="$WORKERS" \
    -duration="$DURATION" -timeout=10s >"$DIR/$2.bin"
  vegeta report -type=json "$DIR/$2.bin" >"$DIR/$2.json"
}
field() { grep -o "\"$2\":[0-9.]*" "$DIR/$1.json" | head -1 | cut -d: -f2; } # field NAME KEY
created() { grep -o '"201":[0-9]*' "$DIR/$1.json" | cut -d: -f2; }

# 1. The service. Its CPU is read before the load and again once the outbox
#    has delivered every order the load created: the whole pipeline.
[ -n "${PROFILE:-}" ] && export KUMIKO_ADMIN_TOKEN=bench-profile-token && mkdir -p "$PROFILE"
start_app 1 "$DIR/app1.log"
wait_ready 1
app=${app_pids[1]}
pprof() { curl -fsS -H "Authorization: Bearer bench-profile-token" -o "$PROFILE/$1" "http://127.0.0.1:$OPS_PORT1/debug/pprof/$2"; }
if [ -n "${PROFILE:-}" ]; then
  pprof allocs-before.pb.gz allocs
  pprof cpu.pb.gz "profile?seconds=$((${DURATION%s} - 1))" &
  prof=$!
fi
cpu0=$(cpu_seconds "$app")
attack "$API_PORT1" service
if [ -n "${PROFILE:-}" ]; then
  wait "$prof"
  pprof allocs.pb.gz allocs
  cp "$DIR/kumiko-lifecycle-demo" "$PROFILE/"
  echo "profiles in $PROFILE: go tool pprof -top $PROFILE/cpu.pb.gz; go tool pprof -sample_index=alloc_space -diff_base $PROFILE/allocs-before.pb.gz -top $PROFILE/allocs.pb.gz"
fi
backlog=$(pending)
for _ in $(seq 1 600); do [ "$(pending)" = 0 ] && break; sleep 0.1; done
cpu1=$(cpu_seconds "$app")
left=$(pending)
stop_apps >/dev/null

# 2. The reference handler.
DATABASE_URL="$DATABASE_URL" ADDR="127.0.0.1:$REF_PORT" setsid "$DIR/refhandler" &
ref=$!
until curl -s -o /dev/null "http://127.0.0.1:$REF_PORT/"; do sleep 0.05; done
rcpu0=$(cpu_seconds "$ref")
attack "$REF_PORT" reference
rcpu1=$(cpu_seconds "$ref")
kill -TERM "$ref" && wait "$ref" || true

# 3. pgbench: the same statement in its own transaction, WORKERS clients.
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
sql "UPDATE outbox_events SET delivered_at = now() WHERE delivered_at IS NULL" >/dev/null # nobody delivers pgbench's
tps=$(pgbench -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -c "$WORKERS" -j 2 -T "${DURATION%s}" -f "$DIR/order.sql" postgres 2>/dev/null |
  awk '/^tps/ { print int($3); exit }')

svc=$(created service) refn=$(created reference)
svc_rate=$(awk "BEGIN { printf \"%d\", ${svc:-0} / ${DURATION%s} }")
ref_rate=$(awk "BEGIN { printf \"%d\", ${refn:-0} / ${DURATION%s} }")
line() { # NAME RATE REPORT CPU_SECONDS ORDERS
  local total
  total=$(grep -o '"requests":[0-9]*' "$DIR/$3.json" | cut -d: -f2)
  awk -v n="$1" -v r="$2" -v p50="$(field "$3" 50th)" -v p99="$(field "$3" 99th)" -v cpu="$4" -v o="$5" -v t="$total" 'BEGIN {
    printf "%-10s %6d orders/s   p50 %6.2f ms   p99 %6.2f ms   CPU %5.0f µs/order   not 201: %d\n",
      n, r, p50 / 1e6, p99 / 1e6, cpu * 1e6 / (o > 0 ? o : 1), t - o }'
}
echo
echo "POST /api/orders, $WORKERS workers, $DURATION each, $(nproc) cores"
line service "$svc_rate" service "$(awk "BEGIN { print $cpu1 - $cpu0 }")" "${svc:-0}"
line reference "$ref_rate" reference "$(awk "BEGIN { print $rcpu1 - $rcpu0 }")" "${refn:-0}"
printf '%-10s %6d tps (the same insert as a transaction)\n' pgbench "${tps:-0}"
printf 'outbox     %d events pending when the load stopped, %d after waiting for delivery\n' "$backlog" "$left"
awk -v s="$svc_rate" -v r="$ref_rate" -v p="${tps:-0}" 'BEGIN {
  printf "ratios     service/reference %.2f (goal >= 0.75)   service/pgbench %.2f\n", s / (r > 0 ? r : 1), s / (p > 0 ? p : 1) }'
