#!/usr/bin/env bash
# Usage: scripts/rolling-deploy.sh   (settings in the environment, below)
#
# A rolling deploy under load, without Docker: two instances behind HAProxy,
# a steady load (scripts/rollload) through the load balancer, and each
# instance in turn stopped with SIGTERM and started again, as an orchestrator
# would. Prints requests sent, failed, and latency percentiles for the steady
# state and for the roll, each instance's SIGTERM → exit, and the failed
# requests by the drain step they fell in and by client connection (new or
# reused keep-alive), zeros included; exits 1 when any request failed.
# docs/rolling-deploy.md tells how to read it.
#
# HAProxy is strict: no retries, no redispatch.
#
#   scripts/rolling-deploy.sh                      # 500 requests/s of GET /api/slow?ms=5, 10s steady, then the roll
#   RATE=200 STEADY=2s scripts/rolling-deploy.sh   # shorter (what CI runs)
# demo:begin (the orders demo; scripts/new-service.sh --bare removes this block)
#   LOAD=orders RATE=1000 scripts/rolling-deploy.sh  # 80 % GET /api/orders/{id}, 20 % POST /api/orders (the orders demo)
# demo:end
#   KUMIKO_LINGER=0 scripts/rolling-deploy.sh      # see what the linger buys
#   KUMIKO_LINGER_QUIET=3s KUMIKO_LINGER=3s scripts/rolling-deploy.sh  # a fixed linger instead of the adaptive one
#   RATE=0 scripts/rolling-deploy.sh               # no traffic: SIGTERM → exit of an idle instance
#   LB_CHECK_INTERVAL=500ms scripts/rolling-deploy.sh  # HAProxy's check period; the instances' probe period follows it
#
# Ctrl+C stops everything it started, removes ROLL_DIR (.rolling) and exits
# 130; after a failure the directory keeps the logs and results.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh demo
export PATH="$PATH:$(go env GOPATH)/bin"

RATE=${RATE:-500} STEADY=${STEADY:-10s} LOAD=${LOAD:-slow}
LB_PORT=${LB_PORT:-18080} PG_PORT=${PG_PORT:-25433} REDIS_PORT=${REDIS_PORT:-26380} DIR=${ROLL_DIR:-$PWD/.rolling}
LB_CHECK_INTERVAL=${LB_CHECK_INTERVAL:-250ms}
export KUMIKO_LINGER=${KUMIKO_LINGER:-1s} KUMIKO_LOG_FORMAT=json LB_STRICT=1
# HAProxy marks an instance down at its first failed check (fall 1), so it
# sees the 503 within one check interval: the least the linger must last.
export KUMIKO_READINESS_PROBE_PERIOD=${KUMIKO_READINESS_PROBE_PERIOD:-$LB_CHECK_INTERVAL}
# All the load comes from one address (rollload's), which the per-address rate
# limit would otherwise cut at KUMIKO_API_RATE_LIMIT requests/s.
export KUMIKO_API_RATE_LIMIT=${KUMIKO_API_RATE_LIMIT:-0}
source scripts/lib/stack.sh
trap cleanup EXIT
trap on_signal INT TERM

start_services
begin "building rollload" "the load generator"
go build -o "$DIR/rollload" ./scripts/rollload
begin "booting app1 and app2" "logs in $DIR/app1.log and app2.log: a few seconds"
start_app 1 "$DIR/app1.log"
start_app 2 "$DIR/app2.log"
wait_ready 1 2
begin "waiting for HAProxy" "on :$LB_PORT, until it marks both instances UP: a second or two"
start_lb
wait_lb 1 UP
wait_lb 2 UP

lb="http://127.0.0.1:$LB_PORT"
case $LOAD in
slow) echo "{\"method\":\"GET\",\"url\":\"$lb/api/slow?ms=5\"}" >"$DIR/targets" ;;
# demo:begin (the orders demo; scripts/new-service.sh --bare removes this block)
orders)
  # 40 orders to read, then a round of 4 reads to each write, in vegeta's JSON
  # target format, which rollload reads (a POST body is base64).
  body='{"customer":"Ada","items":[{"sku":"tea","qty":2,"priceCents":250}]}'
  ids=() tokens=()
  for _ in $(seq 1 40); do
    created=$(curl -fsS -XPOST "$lb/api/orders" -H 'Content-Type: application/json' -d "$body")
    ids+=("$(grep -o '"id":"[^"]*"' <<<"$created" | cut -d'"' -f4)")
    tokens+=("$(grep -o '"readToken":"[^"]*"' <<<"$created" | cut -d'"' -f4)") # reading an order needs it
  done
  b64=$(printf '%s' "$body" | base64 -w0)
  : >"$DIR/targets"
  for i in "${!ids[@]}"; do
    echo "{\"method\":\"GET\",\"url\":\"$lb/api/orders/${ids[$i]}\",\"header\":{\"Authorization\":[\"Bearer ${tokens[$i]}\"]}}" >>"$DIR/targets"
    if ((i % 4 == 3)); then
      echo "{\"method\":\"POST\",\"url\":\"$lb/api/orders\",\"body\":\"$b64\",\"header\":{\"Content-Type\":[\"application/json\"]}}" >>"$DIR/targets"
    fi
  done
  ;;
# demo:end
*) echo "LOAD $LOAD is not one this script knows (see its header)" >&2; exit 2 ;;
esac
load=("$DIR/rollload" attack -targets="$DIR/targets" -rate="$RATE" -timeout=10s)
stage="sending the steady load"
echo "steady state: $RATE requests/s ($LOAD) for $STEADY"
"${load[@]}" -duration="$STEADY" -out="$DIR/steady.jsonl"

stage=rolling
echo "rolling: $RATE requests/s while app1, then app2, is stopped with SIGTERM and started again (linger $KUMIKO_LINGER)"
"${load[@]}" -out="$DIR/roll.jsonl" & # until SIGINT
attack=$!
server_pids+=("$attack") # cleanup stops it if the roll fails
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
kill -INT "$attack" # rollload stops sending, waits for the answers in flight and writes them
wait "$attack" || { echo "rollload attack failed: see above" >&2; exit 1; }
step "roll load stopped"

stage="reading the results"
# The figures, each instance's SIGTERM → exit, and every failed request
# placed in the drain step it fell in: rollload report exits 1 when a request
# failed, 2 when it could not read the results or the logs.
"$DIR/rollload" report -results steady="$DIR/steady.jsonl" -results roll="$DIR/roll.jsonl" \
  -log app1="$DIR/app1.log" -log app2="$DIR/app2.log" && verdict=0 || verdict=$?
if ((verdict != 0)); then
  # What a reader needs besides the table: the steps of the roll on the same
  # clock, and the logs around them.
  echo "steps of the roll:" >&2
  cat "$DIR/steps" >&2
  for f in app1.log app2.log haproxy.log; do
    echo "--- last lines of $f" >&2
    tail -n 15 "$DIR/$f" >&2
  done
  ((verdict == 1)) && echo "FAILED: requests failed; the results are in $DIR/steady.jsonl and roll.jsonl" >&2
  exit 1
fi
echo "ok: no request failed"
