#!/usr/bin/env bash
# Installs what the tests and the local demo need, when it is missing:
# PostgreSQL and Redis servers, HAProxy and curl (Debian packages), versitygw,
# a real S3 server for the storage tests, Toxiproxy, which puts latency, black
# holes and resets between the service and PostgreSQL/Redis in the fault
# tests, and vegeta, the load generator of the rolling deploy (go install).
# Chromium too (Debian), for the orders demo's browser test of the dashboard. demo:begin (this line) demo:end
set -euo pipefail

missing=()
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || command -v initdb >/dev/null || missing+=(postgresql)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
command -v curl >/dev/null || missing+=(curl)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium) # demo:begin (this line) demo:end
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing: ${missing[*]} — install them (sudo apt-get install ${missing[*]}) and run again" >&2
    exit 1
  fi
  echo "installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

gobin="$(go env GOPATH)/bin"
if ! command -v versitygw >/dev/null && [ ! -x "$gobin/versitygw" ]; then
  echo "installing versitygw (S3 server for the storage tests)" >&2
  go install github.com/versity/versitygw/cmd/versitygw@v1.8.0
fi
if ! command -v toxiproxy-server >/dev/null && [ ! -x "$gobin/toxiproxy-server" ]; then
  echo "installing toxiproxy-server (fault injection in the dependency-blip tests)" >&2
  # go install names the binary after its folder, cmd/server: it gets its real name.
  tmp=$(mktemp -d)
  GOBIN="$tmp" go install github.com/Shopify/toxiproxy/v2/cmd/server@v2.5.0
  mkdir -p "$gobin" && mv "$tmp/server" "$gobin/toxiproxy-server" && rmdir "$tmp"
fi
if ! command -v vegeta >/dev/null && [ ! -x "$gobin/vegeta" ]; then
  echo "installing vegeta (load generator of the rolling-deploy test)" >&2
  go install github.com/tsenart/vegeta/v12@v12.13.0
fi
