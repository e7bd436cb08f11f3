#!/usr/bin/env bash
# Usage: scripts/bench-followup.sh   (settings in the environment, below)
#
# The work after an order (issue 36), one instance, PostgreSQL with fsync
# off, S3 (versitygw) and a Meilisearch stand-in (scripts/meilistandin)
# answering in MEILI_LATENCY. Every order is followed up twice: indexed
# (indexOrder) and its receipt written (writeReceipt); a job carries the
# orders of one delivery batch. In one run it prints:
#   1. the order capacity P: WORKERS clients at full speed for DURATION;
#   2. the follow-up capacity: BACKLOG orders written straight into the
#      tables while the instance is stopped, then delivered and followed up
#      by it with no orders coming: follow-ups/s and River jobs/s;
#   3. River on its own on the same database (scripts/riverbench, what
#      `river bench` measures: jobs that do nothing) and the ratio;
#   4. P/2 for SUSTAIN, open loop: every 5 s the follow-ups waiting (the
#      events not yet delivered count twice) and what that is in seconds of
#      work at the capacity of 2. Target: ≤ 5 s at the end;
#   5. delivery by one and by two pollers from a backlog of DELIVERY events
#      (BenchmarkOutboxThroughput, rtt=0: no added latency). Target: ≥ 1.6×;
#      it prints the most the box's cores allow at one poller's cost per event.
#
#   scripts/bench-followup.sh
#   SUSTAIN=20s BACKLOG=10000 DELIVERY=0 scripts/bench-followup.sh   # shorter; DELIVERY=0 skips 5.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh bench
export PATH="$PATH:$(go env GOPATH)/bin"

WORKERS=${WORKERS:-32} DURATION=${DURATION:-10s} SUSTAIN=${SUSTAIN:-60s} BACKLOG=${BACKLOG:-30000}
DELIVERY=${DELIVERY:-60000} MEILI_LATENCY=${MEILI_LATENCY:-5ms}
LB_PORT=0 PG_PORT=${PG_PORT:-25438} REDIS_PORT=${REDIS_PORT:-26385} S3_PORT=${S3_PORT:-27070} MEILI_PORT=${MEILI_PORT:-27700}
API_PORT1=${API_PORT1:-18095} OPS_PORT1=${OPS_PORT1:-18096} DIR=${BENCH_DIR:-$PWD/.bench-followup}
export KUMIKO_LOG_FORMAT=json KUMIKO_API_RATE_LIMIT=0 # one client address: the per-address limit is lifted
source scripts/lib/stack.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" S3_PORT="$S3_PORT" MEILI_PORT="$MEILI_PORT" \
  API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

start_services
for tool in overload meilistandin riverbench; do go build -o "$DIR/$tool" "./scripts/$tool"; done
pg_fsync off
mkdir -p "$DIR/s3"
ROOT_ACCESS_KEY=bench-access ROOT_SECRET_KEY=bench-secret-key setsid versitygw --keep-alive --quiet --port "127.0.0.1:$S3_PORT" posix "$DIR/s3" >"$DIR/s3.log" 2>&1 &
s3_pid=$! && server_pids+=($!)
setsid "$DIR/meilistandin" -addr "127.0.0.1:$MEILI_PORT" -latency "$MEILI_LATENCY" >"$DIR/meili.log" 2>&1 &
meili_pid=$! && server_pids+=($!)
export S3_ENDPOINT="127.0.0.1:$S3_PORT" S3_ACCESS_KEY=bench-access S3_SECRET_KEY=bench-secret-key MEILI_URL="http://127.0.0.1:$MEILI_PORT"
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$S3_PORT") 2>/dev/null && break; sleep 0.1; done

val() { grep -o "$1=[0-9.]*" <<<"$2" | head -1 | cut -d= -f2; } # val KEY LINE
load() { "$DIR/overload" -url "http://127.0.0.1:$API_PORT1" "$@"; }
# waiting: the follow-ups not done yet: two for every event not yet delivered,
# one for every order in a job of either kind not yet completed.
waiting() {
  sql "SELECT 2 * (SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL)
    + (SELECT coalesce(sum(jsonb_array_length(args->'orderIds')), 0) FROM river_job
       WHERE kind IN ('indexOrder', 'writeReceipt') AND state NOT IN ('completed', 'cancelled', 'discarded'))"
}
done_jobs() { sql "SELECT count(*), coalesce(sum(jsonb_array_length(args->'orderIds')), 0) FROM river_job WHERE kind IN ('indexOrder', 'writeReceipt') AND state = 'completed'"; }
# settle: wait until every follow-up is done (at most $1 s), printing how long it took.
settle() {
  local start=$EPOCHREALTIME
  for _ in $(seq 1 $(($1 * 10))); do
    [ "$(waiting)" = 0 ] && break
    sleep 0.1
  done
  awk -v s="$start" -v e="$EPOCHREALTIME" 'BEGIN { printf "%.2f", e - s }'
}

start_app 1 "$DIR/app1.log"
wait_ready 1
echo "one instance, fsync off, $(nproc) cores, S3 versitygw, Meilisearch stand-in answering in $MEILI_LATENCY; load average $(cut -d' ' -f1-3 /proc/loadavg)"

# 1. The order capacity.
out=$(load -workers "$WORKERS" -duration "$DURATION")
P=$(val goodput "$out")
printf '\n1. order capacity P (%s workers, closed loop, %s): %s orders/s\n' "$WORKERS" "$DURATION" "$P"
printf '   follow-ups waiting when the load stopped: %s; all done %s s later\n' "$(waiting)" "$(settle 300)"

# 2. The follow-up capacity, from a backlog.
stop_apps >/dev/null
sql "WITH o AS (INSERT INTO orders (customer, items, total_cents)
    SELECT 'Ada Lovelace', '[{\"sku\":\"tea\",\"qty\":2,\"priceCents\":250},{\"sku\":\"cake\",\"qty\":1,\"priceCents\":400}]', 900
    FROM generate_series(1, $BACKLOG) RETURNING id)
  INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
  SELECT 'order', o.id::text, 'order.created', '{\"status\":\"created\",\"totalCents\":900,\"itemCount\":2}' FROM o" >/dev/null
read -r jobs0 items0 <<<"$(done_jobs | tr '|' ' ')"
since=$(sql "SELECT now()")
cpu0=($(box_busy_seconds) $(pg_cpu_seconds) $(cpu_seconds "$s3_pid") $(cpu_seconds "$meili_pid"))
start_app 1 "$DIR/app1.log"
secs=$(settle 600)
cpu1=($(box_busy_seconds) $(pg_cpu_seconds) $(cpu_seconds "$s3_pid") $(cpu_seconds "$meili_pid") $(cpu_seconds "${app_pids[1]}"))
read -r jobs1 items1 <<<"$(done_jobs | tr '|' ' ')"
C=$(awk -v n="$((items1 - items0))" -v s="$secs" 'BEGIN { printf "%.0f", n / s }')
J=$(awk -v n="$((jobs1 - jobs0))" -v s="$secs" 'BEGIN { printf "%.0f", n / s }')
printf '\n2. follow-up capacity: %s orders (%s follow-ups) delivered and followed up in %s s (the boot included)\n' \
  "$BACKLOG" "$((items1 - items0))" "$secs"
printf '   %s follow-ups/s in %s River jobs/s (%s follow-ups a job)\n' "$C" "$J" "$(awk -v a="$((items1 - items0))" -v b="$((jobs1 - jobs0))" 'BEGIN { printf "%.1f", a / b }')"
sql "SELECT kind, count(*), sum(jsonb_array_length(args->'orderIds')),
    round(extract(epoch FROM max(finalized_at) - min(attempted_at))::numeric, 2),
    round(extract(epoch FROM percentile_cont(0.5) WITHIN GROUP (ORDER BY finalized_at - attempted_at))::numeric * 1000, 1)
  FROM river_job WHERE kind IN ('indexOrder', 'writeReceipt') AND finalized_at > '$since' GROUP BY kind ORDER BY kind" |
  while IFS='|' read -r kind n items secs p50; do
    printf '   %-12s %4s jobs, %6s orders, worked within %5s s; a job took %s ms (p50)\n' "$kind" "$n" "$items" "$secs" "$p50"
  done
# Where the two cores went meanwhile: who sets the pace.
awk -v s="$secs" -v n="$(nproc)" -v b="${cpu1[0]} ${cpu0[0]}" -v p="${cpu1[1]} ${cpu0[1]}" -v o="${cpu1[2]} ${cpu0[2]}" \
  -v m="${cpu1[3]} ${cpu0[3]}" -v a="${cpu1[4]}" 'function d(x, f) { split(x, f, " "); return (f[1] - f[2]) / s }
  BEGIN { printf "   cores busy meanwhile: %.2f of %d — the service %.2f, PostgreSQL %.2f, versitygw %.2f, the stand-in %.2f\n",
    d(b), n, a / s, d(p), d(o), d(m) }'

# 3. River on its own, same database, the instance stopped.
stop_apps >/dev/null
rb=$(DATABASE_URL="$DATABASE_URL" "$DIR/riverbench" -jobs 50000)
R=$(val jobs_per_s "$rb")
printf '\n3. River alone (scripts/riverbench, jobs that do nothing): %s jobs/s\n   %s\n' "$R" "$rb"
awk -v c="$C" -v r="$R" 'BEGIN { printf "   follow-ups/s ÷ River jobs/s = %.2f (target ≥ 0.5)\n", c / r }'

# 4. Half the order capacity, sustained.
start_app 1 "$DIR/app1.log"
wait_ready 1
rate=$(awk -v p="$P" 'BEGIN { printf "%d", p / 2 }')
printf '\n4. P/2 = %s orders/s for %s (open loop); follow-ups waiting every 5 s:\n' "$rate" "$SUSTAIN"
(
  t=0
  while sleep 5; do
    t=$((t + 5))
    w=$(waiting)
    awk -v t="$t" -v w="$w" -v c="$C" 'BEGIN { printf "   %3d s  %7d waiting = %5.1f s of work\n", t, w, w / c }'
  done
) &
sampler=$!
out=$(load -rate "$rate" -duration "$SUSTAIN")
kill "$sampler" 2>/dev/null || true
wait "$sampler" 2>/dev/null || true
w=$(waiting)
printf '   load: %s\n' "$out"
awk -v w="$w" -v c="$C" 'BEGIN { printf "   at the end: %d follow-ups waiting = %.1f s of work (target ≤ 5)\n", w, w / c }'
printf '   all done %s s later\n' "$(settle 300)"
stop_apps >/dev/null

# 5. Delivery, one poller against two.
if [ "$DELIVERY" != 0 ]; then
  printf '\n5. delivery from a backlog of %s events, no added latency (go test -bench OutboxThroughput):\n' "$DELIVERY"
  bench=$(KUMIKO_REQUIRE_SERVICES=1 go test -run '^$' -bench 'OutboxThroughput/rtt=0s/pollers=[12]$' -benchtime "${DELIVERY}x" . | grep '^Benchmark')
  sed 's/^Benchmark/   /' <<<"$bench"
  one=$(grep 'pollers=1' <<<"$bench" | grep -o '[0-9.]* events/s' | cut -d' ' -f1)
  two=$(grep 'pollers=2' <<<"$bench" | grep -o '[0-9.]* events/s' | cut -d' ' -f1)
  busy=$(grep 'pollers=1' <<<"$bench" | grep -o '[0-9.]* box-cores-busy' | cut -d' ' -f1)
  # Two pollers that each cost what one costs per event can deliver at most
  # the box's cores ÷ the cores one poller keeps busy times as much.
  awk -v a="$one" -v b="$two" -v n="$(nproc)" -v busy="$busy" 'BEGIN {
    printf "   two ÷ one = %.2f (target ≥ 1.6); at one poller'"'"'s cost per event this box allows %d ÷ %.2f = %.2f\n", b / a, n, busy, n / busy }'
fi
