# Shared by demo.sh and rolling-deploy.sh: throwaway PostgreSQL and Redis,
# instances of the service, and HAProxy in front — the docker-compose
# topology as local processes. Source it; set LB_PORT, PG_PORT, REDIS_PORT
# and DIR first. Instance N listens on API_PORTS[N] and OPS_PORTS[N]
# (default 808N and 909N). Everything started here is stopped by `cleanup`.

read -r -a API_PORTS <<<"0 ${API_PORT1:-8081} ${API_PORT2:-8082}"
read -r -a OPS_PORTS <<<"0 ${OPS_PORT1:-9091} ${OPS_PORT2:-9092}"

pgbin=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
pids=()

cleanup() {
  # Ctrl+C reaches the whole process group: ignore the rest while cleaning up.
  trap '' EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  as_pg "$pgbin/pg_ctl" -D "$DIR/pg" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$DIR"
}

# start_services builds the binary and starts PostgreSQL and Redis.
start_services() {
  rm -rf "$DIR" && mkdir -p "$DIR" && chmod 755 "$DIR"
  go build -o "$DIR/kumiko-lifecycle-demo" .
  [ "$(id -u)" -eq 0 ] && chown postgres "$DIR"
  as_pg "$pgbin/initdb" -D "$DIR/pg" -U postgres -A trust --no-sync >/dev/null
  as_pg "$pgbin/pg_ctl" -D "$DIR/pg" -w -l "$DIR/pg.log" \
    -o "-p $PG_PORT -k $DIR -c listen_addresses=127.0.0.1" start >/dev/null
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$DIR/redis.log" 2>&1 &
  pids+=($!)
  export DATABASE_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
  export REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  export KUMIKO_MASTER_KEY="${KUMIKO_MASTER_KEY:-$(head -c 32 /dev/urandom | base64)}"
  export KUMIKO_MIGRATIONS_MODE=auto-apply # instances apply at once: the advisory lock makes it safe
}

# start_app N [logfile] starts instance appN; its pid goes to $DIR/appN.pid.
start_app() {
  local n=$1 log=${2:-}
  local addrs=(KUMIKO_INSTANCE_ID="app$n" KUMIKO_HTTP_ADDR="127.0.0.1:${API_PORTS[$n]}" KUMIKO_OPS_ADDR="127.0.0.1:${OPS_PORTS[$n]}")
  if [ -n "$log" ]; then
    env "${addrs[@]}" "$DIR/kumiko-lifecycle-demo" >>"$log" 2>&1 &
  else
    env "${addrs[@]}" "$DIR/kumiko-lifecycle-demo" > >(sed -u "s/^/[app$n] /") 2>&1 &
  fi
  pids+=($!)
  echo $! >"$DIR/app$n.pid"
}

# wait_ready N waits until appN's readiness answers 200.
wait_ready() {
  for _ in $(seq 1 600); do
    curl -fsS -o /dev/null "http://127.0.0.1:${OPS_PORTS[$1]}/health/ready" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "app$1 did not become ready" >&2
  return 1
}

# start_lb starts HAProxy on LB_PORT in front of app1 and app2; it takes an
# instance out of the pool as soon as its /health/ready answers 503.
start_lb() {
  local haproxy
  haproxy=$(command -v haproxy || echo /usr/sbin/haproxy)
  cat >"$DIR/haproxy.cfg" <<CFG
defaults
  mode http
  timeout connect 2s
  timeout client 60s
  timeout server 60s
  retries 2
  option redispatch
frontend api
  bind 127.0.0.1:$LB_PORT
  stats enable
  stats uri /lb-stats
  default_backend apps
backend apps
  option httpchk GET /health/ready
  http-check expect status 200
  default-server inter ${LB_CHECK_INTERVAL:-500ms} fall 1 rise 2
  server app1 127.0.0.1:${API_PORTS[1]} check port ${OPS_PORTS[1]}
  server app2 127.0.0.1:${API_PORTS[2]} check port ${OPS_PORTS[2]}
CFG
  "$haproxy" -f "$DIR/haproxy.cfg" -db >"$DIR/haproxy.log" 2>&1 &
  pids+=($!)
}

# wait_lb N UP|DOWN waits until HAProxy itself reports appN in that state,
# read from its stats page: HAProxy routes by what its own checks saw, not by
# what the instance says right now.
wait_lb() {
  for _ in $(seq 1 600); do
    curl -fsS "http://127.0.0.1:$LB_PORT/lb-stats;csv" 2>/dev/null |
      awk -F, -v s="app$1" -v want="$2" '$1 == "apps" && $2 == s && $18 == want { found = 1 } END { exit !found }' && return 0
    sleep 0.1
  done
  echo "HAProxy did not mark app$1 $2" >&2
  return 1
}
