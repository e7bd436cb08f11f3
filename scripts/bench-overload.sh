#!/usr/bin/env bash
# Usage: scripts/bench-overload.sh   (settings in the environment, below)
#
# One instance past its capacity (issue 31), in one run, PostgreSQL with
# fsync off (the disk out of the picture: the two cores are the limit):
#   1. its peak sustainable rate P: WORKERS clients at full speed for DURATION,
#      the orders answered 201 per second (closed loop: the clients wait for
#      each answer, so the instance is never asked for more than it gives);
#   2. 3×P, 2×P and 5×P for DURATION each, open loop (a request every 1/rate
#      seconds whatever the answers, as real clients arrive), on the same
#      instance;
#   3. a fresh instance SIGKILLed KILL_AFTER into 2×P;
#   4. what refusing costs: the CPU per refused request of a fresh instance
#      with its limit held at 1, from P to 3×P, against that of bare net/http
#      answering every request 503 (overload -refuse) on the same cores. The
#      second is the floor any Go service pays here to refuse; at 3×P the
#      2×P refusals cost 2×P times it, taken from the core P had.
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
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh demo
export PATH="$PATH:$(go env GOPATH)/bin"

WORKERS=${WORKERS:-32} DURATION=${DURATION:-10s} MULTIPLES=${MULTIPLES:-3 2 5} KILL_AFTER=${KILL_AFTER:-3s}
LB_PORT=0 PG_PORT=${PG_PORT:-25437} REDIS_PORT=${REDIS_PORT:-26384}
API_PORT1=${API_PORT1:-18093} OPS_PORT1=${OPS_PORT1:-18094} REFUSE_PORT=${REFUSE_PORT:-18097} DIR=${BENCH_DIR:-$PWD/.bench-overload}
# All the load comes from one client address: the per-address rate limit is
# lifted, or the figure would be the limit's.
export KUMIKO_LOG_FORMAT=json KUMIKO_API_RATE_LIMIT=0
source scripts/lib/stack.sh
check_ports PG_PORT="$PG_PORT" REDIS_PORT="$REDIS_PORT" API_PORT1="$API_PORT1" OPS_PORT1="$OPS_PORT1" REFUSE_PORT="$REFUSE_PORT" || exit 1
trap cleanup EXIT
trap on_signal INT TERM

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

# 1. The peak rate, and the instance's CPU per order at it.
cpu0=$(cpu_seconds "$pid")
out=$(load -workers "$WORKERS" -pid "$pid")
order_us=$(awk -v c0="$cpu0" -v c1="$(cpu_seconds "$pid")" -v n="$(val created "$out")" 'BEGIN { printf "%.0f", (c1 - c0) / (n > 0 ? n : 1) * 1e6 }')
P=$(val goodput "$out") p99P=$(val p99_created_ms "$out")
printf '\nP (%s workers, closed loop): %s orders/s, %s µs of the instance'"'"'s CPU per order\n  %s\n' "$WORKERS" "$P" "$order_us" "$out"
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

# 4. What refusing costs: CPU seconds per request, in µs. With the limit at 1
#    the instance works one order at a time, at a cost per order of its own;
#    the same ~number of orders at P and at 3×P, so the CPU the two runs
#    differ by is the refusals they differ by.
rate=$(awk -v p="$P" 'BEGIN { printf "%d", p * 3 }')
export KUMIKO_API_CONCURRENCY_MIN=1 KUMIKO_API_CONCURRENCY_MAX=1
start_app 1 "$DIR/app1-refuse.log"
unset KUMIKO_API_CONCURRENCY_MIN KUMIKO_API_CONCURRENCY_MAX
wait_ready 1
pid=${app_pids[1]}
for r in "$P" "$rate"; do
  c0=$(cpu_seconds "$pid")
  o=$(load -rate "$r") || verdict=1
  refusing+=("$(cpu_seconds "$pid") $c0 $(val created "$o") $(val shed "$o")")
  settle
done
stop_apps >/dev/null
# marginal_us reads two lines "cpu_end cpu_start created refused" and prints
# the CPU per refusal the second run spent beyond the first, in µs.
marginal_us() {
  awk -v o="$order_us" '{ cpu[NR] = $1 - $2; created[NR] = $3; shed[NR] = $4 }
    END { printf "%.0f", (cpu[2] - cpu[1] - (created[2] - created[1]) * o / 1e6) / (shed[2] - shed[1] > 0 ? shed[2] - shed[1] : 1) * 1e6 }'
}
shed_us=$(printf '%s\n' "${refusing[@]}" | marginal_us)
read -r _ _ created1 shed1 <<<"${refusing[0]}"
read -r _ _ created3 shed3 <<<"${refusing[1]}"
"$DIR/overload" -refuse "127.0.0.1:$REFUSE_PORT" &
refuser=$!
server_pids+=("$refuser") # cleanup stops it if this script fails first
for _ in $(seq 1 50); do curl -s -o /dev/null "http://127.0.0.1:$REFUSE_PORT/" && break; sleep 0.1; done
curl -s -o /dev/null "http://127.0.0.1:$REFUSE_PORT/" || { echo "overload -refuse does not answer on port $REFUSE_PORT" >&2; exit 1; }
for r in "$P" "$rate"; do
  c0=$(cpu_seconds "$refuser")
  o=$("${pin[@]}" "$DIR/overload" -url "http://127.0.0.1:$REFUSE_PORT" -duration "$DURATION" -rate "$r") || true
  bare+=("$(cpu_seconds "$refuser") $c0 0 $(val sent "$o")")
done
bare_us=$(printf '%s\n' "${bare[@]}" | marginal_us)
kill "$refuser" && wait "$refuser" || true
printf '\nWhat refusing costs (a process'"'"'s CPU per refusal, from P to 3×P):\n  the instance, its limit held at 1: %s µs (at P %s refused and %s created, at 3×P = %s/s %s and %s)\n' \
  "$shed_us" "$shed1" "$created1" "$rate" "$shed3" "$created3"
printf '  bare net/http answering 503 (overload -refuse): %s µs\n' "$bare_us"
awk -v p="$P" -v s="$shed_us" -v b="$bare_us" 'BEGIN {
  printf "  at 3×P the 2×P refusals take %.2f of a core (bare net/http: %.2f), from the core P had\n", 2 * p * s / 1e6, 2 * p * b / 1e6 }'
exit "$verdict"
