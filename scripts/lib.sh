# Shared by the demo scripts and rolling-deploy.sh: throwaway PostgreSQL and
# Redis, instances of the service, and HAProxy in front — the docker-compose
# topology as local processes. Source it; set LB_PORT, PG_PORT, REDIS_PORT
# and DIR first. Instance N listens on API_PORTS[N] and OPS_PORTS[N]
# (default 808N and 909N). Everything started here is stopped by `cleanup`.
#
# Every server, instance and log prefixer runs in a session of its own
# (setsid): the SIGINT a terminal sends to its foreground process group on
# Ctrl+C reaches only the script, which then stops them in order — the
# instances first (they drain against a live Redis and PostgreSQL, and their
# drain log still reaches the terminal), then HAProxy, Redis and PostgreSQL.

read -r -a API_PORTS <<<"0 ${API_PORT1:-8081} ${API_PORT2:-8082}"
read -r -a OPS_PORTS <<<"0 ${OPS_PORT1:-9091} ${OPS_PORT2:-9092}"

pgbin=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
app_pids=() prefixer_pids=() server_pids=()

# sql QUERY: one query against the throwaway PostgreSQL, rows unaligned.
sql() { psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -qAtc "$1"; }
# pg_fsync on|off: sets PostgreSQL's fsync for the benchmarks and checks that
# the server took it.
pg_fsync() {
  sql "ALTER SYSTEM SET fsync = $1" >/dev/null
  sql "SELECT pg_reload_conf()" >/dev/null
  sleep 0.2 # the reload is asynchronous: let every process reread its configuration
  [ "$(sql 'SHOW fsync')" = "$1" ] || { echo "fsync did not become $1" >&2; return 1; }
}

# CPU read from /proc, in seconds, for the benchmarks. cpu_seconds PID: one
# process's. box_busy_seconds: every core's, idle and I/O wait left out.
cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat"; }
# pg_cpu_seconds: PostgreSQL's CPU so far, every process of the cluster: the
# live ones, and the backends that have exited (the postmaster's children time).
pg_cpu_seconds() {
  local pm
  pm=$(head -1 "$DIR/pg/postmaster.pid")
  awk -v hz="$(getconf CLK_TCK)" -v pm="$pm" '
    FNR == 1 { sub(/^.*\) /, ""); if ($2 == pm) t += $12 + $13 }  # a child: utime, stime (fields 14, 15)
    FNR == 1 && FILENAME == "/proc/" pm "/stat" { t += $12 + $13 + $14 + $15 }
    END { printf "%.3f", t / hz }' /proc/[0-9]*/stat 2>/dev/null
}
box_busy_seconds() { awk -v hz="$(getconf CLK_TCK)" '$1 == "cpu" { printf "%.3f", ($2 + $3 + $4 + $7 + $8) / hz }' /proc/stat; }

# check_ports NAME=PORT...: before anything starts, name every port that is
# taken and the variable that moves it, and stop. The scripts' default ports
# are all below 32768, outside Linux's ephemeral range: a port a load run's
# client connections used stays in TIME_WAIT for a minute, and PostgreSQL
# could not bind it in the next script.
check_ports() {
  local taken=0 pair
  for pair in "$@"; do
    local name=${pair%%=*} port=${pair#*=}
    [ "$port" = 0 ] && continue
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "port $port is taken (something already listens there); set $name=<a free port> to use another" >&2
      taken=1
    fi
  done
  return "$taken"
}

# stop_apps sends SIGTERM to every instance still running and waits for each,
# printing its exit code: the drain is what the demo shows.
stop_apps() {
  local n code
  for n in "${!app_pids[@]}"; do kill -TERM "${app_pids[$n]}" 2>/dev/null || true; done
  for n in "${!app_pids[@]}"; do
    wait "${app_pids[$n]}" 2>/dev/null && code=0 || code=$?
    # Its last lines are still on their way through the prefixer: let them out first.
    [ -n "${prefixer_pids[$n]:-}" ] && wait "${prefixer_pids[$n]}" 2>/dev/null
    [ "$code" = 127 ] || echo "app$n exited with code $code"
  done
  app_pids=() prefixer_pids=()
}

# cleanup stops everything in reverse start order. The directory (logs, data)
# is removed only after a clean run: after a failure, its logs are kept.
cleanup() {
  local status=$?
  trap '' EXIT
  trap 'for pid in "${app_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done' INT TERM # twice: drain cut short, exit 1
  stop_apps
  local pid
  for pid in "${server_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${server_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -f "$DIR/pg/postmaster.pid" ] && as_pg "$pgbin/pg_ctl" -D "$DIR/pg" -m fast -w stop >/dev/null 2>&1
  wait 2>/dev/null || true # the log prefixers end with their instance's output
  if [ "$status" = 0 ]; then rm -rf "$DIR"; else echo "logs kept in $DIR" >&2; fi
}

# start_services builds the binary and starts PostgreSQL and Redis.
start_services() {
  rm -rf "$DIR" && mkdir -p "$DIR" && chmod 755 "$DIR"
  go build -o "$DIR/kumiko-lifecycle-demo" .
  [ "$(id -u)" -eq 0 ] && chown postgres "$DIR"
  as_pg "$pgbin/initdb" -D "$DIR/pg" -U postgres -A trust --no-sync >/dev/null
  if ! as_pg setsid "$pgbin/pg_ctl" -D "$DIR/pg" -w -l "$DIR/pg.log" \
    -o "-p $PG_PORT -k $DIR -c listen_addresses=127.0.0.1" start >/dev/null; then
    echo "PostgreSQL did not start on :$PG_PORT (set PG_PORT=… to use another port); its log, $DIR/pg.log:" >&2
    tail -n 20 "$DIR/pg.log" >&2
    return 1
  fi
  setsid redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$DIR/redis.log" 2>&1 &
  server_pids+=($!)
  export DATABASE_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
  export REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  export KUMIKO_MASTER_KEY="${KUMIKO_MASTER_KEY:-$(head -c 32 /dev/urandom | base64)}"
  export KUMIKO_MIGRATIONS_MODE=auto-apply # instances apply at once: the advisory lock makes it safe
  export KUMIKO_TRUSTED_PROXIES=127.0.0.1  # HAProxy: its X-Forwarded-For names the client
}

# start_app N [logfile] starts instance appN; its pid goes to $DIR/appN.pid.
# Without a log file its output goes to the terminal, each line prefixed [appN].
start_app() {
  local n=$1 log=${2:-}
  local addrs=(KUMIKO_INSTANCE_ID="app$n" KUMIKO_HTTP_ADDR="127.0.0.1:${API_PORTS[$n]}" KUMIKO_OPS_ADDR="127.0.0.1:${OPS_PORTS[$n]}")
  if [ -n "$log" ]; then
    setsid env "${addrs[@]}" "$DIR/kumiko-lifecycle-demo" >>"$log" 2>&1 &
  else
    # The prefixer reads a FIFO: a child of this script, so stop_apps can wait for its last line.
    rm -f "$DIR/app$n.out" && mkfifo "$DIR/app$n.out"
    setsid sed -u "s/^/[app$n] /" <"$DIR/app$n.out" &
    prefixer_pids[$n]=$!
    setsid env "${addrs[@]}" "$DIR/kumiko-lifecycle-demo" >"$DIR/app$n.out" 2>&1 &
  fi
  app_pids[$n]=$!
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
# instance out of the pool as soon as its /health/ready answers 503. With
# LB_STRICT=1 it never retries nor sends a request elsewhere: every request
# the drain loses is a failed request.
start_lb() {
  local haproxy retry="retries 2
  option redispatch"
  [[ ${LB_STRICT:-0} == 1 ]] && retry="retries 0
  no option redispatch"
  haproxy=$(command -v haproxy || echo /usr/sbin/haproxy)
  cat >"$DIR/haproxy.cfg" <<CFG
defaults
  mode http
  timeout connect 2s
  timeout client 70s
  timeout server 70s # above KUMIKO_SLOW_MAX (60s): HAProxy never cuts a request the app would finish
  $retry
  option forwardfor # the client's address, believed by the apps from 127.0.0.1 only
frontend api
  bind 127.0.0.1:$LB_PORT
  http-request del-header X-Forwarded-For # the edge: a header a client sent names nobody
  stats enable
  stats uri /lb-stats
  default_backend apps
backend apps
  http-response set-header X-Served-By %s # which instance answered: rollload names it for a failed request
  option httpchk GET /health/ready
  http-check expect status 200
  default-server inter ${LB_CHECK_INTERVAL:-500ms} fall 1 rise 2
  server app1 127.0.0.1:${API_PORTS[1]} check port ${OPS_PORTS[1]}
  server app2 127.0.0.1:${API_PORTS[2]} check port ${OPS_PORTS[2]}
CFG
  setsid "$haproxy" -f "$DIR/haproxy.cfg" -db >"$DIR/haproxy.log" 2>&1 &
  server_pids+=($!)
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
