#!/usr/bin/env bash
# A rolling deploy under load, without Docker: two instances behind HAProxy,
# a steady load (vegeta) through the load balancer, and each instance in turn
# stopped with SIGTERM and started again, as an orchestrator would. Prints
# requests sent, failed, and latency percentiles for the steady state and for
# the roll; exits 1 when any request failed.
#
# HAProxy is strict: no retries, no redispatch.
#
#   scripts/rolling-deploy.sh                      # 500 requests/s of GET /api/slow?ms=5, 10s steady, then the roll
#   RATE=200 STEADY=2s scripts/rolling-deploy.sh   # shorter (what CI runs)
#   LOAD=orders RATE=1000 scripts/rolling-deploy.sh  # 80 % GET /api/orders/{id}, 20 % POST /api/orders
#   KUMIKO_LINGER=0 scripts/rolling-deploy.sh      # see what the linger buys
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
export PATH="$PATH:$(go env GOPATH)/bin"

RATE=${RATE:-500} STEADY=${STEADY:-10s} LOAD=${LOAD:-slow}
LB_PORT=${LB_PORT:-18080} PG_PORT=${PG_PORT:-25433} REDIS_PORT=${REDIS_PORT:-26380} DIR=${ROLL_DIR:-$PWD/.rolling}
LB_CHECK_INTERVAL=${LB_CHECK_INTERVAL:-250ms}
export KUMIKO_LINGER=${KUMIKO_LINGER:-1s} KUMIKO_LOG_FORMAT=json LB_STRICT=1
# All the load comes from one address (vegeta's), which the per-address rate
# limit would otherwise cut at KUMIKO_API_RATE_LIMIT requests/s.
export KUMIKO_API_RATE_LIMIT=${KUMIKO_API_RATE_LIMIT:-0}
source scripts/lib.sh
trap cleanup EXIT INT TERM

start_services
start_app 1 "$DIR/app1.log"
start_app 2 "$DIR/app2.log"
wait_ready 1 && wait_ready 2
start_lb
wait_lb 1 UP && wait_lb 2 UP

lb="http://127.0.0.1:$LB_PORT"
case $LOAD in
slow) echo "GET $lb/api/slow?ms=5" >"$DIR/targets" ;;
orders)
  # 40 orders to read, then a round of 4 reads to each write, in vegeta's JSON
  # target format (a POST body is base64).
  body='{"customer":"Ada","items":[{"sku":"tea","qty":2,"priceCents":250}]}'
  ids=()
  for _ in $(seq 1 40); do
    ids+=("$(curl -fsS -XPOST "$lb/api/orders" -H 'Content-Type: application/json' -d "$body" | grep -o '"id":"[^"]*"' | cut -d'"' -f4)")
  done
  b64=$(printf '%s' "$body" | base64 -w0)
  : >"$DIR/targets"
  for i in "${!ids[@]}"; do
    echo "{\"method\":\"GET\",\"url\":\"$lb/api/orders/${ids[$i]}\"}" >>"$DIR/targets"
    if ((i % 4 == 3)); then
      echo "{\"method\":\"POST\",\"url\":\"$lb/api/orders\",\"body\":\"$b64\",\"header\":{\"Content-Type\":[\"application/json\"]}}" >>"$DIR/targets"
    fi
  done
  ;;
*) echo "LOAD must be slow or orders, not $LOAD" >&2; exit 2 ;;
esac
format=http
[[ $LOAD == orders ]] && format=json
load=(vegeta attack -targets="$DIR/targets" -format=$format -rate="$RATE" -timeout=10s)
echo "steady state: $RATE requests/s ($LOAD) for $STEADY"
"${load[@]}" -duration="$STEADY" >"$DIR/steady.bin"

echo "rolling: $RATE requests/s while app1, then app2, is stopped with SIGTERM and started again (linger $KUMIKO_LINGER)"
"${load[@]}" -duration=10m >"$DIR/roll.bin" &
attack=$!
step() { echo "$(date +%s.%N) $*" >>"$DIR/steps"; }
step "roll load started"
sleep 1 # some load before the first SIGTERM
for n in 1 2; do
  pid=$(cat "$DIR/app$n.pid")
  step "SIGTERM app$n"
  kill -TERM "$pid"
  wait_lb "$n" DOWN # HAProxy saw the 503 (during the linger, or at the latest once the port closed)
  step "app$n DOWN in HAProxy"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  wait "$pid" && code=0 || code=$?
  step "app$n exited with $code"
  start_app "$n" "$DIR/app$n.log"
  wait_ready "$n"
  step "app$n ready"
  wait_lb "$n" UP # the next instance is stopped only once HAProxy sends this one traffic again
  step "app$n UP in HAProxy"
done
kill -INT "$attack" # vegeta stops and flushes its results
wait "$attack" || true
step "roll load stopped"

report() { # report NAME FILE: one summary line, and the number of failed requests in $failed
  local json total ok p50 p99
  json=$(vegeta report -type=json "$2")
  total=$(grep -o '"requests":[0-9]*' <<<"$json" | cut -d: -f2)
  local s200 s201
  s200=$(grep -o '"200":[0-9]*' <<<"$json" | cut -d: -f2 || true)
  s201=$(grep -o '"201":[0-9]*' <<<"$json" | cut -d: -f2 || true) # POSTs, with LOAD=orders
  ok=$((${s200:-0} + ${s201:-0}))
  p50=$(grep -o '"50th":[0-9]*' <<<"$json" | cut -d: -f2)
  p99=$(grep -o '"99th":[0-9]*' <<<"$json" | cut -d: -f2)
  failed=$((total - ok))
  printf '%-8s requests %6d  failed %4d  p50 %6.2f ms  p99 %6.2f ms\n' "$1" "$total" "$failed" \
    "$(awk "BEGIN{print $p50/1e6}")" "$(awk "BEGIN{print $p99/1e6}")"
}
report steady "$DIR/steady.bin"
steady_failed=$failed
report roll "$DIR/roll.bin"
roll_failed=$failed
if ((steady_failed + roll_failed > 0)); then
  # What a reader needs to see why: each failed request (time, status, latency,
  # error) on the same clock as the steps of the roll, and the logs around it.
  echo "FAILED: $((steady_failed + roll_failed)) requests failed" >&2
  for f in steady roll; do
    vegeta encode -to csv "$DIR/$f.bin" | awk -F, -v f="$f" '$2 != 200 && $2 != 201 {
      printf "failed %s request at %.3f: status %s, latency %.1f ms, error %s\n", f, $1/1e9, $2, $3/1e6, $6 }' | head -20 >&2
  done
  echo "steps of the roll:" >&2
  cat "$DIR/steps" >&2
  for f in app1.log app2.log haproxy.log; do
    echo "--- last lines of $f" >&2
    tail -n 15 "$DIR/$f" >&2
  done
  exit 1
fi
echo "ok: no request failed"
