#!/usr/bin/env bash
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
# stays unchanged). Built images are kept: later runs reuse them.
#
# Prints one summary line; exits non-zero on any failure, after printing what
# it saw. Load goes to 127.0.0.1 only. Knobs: RATE (req/s, default 50).
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=kumiko-smoke
RATE=${RATE:-50}
LB=http://127.0.0.1:8080
BASE=kumiko-standin/debian:bookworm
COMPOSE_VERSION=v5.6.0
BUILDX_VERSION=v0.38.2
VERSITYGW_NOTE="versitygw v1.8.0 (MinIO is not packaged; S3 stand-in)"
WORK=$(mktemp -d /tmp/compose-smoke.XXXXXX)
START=$(date +%s.%N)
ENGINE_PID=""
STEP="setup"
SUMMARY=""
standins=()
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

# ---- tools, engine and CLI plugins ----
STEP="tools"
missing=()
command -v dockerd >/dev/null || timeout 10 docker info >/dev/null 2>&1 || missing+=(docker.io)
command -v jq >/dev/null || missing+=(jq)
command -v curl >/dev/null || missing+=(curl)
if ((${#missing[@]})); then
  say "installing ${missing[*]} (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$WORK/apt.log" 2>&1 ||
    { cat "$WORK/apt.log" >&2; fail "apt-get install ${missing[*]}"; }
fi
if ! command -v vegeta >/dev/null; then
  say "installing vegeta (load generator)"
  go install github.com/tsenart/vegeta/v12@v12.13.0 >"$WORK/build.log" 2>&1 || fail "go install vegeta"
fi

STEP="engine"
if ! timeout 10 docker info >/dev/null 2>&1; then
  say "starting dockerd (log: stopped with it)"
  dockerd --storage-driver=overlay2 >"$WORK/dockerd.log" 2>&1 &
  ENGINE_PID=$!
  for _ in $(seq 120); do timeout 5 docker info >/dev/null 2>&1 && break; kill -0 "$ENGINE_PID" 2>/dev/null || break; sleep 0.5; done
  timeout 10 docker info >/dev/null 2>&1 || fail "dockerd did not answer within 60s"
fi

# go_plugin NAME MODULE VERSION PKG LDFLAGS builds a Docker CLI plugin from
# its Go module (go install refuses modules with replace/exclude directives,
# so it is built inside a copy of the module).
go_plugin() {
  local name=$1 module=$2 version=$3 pkg=$4 ldflags=$5 dir
  say "building docker-$name $version from its Go module"
  dir=$(go mod download -json "$module@$version" | jq -r .Dir) || fail "go mod download $module@$version"
  cp -r "$dir" "$WORK/$name-src" && chmod -R u+w "$WORK/$name-src"
  mkdir -p /usr/local/lib/docker/cli-plugins
  (cd "$WORK/$name-src" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags "-s -w $ldflags" \
    -o "/usr/local/lib/docker/cli-plugins/docker-$name" "$pkg") >"$WORK/build.log" 2>&1 || fail "building docker-$name"
  rm -rf "$WORK/$name-src"
}
STEP="cli plugins"
docker compose version >/dev/null 2>&1 ||
  go_plugin compose github.com/docker/compose/v5 "$COMPOSE_VERSION" ./cmd "-X github.com/docker/compose/v5/internal.Version=$COMPOSE_VERSION"
docker buildx version >/dev/null 2>&1 ||
  go_plugin buildx github.com/docker/buildx "$BUILDX_VERSION" ./cmd/buildx "-X github.com/docker/buildx/version.Version=$BUILDX_VERSION"

# ---- images ----
registry="unknown" # set to up/down by the first pull attempt
try_pull() {
  [ "$registry" = down ] && return 1
  if timeout 45 docker pull -q "$1" >"$WORK/pull.log" 2>&1; then
    registry=up
    return 0
  fi
  [ "$registry" = unknown ] && say "no image registry answers ($(tail -n 1 "$WORK/pull.log")): building stand-ins"
  registry=down
  return 1
}

# base_image makes a minimal Debian bookworm image with debootstrap, with the
# host's apt sources, Acquire settings (proxy, validity) and local CA
# certificates, so builds reach the same mirror and module proxy.
base_image() {
  docker image inspect "$BASE" >/dev/null 2>&1 && return
  command -v debootstrap >/dev/null ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >"$WORK/apt.log" 2>&1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >"$WORK/apt.log" 2>&1; } ||
    fail "installing debootstrap"
  say "building $BASE with debootstrap"
  local root="$WORK/rootfs" mirror
  mirror=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
    head -n 1 | awk '{print $2}')
  debootstrap --variant=minbase bookworm "$root" "${mirror:-http://deb.debian.org/debian}" >"$WORK/build.log" 2>&1 || fail "debootstrap"
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/" && : >"$root/etc/apt/sources.list"
  fi
  grep -l 'Acquire::' /etc/apt/apt.conf.d/* 2>/dev/null | xargs -r cp -t "$root/etc/apt/apt.conf.d/"
  # The host's local CA certificates (e.g. of a TLS-inspecting egress proxy):
  # images that install ca-certificates then trust what the host trusts.
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
  tar -C "$root" -c . | docker import -c 'CMD ["bash"]' -m "kumiko stand-in base: debootstrap bookworm" - "$BASE" >/dev/null ||
    fail "docker import $BASE"
  rm -rf "$root"
}

# standin_file IMAGE names the stand-in of IMAGE in deploy/standins/, or
# returns 1 when there is none.
standin_file() {
  case "$1" in
  postgres:16) echo postgres ;;
  redis:7) echo redis ;;
  haproxy:3.0) echo haproxy ;;
  minio/minio:latest) echo minio ;;
  golang:1.26-bookworm) echo golang ;;
  gcr.io/distroless/static-debian12:nonroot) echo distroless-static ;;
  *) return 1 ;;
  esac
}
# standin_hash FILE: a stand-in is rebuilt when its Dockerfile or scripts change.
standin_hash() { cat "deploy/standins/$1.Dockerfile" deploy/standins/"$1"-*.sh 2>/dev/null | sha256sum | cut -c1-16; }

# standin IMAGE builds the local stand-in for IMAGE, tagged IMAGE.
standin() {
  local image=$1 file ctx=deploy/standins
  file=$(standin_file "$image") || return 1
  case "$file" in
  minio) ensure golang:1.26-bookworm ;;
  golang)
    ctx=$(go env GOROOT)
    case "$(go env GOVERSION)" in go1.26.*) ;; *) fail "the golang:1.26 stand-in needs the host's Go 1.26, found $(go env GOVERSION)" ;; esac
    ;;
  esac
  base_image
  say "building stand-in $image from deploy/standins/$file.Dockerfile"
  docker build --progress=plain --build-arg GOPROXY="$(go env GOPROXY)" --label "org.kumiko.standin.source=$(standin_hash "$file")" \
    -t "$image" -f "deploy/standins/$file.Dockerfile" "$ctx" >"$WORK/build.log" 2>&1 || fail "building the stand-in for $image"
  standins+=("$image=$(docker image inspect -f '{{index .Config.Labels "org.kumiko.standin"}}' "$image")")
}

# ensure IMAGE: present (a stand-in only if built from the current files),
# else pulled, else a stand-in; 1 if none can exist.
ensure() {
  local label source file
  if docker image inspect "$1" >/dev/null 2>&1; then
    label=$(docker image inspect -f '{{index .Config.Labels "org.kumiko.standin"}}' "$1")
    source=$(docker image inspect -f '{{index .Config.Labels "org.kumiko.standin.source"}}' "$1")
    [ -z "$label" ] && return 0 # a real image
    [[ " ${standins[*]} " == *" $1="* ]] && return 0
    if file=$(standin_file "$1") && [ "$source" = "$(standin_hash "$file")" ]; then
      standins+=("$1=$label (reused)")
      return 0
    fi
    say "stand-in $1 is older than deploy/standins/: rebuilding"
    standin "$1"
    return
  fi
  try_pull "$1" && return 0
  standin "$1"
}

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
