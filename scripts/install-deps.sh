#!/usr/bin/env bash
# Usage: scripts/install-deps.sh [demo|tests|bench]
#
# Installs what is missing, and only what the use needs:
#   demo   what the demo scripts run (demo.sh, sigterm-demo.sh,
#          leader-demo.sh, rolling-deploy.sh): PostgreSQL and Redis servers,
#          HAProxy, curl, and jq, which the README's examples use;
#   tests  (the default; scripts/test.sh) the demo's, and the test tools:
#          versitygw, a real S3 server for the storage tests, and Toxiproxy,
#          which puts latency, black holes and resets between the service and
#          PostgreSQL/Redis in the fault tests;
#          Chromium too, for the orders demo's browser test of the dashboard; demo:begin (this line) demo:end
#   bench  the demo's, versitygw and vegeta: what the benchmarks run.
# Debian packages with apt-get when run as root (else it names what to
# install), Go tools with go install into $(go env GOPATH)/bin.
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
use=${1:-tests}
case $use in
demo | tests | bench) ;;
*) echo "install-deps: unknown use $use (demo, tests or bench)" >&2 && exit 2 ;;
esac

missing=()
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || command -v initdb >/dev/null || missing+=(postgresql)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
command -v curl >/dev/null || missing+=(curl)
command -v jq >/dev/null || missing+=(jq)
# demo:begin (the orders demo's browser test of the dashboard)
if [ "$use" = tests ]; then
  command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
fi
# demo:end
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing: ${missing[*]}: install them (sudo apt-get install ${missing[*]}) and run again" >&2
    exit 1
  fi
  echo "installing ${missing[*]} (apt-get: a minute or two)…" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

gobin="$(go env GOPATH)/bin"
# go_tool NAME PACKAGE WHY: go install PACKAGE when NAME is on neither PATH nor gobin.
go_tool() {
  command -v "$1" >/dev/null || [ -x "$gobin/$1" ] && return 0
  echo "installing $1 ($3; go install compiles it: minutes)…" >&2
  # go install names the binary after its folder (toxiproxy's is cmd/server): it gets its real name.
  local tmp
  tmp=$(mktemp -d)
  GOBIN="$tmp" go install "$2" ||
    { rm -rf "$tmp"; echo "installing $1 failed: it needs the Go module proxy (or: go install $2)" >&2; return 1; }
  mkdir -p "$gobin" && mv "$tmp"/* "$gobin/$1" && rm -rf "$tmp"
}
case $use in
tests)
  go_tool versitygw github.com/versity/versitygw/cmd/versitygw@v1.8.0 "S3 server for the storage tests"
  go_tool toxiproxy-server github.com/Shopify/toxiproxy/v2/cmd/server@v2.5.0 "fault injection in the dependency-blip tests"
  go_tool deadcode golang.org/x/tools/cmd/deadcode@v0.52.0 "the bare copy's test: no function it keeps is unreachable"
  ;;
bench)
  go_tool versitygw github.com/versity/versitygw/cmd/versitygw@v1.8.0 "S3 server for the benchmarks"
  go_tool vegeta github.com/tsenart/vegeta/v12@v12.13.0 "load generator of the benchmarks"
  ;;
esac
