#!/usr/bin/env bash
# Usage: scripts/compose-smoke.sh   (root, Debian; RATE in the environment)
#
# compose-smoke.sh: runs the real docker-compose.yml with Docker and checks
# what docs/operations.md promises of it: `up --wait` gets healthy, HAProxy spreads
# load over app1 and app2, `docker compose kill -s SIGTERM app1` drains with
# exit 0 and no failed request through the load balancer, HAProxy starts while
# app1 is stopped, and a restarted app1 gets traffic again. Then `down -v`.
#
# It needs root on Debian. It starts a Docker engine if none answers
# (installing docker.io when missing, and building the compose/buildx CLI
# plugins from their Go modules when missing) and stops the engine again if it
# started it. Every image the compose file and the Dockerfile name is used
# when present, pulled when a registry answers, and otherwise built as a
# clearly labelled local stand-in from Debian packages and Go modules
# (deploy/standins/, tagged with the name the compose file uses, so that file
# stays unchanged). Built images are kept: later runs reuse them. These steps
# live in scripts/lib/docker.sh, which scripts/k8s-smoke.sh uses too.
#
# Prints one summary line; exits non-zero on any failure, after printing what
# it saw. Load goes to 127.0.0.1 only. Knobs: RATE (req/s, default 50).
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."

PROJECT=kumiko-smoke
RATE=${RATE:-50}
LB=http://127.0.0.1:8080
VERSITYGW_NOTE="versitygw v1.8.0 (MinIO is not packaged; S3 stand-in)"
WORK=$(mktemp -d /tmp/compose-smoke.XXXXXX)
START=$(date +%s.%N)
ENGINE_PID="" # set by docker_engine when this script starts dockerd
STEP="setup"
SUMMARY=""
override=()
export PATH="$PATH:$(go env GOPATH 2>/dev/null || echo /root/go)/bin"

say() { echo "compose-smoke: $*" >&2; }
fail() {
  say "FAIL in step '$STEP': $*"
  exit 1
}
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
now() { date +%s.%N; }

compose() { docker compose -p "$PROJECT" -f docker-compose.yml "${override[@]}" "$@"; }

# on_exit prints what was seen when something failed, then leaves nothing
# behind: the project's containers, network and volumes, the engine if this
# script started it, the temp dir. Images stay for the next run.
on_exit() {
  local rc=$?
  trap '' EXIT INT TERM
  if [ "$rc" -ne 0 ]; then
    say "---- what was seen (step '$STEP', exit $rc) ----"
    if docker info >/dev/null 2>&1; then
      compose ps -a 2>&1 | sed 's/^/  ps: /' >&2 || true
      for svc in $(compose config --services 2>/dev/null); do
        compose logs --no-color --tail 25 "$svc" 2>&1 | sed "s/^/  $svc: /" >&2 || true
      done
    fi
    # Only the logs of the step that failed.
    case "$STEP" in
    engine) files=("$WORK/dockerd.log") ;;
    tools | "cli plugins" | images | build) files=("$WORK/build.log") ;;
    *) files=("$WORK/load-failed.txt") ;;
    esac
    for f in "${files[@]}"; do
      [ -s "$f" ] && { say "---- tail of $(basename "$f") ----"; tail -n 25 "$f" >&2; }
    done
  fi
  if docker info >/dev/null 2>&1; then
    compose down -v --remove-orphans --timeout 60 >"$WORK/down.log" 2>&1 || { say "down failed:"; cat "$WORK/down.log" >&2; rc=1; }
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"; docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
    if [ -n "$left" ]; then
      say "FAIL: left behind after down: $left"
      rc=1
    fi
  fi
  if [ -n "$ENGINE_PID" ]; then
    kill -TERM "$ENGINE_PID" 2>/dev/null || true
    # dockerd stops its containerd and containers itself; bounded wait.
    for _ in $(seq 60); do kill -0 "$ENGINE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$ENGINE_PID" 2>/dev/null && { say "FAIL: dockerd $ENGINE_PID did not stop"; rc=1; }
  fi
  rm -rf "$WORK"
  # The one summary line, once everything is cleaned up.
  [ "$rc" -eq 0 ] && [ -n "$SUMMARY" ] && echo "$SUMMARY total=$(secs "$START" "$(now)")s"
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# ---- tools, engine, CLI plugins and images (scripts/lib/docker.sh) ----
DOCKER_LOGS=$WORK
# shellcheck source=scripts/lib/docker.sh
. scripts/lib/docker.sh
STEP="tools"
docker_tools
STEP="engine"
docker_engine
STEP="cli plugins"
docker_plugins

STEP="images"
for image in $(sed -n 's/^FROM \([^ ]*\).*/\1/p' Dockerfile) $(compose config --images | grep -vx 'kumiko-lifecycle-demo:local'); do
  ensure "$image" && continue
  case "$image" in
  getmeili/meilisearch:*)
    override=(-f deploy/standins/compose.no-meilisearch.yml)
    say "no $image here and no stand-in for it: using deploy/standins/compose.no-meilisearch.yml (search skipped)"
    ;;
  *) fail "no image $image and no stand-in for it" ;;
  esac
done
for s in "${standins[@]}"; do say "stand-in: $s"; done

STEP="build"
t=$(now)
compose build --build-arg GOPROXY="$(go env GOPROXY)" --build-arg VERSION=compose-smoke app1 >"$WORK/build.log" 2>&1 ||
  fail "docker compose build app1"
build_secs=$(secs "$t" "$(now)")
builder=classic
docker buildx version >/dev/null 2>&1 && builder=buildkit

# ---- up ----
STEP="up --wait"
compose down -v --remove-orphans >/dev/null 2>&1 || true # a run killed before its cleanup
t=$(now)
compose up -d --wait --wait-timeout 240 >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; fail "up --wait"; }
up_secs=$(secs "$t" "$(now)")

# instance_of prints which instance answered GET /api/instance through the
# load balancer, or "HTTP<code>".
instance_of() {
  local body code
  body=$(curl -s -m 5 -w '\n%{http_code}' "$LB/api/instance" 2>/dev/null) || true
  code=${body##*$'\n'}
  if [ "$code" = 200 ]; then jq -r .instanceId <<<"${body%$'\n'*}"; else echo "HTTP$code"; fi
}
# tally N prints "app1=X app2=Y other=Z" over N requests through the LB.
tally() {
  local a1=0 a2=0 other=0
  for _ in $(seq "$1"); do
    case "$(instance_of)" in app1) a1=$((a1 + 1)) ;; app2) a2=$((a2 + 1)) ;; *) other=$((other + 1)) ;; esac
  done
  echo "app1=$a1 app2=$a2 other=$other"
}

STEP="both instances behind the LB"
# The LB is "running" at once but marks a server up after 2 checks: wait
# (bounded) until both answer, then count a sample.
seen=""
for _ in $(seq 300); do
  id=$(instance_of)
  [[ "$id" == app* && " $seen " != *" $id "* ]] && seen="$seen $id"
  [[ "$seen" == *app1* && "$seen" == *app2* ]] && break
  sleep 0.1
done
[[ "$seen" == *app1* && "$seen" == *app2* ]] || fail "the LB did not reach both instances within 30s (saw:$seen)"
spread=$(tally 20)
[[ "$spread" == *"other=0"* ]] || fail "requests through the LB failed before any stop: $spread"

# ---- SIGTERM app1 under load ----
STEP="SIGTERM app1 under load"
app1=$(compose ps -q app1)
ip_before=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$app1")
echo "GET $LB/api/instance" | vegeta attack -rate="$RATE/s" -duration=90s -timeout=10s >"$WORK/load.bin" &
load_pid=$!
# Let the load run through both instances before the stop (bounded wait for
# the results file to have data, i.e. requests have completed).
for _ in $(seq 100); do [ -s "$WORK/load.bin" ] && break; sleep 0.1; done
sleep 1
t=$(now)
compose kill -s SIGTERM app1 >"$WORK/kill.log" 2>&1 || { cat "$WORK/kill.log" >&2; fail "compose kill -s SIGTERM app1"; }
app1_exit=$(timeout 60 docker wait "$app1") || fail "app1 did not exit within 60s of SIGTERM"
drain_secs=$(secs "$t" "$(now)")
sleep 2 # two more seconds of load served by app2 alone
kill -INT "$load_pid"
wait "$load_pid" || true
vegeta encode -to json <"$WORK/load.bin" >"$WORK/load.json"
requests=$(wc -l <"$WORK/load.json")
jq -r 'select(.code != 200) | "\(.timestamp) code=\(.code) error=\(.error)"' "$WORK/load.json" >"$WORK/load-failed.txt"
failed=$(wc -l <"$WORK/load-failed.txt")
by_app1=$(jq -r 'select(.code == 200) | .body | @base64d | fromjson | .instanceId' "$WORK/load.json" | grep -cx app1 || true)
[ "$requests" -gt 0 ] || fail "the load generator sent no request"
[ "$failed" -eq 0 ] || fail "$failed of $requests requests through the LB failed during the drain"
[ "$app1_exit" = 0 ] || fail "app1 exited $app1_exit after SIGTERM, want 0"
[ "$by_app1" -gt 0 ] || fail "app1 served none of the $requests requests: the drain was not under load"
compose logs --no-color --no-log-prefix app1 >"$WORK/app1.log" 2>&1
drain_lines=$(jq -rc 'select(.msg == "lifecycle") |
  if .event == "shutdown_requested" then "shutdown_requested"
  elif .event == "state_changed" and .to == "draining" then "draining"
  elif .event == "exit" and .code == 0 then "exit0"
  elif .step then "step" else empty end' "$WORK/app1.log" 2>/dev/null | sort | uniq -c | awk '{printf "%s=%s ", $2, $1}')
for want in shutdown_requested= draining= exit0= step=; do
  [[ "$drain_lines" == *"$want"* ]] || { tail -n 30 "$WORK/app1.log" >&2; fail "app1's log has no drain line '${want%=}' (got: $drain_lines)"; }
done

# ---- HAProxy starts while app1 is stopped (init-addr none) ----
STEP="LB restart with app1 stopped"
compose restart lb >"$WORK/restart.log" 2>&1 || { cat "$WORK/restart.log" >&2; fail "compose restart lb"; }
served=""
for _ in $(seq 150); do
  served=$(instance_of)
  [ "$served" = app2 ] && break
  sleep 0.2
done
[ "$served" = app2 ] || fail "HAProxy did not serve from app2 within 30s after a restart with app1 stopped (last: $served)"

# ---- app1 back: HAProxy re-resolves it ----
STEP="app1 restarted gets traffic"
t=$(now)
compose up -d --wait --wait-timeout 180 app1 >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; fail "up app1"; }
app1=$(compose ps -q app1)
ip_after=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$app1")
back=""
for _ in $(seq 300); do
  [ "$(instance_of)" = app1 ] && { back=$(secs "$t" "$(now)"); break; }
  sleep 0.1
done
[ -n "$back" ] || fail "app1 (IP $ip_before -> $ip_after) got no request through the LB within 30s of being healthy"
after=$(tally 40)
[[ "$after" == *"other=0"* ]] || fail "requests failed after app1's restart: $after"

STEP="down"
t=$(now)
compose down -v --remove-orphans --timeout 60 >"$WORK/down.log" 2>&1 || { cat "$WORK/down.log" >&2; fail "down -v"; }
down_secs=$(secs "$t" "$(now)")
SUMMARY="compose-smoke: ok: up_wait=${up_secs}s app_build=${build_secs}s($builder) spread[$spread] sigterm_load: requests=$requests failed=$failed by_app1=$by_app1 app1_exit=$app1_exit drain=${drain_secs}s drain_lines[${drain_lines% }] lb_restart_with_app1_stopped=ok app1_back_after=${back}s app1_ip=$ip_before->$ip_after after_restart[$after] down=${down_secs}s standins=${#standins[@]} override=${override[1]:-none}"
