#!/usr/bin/env bash
# The demo on a machine without Docker: throwaway PostgreSQL and Redis, two
# instances (app1, app2) behind HAProxy, which takes an instance out of the
# pool as soon as its /health/ready answers 503. Ctrl+C stops and removes
# everything.
#
#   scripts/demo.sh
#   curl localhost:8080/api/slow?ms=2000        # through the load balancer
#   kill -TERM "$(cat .demo/app1.pid)"          # watch app1 drain while app2 serves
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

LB_PORT=${LB_PORT:-8080}
PG_PORT=${PG_PORT:-55432}
REDIS_PORT=${REDIS_PORT:-56379}
dir="$PWD/.demo"
rm -rf "$dir" && mkdir -p "$dir" && chmod 755 "$dir"

pgbin=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

pids=()
cleanup() {
  # Ctrl+C reaches the whole process group: ignore the rest while cleaning up.
  trap '' EXIT INT TERM
  echo; echo "stopping the demo"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  as_pg "$pgbin/pg_ctl" -D "$dir/pg" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$dir"
  exit 0
}
trap cleanup EXIT INT TERM

echo "building"
go build -o "$dir/kumiko-lifecycle-demo" .

echo "starting PostgreSQL on :$PG_PORT and Redis on :$REDIS_PORT"
[ "$(id -u)" -eq 0 ] && chown postgres "$dir"
as_pg "$pgbin/initdb" -D "$dir/pg" -U postgres -A trust --no-sync >/dev/null
as_pg "$pgbin/pg_ctl" -D "$dir/pg" -w -l "$dir/pg.log" \
  -o "-p $PG_PORT -k $dir -c listen_addresses=127.0.0.1" start >/dev/null
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$dir/redis.log" 2>&1 &
pids+=($!)

export DATABASE_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
export REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
export KUMIKO_MASTER_KEY="${KUMIKO_MASTER_KEY:-$(head -c 32 /dev/urandom | base64)}"
export KUMIKO_ADMIN_TOKEN="${KUMIKO_ADMIN_TOKEN:-demo-admin-token-change-me}"
export KUMIKO_MIGRATIONS_MODE=auto-apply # both instances apply at once: the advisory lock makes it safe

for n in 1 2; do
  KUMIKO_INSTANCE_ID="app$n" KUMIKO_HTTP_ADDR="127.0.0.1:808$n" KUMIKO_OPS_ADDR="127.0.0.1:909$n" \
    "$dir/kumiko-lifecycle-demo" > >(sed -u "s/^/[app$n] /") 2>&1 &
  pids+=($!)
  echo $! >"$dir/app$n.pid"
done

haproxy=$(command -v haproxy || echo /usr/sbin/haproxy)
cat >"$dir/haproxy.cfg" <<CFG
defaults
  mode http
  timeout connect 2s
  timeout client 60s
  timeout server 60s
  retries 2
  option redispatch
frontend api
  bind 127.0.0.1:$LB_PORT
  default_backend apps
backend apps
  # Readiness decides routing: a draining instance answers 503 and leaves the pool.
  option httpchk GET /health/ready
  http-check expect status 200
  default-server inter 500ms fall 1 rise 2
  server app1 127.0.0.1:8081 check port 9091
  server app2 127.0.0.1:8082 check port 9092
CFG
"$haproxy" -f "$dir/haproxy.cfg" -db >"$dir/haproxy.log" 2>&1 &
pids+=($!)

cat <<MSG

  load balancer   http://127.0.0.1:$LB_PORT/api/slow?ms=2000
  app1            api http://127.0.0.1:8081   ops http://127.0.0.1:9091/health/ready
  app2            api http://127.0.0.1:8082   ops http://127.0.0.1:9092/health/ready
  admin           curl -H 'Authorization: Bearer $KUMIKO_ADMIN_TOKEN' http://127.0.0.1:9091/admin/lifecycle
  event stream    curl -N http://127.0.0.1:8081/api/events
  an order        curl -XPOST http://127.0.0.1:$LB_PORT/api/orders -H 'Content-Type: application/json' \
                    -d '{"customer":"Ada","items":[{"sku":"tea","qty":2,"priceCents":250}]}'

  watch a drain:  kill -TERM \$(cat .demo/app1.pid)
  Ctrl+C stops everything.

MSG
wait "${pids[1]}" "${pids[2]}" || true
echo "both instances have exited; Ctrl+C to clean up"
wait
