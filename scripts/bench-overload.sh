#!/usr/bin/env bash
# One instance past its capacity (issue 31), in one run, PostgreSQL with
# fsync off (the disk out of the picture: the two cores are the limit):
#   1. its peak sustainable rate P: WORKERS clients at full speed for DURATION,
#      the orders answered 201 per second (closed loop: the clients wait for
#      each answer, so the instance is never asked for more than it gives);
#   2. 3×P, 2×P and 5×P for DURATION each, open loop (a request every 1/rate
#      seconds whatever the answers, as real clients arrive), on the same
#      instance;
#   3. a fresh instance SIGKILLed KILL_AFTER into 2×P.
# Every request carries an Idempotency-Key of its own (scripts/overload), so
# at every rate the orders stored are compared with the answers: stored must
# equal the 201s; after the kill, stored ⊆ 201 ∪ in flight. For each rate it
# prints goodput, p99 of the shed answers (503) and of the admitted ones
# (201), the instance's RSS at most, and the targets: goodput at 3×P ≥ 0.9×P,
# p99 shed ≤ 20 ms, p99 admitted ≤ 3× its p99 at P.
#
#   scripts/bench-overload.sh
#   WORKERS=64 DURATION=5s MULTIPLES="3 5" scripts/bench-overload.sh
#
# The load tool gets a core of its own (LOAD_CPUS, the last one by default),
# as a load generator on another machine would; the instance, PostgreSQL and
# Redis share the others (SUT_CPUS). Sharing them, the tool took 0.28 of a
# core at P and 0.75 at 3×P on 2 cores: 3×P then also cost the instance the
# CPU it had at P, and the figures measured the tool's share. The tool prints
# its own CPU (load_cpu, in cores): at 1 it is the bottleneck, and the figures
# past that rate are its own. PIN=0 shares every core.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export PATH="$PATH:$(go env GOPATH)/bin"

WORKERS=${WORKERS:-32} DURATION=${DURATION:-10s} MULTIPLES=${MULTIPLES:-3 2 5} KILL_AFTER=${KILL_AFTER:-3s}
LB_PORT=0 PG_PORT=${PG_PORT:-25437} REDIS_PORT=${REDIS_PORT:-26384}
API_PORT1=${API_PORT1:-18093} OPS_PORT1=${OPS_PORT1:-18094} DIR=${BENCH_DIR:-$PWD/.bench-overload}
# All the load comes from one client address: the per-address rate limit is
# lifted, or the figure would be the limit's.
export KUMIKO_LOG_FORMAT=json KUMIKO_API_RATE_LIMIT=0
source scripts/lib.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1" || exit 1
trap cleanup EXIT INT TERM

cores=$(nproc)
pin=()
if [ "${PIN:-1}" != 0 ] && [ "$cores" -ge 2 ]; then
  SUT_CPUS=${SUT_CPUS:-0-$((cores - 2))} LOAD_CPUS=${LOAD_CPUS:-$((cores - 1))}
  taskset -cp "$SUT_CPUS" $$ >/dev/null # everything started from here on inherits it
  pin=(taskset -c "$LOAD_CPUS")
fi
start_services
go build -o "$DIR/overload" ./scripts/overload
pg_fsync off
pending() { sql "SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL"; }
# settle: the deliveries of one rate's orders must not run in the next one's.
settle() { for _ in $(seq 1 300); do [ "$(pending)" = 0 ] && return; sleep 0.1; done; }
val() { grep -o "$1=[0-9.]*" <<<"$2" | head -1 | cut -d= -f2; } # val KEY LINE
load() { "${pin[@]}" "$DIR/overload" -url "http://127.0.0.1:$API_PORT1" -metrics "http://127.0.0.1:$OPS_PORT1/metrics" -duration "$DURATION" "$@"; }

start_app 1 "$DIR/app1.log"
wait_ready 1
pid=${app_pids[1]}
echo "one instance, fsync off, $cores cores (instance, PostgreSQL, Redis on ${SUT_CPUS:-all}; the load tool on ${LOAD_CPUS:-all}), load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"

# 1. The peak rate.
out=$(load -workers "$WORKERS" -pid "$pid")
P=$(val goodput "$out") p99P=$(val p99_created_ms "$out")
printf '\nP (%s workers, closed loop): %s orders/s\n  %s\n' "$WORKERS" "$P" "$out"
settle

# 2. Multiples of P, open loop.
verdict=0
for m in $MULTIPLES; do
  rate=$(awk -v p="$P" -v m="$m" 'BEGIN { printf "%d", p * m }')
  out=$(load -rate "$rate" -pid "$pid") || verdict=1
  printf '\n%s×P = %s/s (open loop):\n  %s\n' "$m" "$rate" "$out"
  awk -v m="$m" -v p="$P" -v p99P="$p99P" -v good="$(val goodput "$out")" -v shed="$(val p99_shed_ms "$out")" \
    -v adm="$(val p99_created_ms "$out")" -v rss="$(val max_rss_mb "$out")" -v cpu="$(val load_cpu "$out")" 'BEGIN {
    printf "  goodput %.2f×P (target at 3×P ≥ 0.9)   p99 shed %.1f ms (≤ 20)   p99 admitted %.1f ms = %.1f× its p99 at P (≤ 3)   RSS ≤ %d MB   load tool %.2f cores%s\n",
      good / p, shed, adm, adm / (p99P > 0 ? p99P : 1), rss, cpu, (cpu >= 0.95 ? " (saturated: the figures are the tool'\''s)" : "") }'
  settle
done
stop_apps >/dev/null

# 3. SIGKILL mid-load: a fresh instance on the same database.
start_app 1 "$DIR/app1-kill.log"
wait_ready 1
pid=${app_pids[1]}
rate=$(awk -v p="$P" 'BEGIN { printf "%d", p * 2 }')
out=$(load -rate "$rate" -duration "$((${KILL_AFTER%s} + 3))s" -kill "$pid" -kill-after "$KILL_AFTER") || verdict=1
printf '\n2×P = %s/s, SIGKILL after %s:\n  %s\n' "$rate" "$KILL_AFTER" "$out"
wait "$pid" 2>/dev/null || true
app_pids=()
exit "$verdict"
