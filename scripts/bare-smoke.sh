#!/usr/bin/env bash
# Usage: scripts/bare-smoke.sh   (commit first: it clones HEAD)
#
# bare-smoke.sh: the proof that `scripts/new-service.sh --bare` leaves a
# service of its own. A clone of this repository's HEAD (commit first) becomes
# "billing" without the orders demo; then, in the copy: go vet, gofmt, go
# build, its own whole test suite (`go test ./...` against real servers, which
# the copy's tests start; BILLING_REQUIRE_SERVICES=1, so a missing server
# fails), and its scripts/demo.sh until both instances are ready behind
# HAProxy: /api/slow answers through the load balancer, /api/orders is 404,
# and Ctrl+C (SIGINT to the demo's process group) drains both with exit 0.
# First it runs the script's own tests (newservice_test.go, which
# scripts/test.sh skips: they compile two copies, most of the suite's CPU):
# a renamed copy builds, passes its drain test and runs beside the template;
# a bare copy keeps no word of the demo, no unreachable function, and boots.
#
# Prints each step's time; exits 1 at the first failure, after what it saw.
# The copy is removed after a clean run and kept after a failure.
# Ports for the demo (all below 32768): LB_PORT, PG_PORT, REDIS_PORT,
# API_PORT1/2, OPS_PORT1/2.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."
scripts/install-deps.sh tests
export PATH="$PATH:$(go env GOPATH)/bin"

WORK=$(mktemp -d /tmp/bare-smoke.XXXXXX)
chmod 755 "$WORK" # the demo's PostgreSQL runs as the postgres user when this runs as root
COPY=$WORK/billing
STEP=setup steps=() step_start=$SECONDS demo_pid=""
say() { echo "bare-smoke: $*" >&2; }
fail() {
  say "FAIL in step '$STEP': $*; the copy and its logs are kept in $WORK"
  exit 1
}
# step NAME: the time since the previous step ended is the previous step's.
step() {
  [ "$STEP" = setup ] || steps+=("$STEP=$((SECONDS - step_start))s")
  STEP=$1 step_start=$SECONDS
  say "---- $STEP"
}
finish() {
  local status=$?
  if [ -n "$demo_pid" ] && kill -0 "$demo_pid" 2>/dev/null; then
    kill -INT -- "-$demo_pid" 2>/dev/null || true
    sleep 5
    kill -KILL -- "-$demo_pid" 2>/dev/null || true
  fi
  [ "$status" = 0 ] && rm -rf "$WORK"
  exit "$status"
}
trap finish EXIT

step "new-service.sh's tests (newservice_test.go)"
go test -count=1 -timeout 20m -run '^TestNewServiceScript' . >"$WORK/newservice-tests.log" 2>&1 ||
  { tail -n 200 "$WORK/newservice-tests.log" >&2; fail "go test -run '^TestNewServiceScript' . (whole log: $WORK/newservice-tests.log)"; }

step "clone and new-service.sh --bare"
git clone -q . "$COPY" || fail "git clone of $PWD"
(cd "$COPY" && bash scripts/new-service.sh example.com/acme/billing billing --bare) >"$WORK/new-service.log" 2>&1 ||
  { cat "$WORK/new-service.log" >&2; fail "new-service.sh --bare"; }
cd "$COPY"

step "vet, gofmt, build"
go vet ./... || fail "go vet ./... in the copy"
unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || fail "gofmt would change: $unformatted"
go build -o "$WORK/billing-bin" . || fail "go build in the copy"

step "the copy's own tests"
BILLING_REQUIRE_SERVICES=1 go test -count=1 -timeout 20m ./... >"$WORK/go-test.log" 2>&1 ||
  { grep -E '^(--- FAIL|FAIL|panic)' "$WORK/go-test.log" | head -n 40 >&2; fail "go test ./... in the copy (log: $WORK/go-test.log)"; }

step "scripts/demo.sh"
export LB_PORT=${LB_PORT:-18380} PG_PORT=${PG_PORT:-25632} REDIS_PORT=${REDIS_PORT:-26579}
export API_PORT1=${API_PORT1:-18381} API_PORT2=${API_PORT2:-18382} OPS_PORT1=${OPS_PORT1:-19391} OPS_PORT2=${OPS_PORT2:-19392}
export DEMO_DIR=$WORK/demo BILLING_LINGER=200ms
# Its own process group, as a terminal's foreground job: Ctrl+C reaches all of it.
# A script's background job starts with SIGINT ignored, and a shell cannot trap
# a signal ignored on entry: env gives demo.sh back the default, as a terminal would.
setsid env --default-signal=INT bash scripts/demo.sh >"$WORK/demo.log" 2>&1 &
demo_pid=$!
lb=http://127.0.0.1:$LB_PORT
banner() { grep -q "watch a drain" "$WORK/demo.log"; } # printed once HAProxy routes to both
for _ in $(seq 180); do
  banner && break
  kill -0 "$demo_pid" 2>/dev/null || { tail -n 40 "$WORK/demo.log" >&2; fail "the demo exited before it was ready"; }
  sleep 0.5
done
banner || { tail -n 40 "$WORK/demo.log" >&2; fail "the demo was not ready within 90 s"; }
for port in "$OPS_PORT1" "$OPS_PORT2"; do
  ready=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health/ready")
  [ "$ready" = 200 ] || fail "the instance with ops port $port: /health/ready $ready, want 200"
done
code() { curl -s -o /dev/null -w '%{http_code}' -m 5 "$@"; }
[ "$(code "$lb/api/slow?ms=1")" = 200 ] || fail "GET /api/slow through the load balancer is not 200"
[ "$(code "$lb/api/orders")" = 404 ] || fail "GET /api/orders through the load balancer is not 404"
[ "$(code -XPOST -H 'Content-Type: application/json' -d '{}' "$lb/api/orders")" = 404 ] ||
  fail "POST /api/orders through the load balancer is not 404"
kill -INT -- "-$demo_pid" # what Ctrl+C does
for _ in $(seq 120); do kill -0 "$demo_pid" 2>/dev/null || break; sleep 0.5; done
kill -0 "$demo_pid" 2>/dev/null && { tail -n 40 "$WORK/demo.log" >&2; fail "the demo still runs 60 s after Ctrl+C"; }
wait "$demo_pid" || { tail -n 40 "$WORK/demo.log" >&2; fail "the demo exited non-zero after Ctrl+C"; }
demo_pid=""
for n in 1 2; do
  grep -q "app$n exited with code 0" "$WORK/demo.log" || { tail -n 40 "$WORK/demo.log" >&2; fail "app$n did not drain to exit 0"; }
done

step done
say "ok: ${steps[*]} total=${SECONDS}s"
