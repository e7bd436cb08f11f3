# stack.sh: the docker-compose topology as local processes, for demo.sh,
# sigterm-demo.sh, leader-demo.sh, rolling-deploy.sh and the benchmarks: a
# throwaway PostgreSQL and Redis, instances of the service, and HAProxy in
# front. Source it; set LB_PORT, PG_PORT, REDIS_PORT and DIR first. Instance N
# listens on API_PORTS[N] and OPS_PORTS[N] (default 808N and 909N). Then:
#
#   trap cleanup EXIT; trap on_signal INT TERM
#
# Stages. Every step that starts something is a stage (`begin`), and says
# what it does as it begins: building, PostgreSQL, Redis, the instances,
# HAProxy. A script that reaches its steady state (demo.sh, at its banner)
# sets stage=running. What an exit does depends on the stage alone:
#   - before `running`, Ctrl+C (SIGINT) or SIGTERM stops whatever started,
#     a PostgreSQL still starting included, removes DIR, says "interrupted
#     while <stage>" and exits 130; a failure stops the same, prints the
#     failed part's last log lines and keeps DIR (its logs);
#   - in `running`, Ctrl+C drains the instances, stops the rest, removes DIR
#     and exits 0; a second Ctrl+C cuts the drain short (the instances and
#     the script exit 1).
# An instance, PostgreSQL, Redis or HAProxy that exits while starting ends the
# wait for it at once (within 0.1 s) with its last log lines.
#
# Every server, instance and log prefixer runs in a session of its own
# (setsid): the SIGINT a terminal sends to its foreground process group on
# Ctrl+C reaches only the script (and the build, initdb or a curl it is
# running), which then stops them in order: the instances first (they drain
# against a live Redis and PostgreSQL, and their drain log still reaches the
# terminal), then HAProxy, Redis and PostgreSQL.

read -r -a API_PORTS <<<"0 ${API_PORT1:-8081} ${API_PORT2:-8082}"
read -r -a OPS_PORTS <<<"0 ${OPS_PORT1:-9091} ${OPS_PORT2:-9092}"

pgbin=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")
# PostgreSQL refuses to run as root: as root, its commands run as postgres.
pg_user=()
[ "$(id -u)" -eq 0 ] && pg_user=(runuser -u postgres --)
as_pg() { "${pg_user[@]}" "$@"; }
stage=preparing interrupted=0 forced=0 pg_starting="" lb_pid=""
app_pids=() app_logs=() prefixer_pids=() server_pids=()

# begin STAGE [NOTE]: the script enters STAGE and says so: "STAGE (NOTE)…".
# (`stage=running` enters the steady state quietly: the script's banner says it.)
begin() {
  stage=$1
  echo "$1${2:+ ($2)}…"
}

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

# reap PID: waits for the child PID and sets reaped to its exit code (127:
# not a child of this shell). A trapped signal ends a wait early (status >
# 128) while the process still runs: it is waited for again. Bash answers a
# second wait for the same PID with the same code: the caller that reaped an
# instance takes it out of app_pids.
reap() {
  local pid=$1
  while :; do
    wait "$pid" 2>/dev/null && reaped=0 || reaped=$?
    ((reaped > 128)) && kill -0 "$pid" 2>/dev/null || break
  done
}

# stop_apps sends SIGTERM to every instance still running and waits for each,
# printing its exit code: the drain is what the demo shows.
stop_apps() {
  local n
  for n in "${!app_pids[@]}"; do kill -TERM "${app_pids[$n]}" 2>/dev/null || true; done
  for n in "${!app_pids[@]}"; do
    reap "${app_pids[$n]}"
    # Its last lines are still on their way through the prefixer: let them out first.
    [ -z "${prefixer_pids[$n]:-}" ] || wait "${prefixer_pids[$n]}" 2>/dev/null || true
    [ "$reaped" = 127 ] || echo "app$n exited with code $reaped"
  done
  app_pids=() prefixer_pids=()
}

# app_exited N: appN has exited by itself (a SIGTERM from elsewhere, a crash):
# it is reaped and its exit code said, after its last lines.
app_exited() {
  local n=$1
  reap "${app_pids[$n]}"
  [ -z "${prefixer_pids[$n]:-}" ] || wait "${prefixer_pids[$n]}" 2>/dev/null || true
  echo "app$n exited with code $reaped"
  unset 'app_pids[n]' 'prefixer_pids[n]'
}

# Starting an instance again, without restarting the rest: from a second
# terminal, `scripts/demo.sh start appN` (request_start) creates
# DIR/start-appN and sends the running demo SIGUSR1; the demo
# (on_start_request, its USR1 trap) starts appN again as its own child, so
# its log reaches the demo's terminal and its Ctrl+C drains it like the
# others.

# on_start_request is a running demo's USR1 trap: each appN asked for, if it
# has exited, starts again with the same ports and settings.
on_start_request() {
  local n
  [ "$stage" = running ] || return 0
  for n in 1 2; do
    [ -f "$DIR/start-app$n" ] || continue
    rm -f "$DIR/start-app$n"
    start_again "$n"
  done
}

# start_again N: appN again, unless it still runs.
start_again() {
  local n=$1
  if [ -n "${app_pids[$n]:-}" ]; then
    if kill -0 "${app_pids[$n]}" 2>/dev/null; then
      echo "app$n still runs (pid ${app_pids[$n]}): not started again"
      return 0
    fi
    app_exited "$n"
  fi
  echo "starting app$n again (asked by scripts/demo.sh start app$n)"
  # The previous run's log stays beside the new one.
  [ ! -f "$DIR/app$n.log" ] || mv "$DIR/app$n.log" "$DIR/app$n.previous.log"
  start_app "$n"
}

# request_start N (from `scripts/demo.sh start appN`, with DIR/demo.run
# sourced: the running demo's pid, HAProxy's and the ports) asks the demo running in DIR to start appN again, and waits
# until appN is ready and HAProxy has marked it UP. It starts nothing itself.
request_start() {
  local n=$1 old pid demo_pid=${demo_pid:-} deadline
  if [ -z "$demo_pid" ] || ! kill -0 "$demo_pid" 2>/dev/null; then
    echo "no demo runs in $DIR (or it has not printed its banner yet): start one with scripts/demo.sh" >&2
    return 1
  fi
  old=$(cat "$DIR/app$n.pid" 2>/dev/null || true)
  if [ -n "$old" ] && kill -0 "$old" 2>/dev/null; then
    echo "app$n still runs (pid $old): drain it first (kill -TERM $old), then start it again" >&2
    return 1
  fi
  : >"$DIR/start-app$n"
  kill -USR1 "$demo_pid"
  # The demo reacts within its 0.2 s watch loop.
  deadline=$((SECONDS + 10))
  until pid=$(cat "$DIR/app$n.pid" 2>/dev/null) && [ "$pid" != "$old" ]; do
    if ((SECONDS > deadline)) || ! kill -0 "$demo_pid" 2>/dev/null; then
      echo "the demo did not start app$n: see its terminal" >&2
      return 1
    fi
    sleep 0.1
  done
  begin "booting app$n" "pid $pid, api :${API_PORTS[$n]}, ops :${OPS_PORTS[$n]}, its log in the demo's terminal and $DIR/app$n.log: a few seconds"
  deadline=$((SECONDS + ${READY_TIMEOUT:-90}))
  until curl -fsS -o /dev/null "http://127.0.0.1:${OPS_PORTS[$n]}/health/ready" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "app$n exited while booting (the demo's terminal has its exit code)" >&2
      show_log "app$n" "$DIR/app$n.log"
      return 1
    elif ((SECONDS > deadline)); then
      echo "app$n is not ready after ${READY_TIMEOUT:-90} s" >&2
      show_log "app$n" "$DIR/app$n.log"
      return 1
    fi
    sleep 0.1
  done
  begin "waiting for HAProxy" "until it marks app$n UP again: a second or two"
  wait_lb "$n" UP
  echo "app$n is ready and HAProxy sends it requests again"
}

# on_signal is the INT and TERM trap: exit, and the EXIT trap (cleanup) does
# what the stage calls for (see Stages above).
on_signal() {
  interrupted=1
  echo
  if [ "$stage" = running ]; then
    echo "stopping: the instances drain first (Ctrl+C again cuts the drain short)"
    exit 0
  fi
  echo "interrupted while $stage: stopping what started"
  exit 130
}

# cleanup is the EXIT trap: it stops everything in reverse start order, then
# removes DIR (logs, data) or, after a failure before `running`, keeps it.
cleanup() {
  local status=$? pid
  trap '' EXIT USR1 # nothing starts again while everything stops
  # A child killed by the same Ctrl+C (status 130) can end the script through
  # set -e before on_signal has run; that SIGINT is then still pending and
  # runs the trap set here. Either way it was an interruption, not a failure.
  [[ $status == 130 || $status == 143 ]] && interrupted=1
  if [ "$stage" = running ]; then
    # A second signal while the instances drain: the instances exit at once, with 1.
    trap 'forced=1; for pid in "${app_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done' INT TERM
  else
    trap 'interrupted=1' INT TERM
  fi
  stop_apps
  for pid in "${server_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${server_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  # pg_ctl start may have forked the postmaster before it wrote
  # postmaster.pid: let the start end (pg_ctl -w: ready, or failed), then stop it.
  [ -z "$pg_starting" ] || wait "$pg_starting" 2>/dev/null || true
  if [ -f "$DIR/pg/postmaster.pid" ]; then
    setsid "${pg_user[@]}" "$pgbin/pg_ctl" -D "$DIR/pg" -m fast -w stop >/dev/null 2>&1 || true
  fi
  wait 2>/dev/null || true # the log prefixers end with their instance's output
  if [ "$stage" = running ]; then
    rm -rf "$DIR"
    ((forced)) && exit 1
    exit 0
  elif ((interrupted)); then
    rm -rf "$DIR"
    echo "interrupted while $stage: everything it started is stopped, $DIR removed" >&2
    exit 130
  elif [ "$status" = 0 ]; then
    rm -rf "$DIR"
  else
    echo "stopped after a failure while $stage; logs kept in $DIR" >&2
    exit "$status"
  fi
}

# show_log NAME LOG: LOG's last lines, indented, on stderr.
show_log() {
  echo "the last lines of $1's log ($2):" >&2
  tail -n "${LOG_LINES:-15}" "$2" 2>/dev/null | sed 's/^/    /' >&2
}

# wait_started NAME PID LOG PROBE...: waits until PROBE (a command) succeeds
# while PID, the server started for NAME, still runs. Fails at once when PID
# has exited (a port taken, a bad setting), and after 30 s, with LOG's last lines.
wait_started() {
  local name=$1 pid=$2 log=$3 deadline=$((SECONDS + 30))
  shift 3
  until kill -0 "$pid" 2>/dev/null && "$@"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      reap "$pid"
      echo "$name exited while starting, with code $reaped" >&2
      show_log "$name" "$log"
      return 1
    fi
    if ((SECONDS > deadline)); then
      echo "$name did not answer within 30 s" >&2
      show_log "$name" "$log"
      return 1
    fi
    sleep 0.1
  done
}

# redis_ping PORT: Redis answers PING on PORT (anything else listening there does not).
redis_ping() {
  local reply
  reply=$( (exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'PING\r\n' >&3 && read -r -t 1 r <&3 && echo "$r") 2>/dev/null) || true
  [[ $reply == +PONG* ]]
}

# start_services builds the binary and starts PostgreSQL and Redis, a stage
# each.
start_services() {
  rm -rf "$DIR" && mkdir -p "$DIR" && chmod 755 "$DIR"
  begin "building the service" "go build: minutes the first time, seconds after"
  go build -o "$DIR/kumiko-lifecycle-demo" .
  [ "$(id -u)" -eq 0 ] && chown postgres "$DIR"
  begin "creating a PostgreSQL cluster" "initdb in $DIR/pg: a few seconds"
  as_pg "$pgbin/initdb" -D "$DIR/pg" -U postgres -A trust --no-sync >/dev/null
  begin "starting PostgreSQL" "on :$PG_PORT"
  # In the background, in a session of its own: a Ctrl+C meanwhile neither
  # cuts pg_ctl short (the postmaster may already run) nor waits for it;
  # cleanup waits for the start to end and then stops the server. A signal
  # between the fork and pg_starting=$! is held until the pid is known:
  # taken in between, cleanup would find neither the start nor, yet, a
  # postmaster.pid, and leave the server running.
  local held=""
  trap 'held=1' INT TERM
  setsid "${pg_user[@]}" "$pgbin/pg_ctl" -D "$DIR/pg" -w -l "$DIR/pg.log" \
    -o "-p $PG_PORT -k $DIR -c listen_addresses=127.0.0.1" start >/dev/null 2>&1 &
  pg_starting=$!
  trap on_signal INT TERM
  [ -z "$held" ] || on_signal
  if ! wait "$pg_starting"; then
    pg_starting=""
    echo "PostgreSQL did not start on :$PG_PORT (set PG_PORT=… to use another port)" >&2
    show_log PostgreSQL "$DIR/pg.log"
    return 1
  fi
  pg_starting=""
  begin "starting Redis" "on :$REDIS_PORT"
  setsid redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$DIR/redis.log" 2>&1 &
  server_pids+=($!)
  wait_started Redis "$!" "$DIR/redis.log" redis_ping "$REDIS_PORT"
  export DATABASE_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"
  export REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  export KUMIKO_MASTER_KEY="${KUMIKO_MASTER_KEY:-$(head -c 32 /dev/urandom | base64)}"
  export KUMIKO_MIGRATIONS_MODE=auto-apply # instances apply at once: the advisory lock makes it safe
  export KUMIKO_TRUSTED_PROXIES=127.0.0.1  # HAProxy: its X-Forwarded-For names the client
}

# start_app N [logfile] starts instance appN; its pid goes to $DIR/appN.pid.
# Without a log file its output goes to the terminal, each line prefixed
# [appN], and to $DIR/appN.log.
start_app() {
  local n=$1 log=${2:-}
  local addrs=(KUMIKO_INSTANCE_ID="app$n" KUMIKO_HTTP_ADDR="127.0.0.1:${API_PORTS[$n]}" KUMIKO_OPS_ADDR="127.0.0.1:${OPS_PORTS[$n]}")
  if [ -n "$log" ]; then
    setsid env "${addrs[@]}" "$DIR/kumiko-lifecycle-demo" >>"$log" 2>&1 &
  else
    log=$DIR/app$n.log
    # The prefixer reads a pipe whose only writer is the instance (this shell
    # closes its end at once): it ends with the instance's last line, and,
    # a child of this script, stop_apps can wait for it. (A FIFO's open would
    # block for good if a Ctrl+C took one side before it opened.)
    local out
    exec {out}> >(exec setsid sed -u -e "w $log" -e "s/^/[app$n] /")
    prefixer_pids[$n]=$!
    setsid env "${addrs[@]}" "$DIR/kumiko-lifecycle-demo" >&"$out" 2>&1 {out}>&- &
    exec {out}>&-
  fi
  app_pids[$n]=$!
  app_logs[$n]=$log
  echo $! >"$DIR/app$n.pid"
}

# wait_ready N...: waits until each appN's readiness answers 200. One that
# exits meanwhile (a bad setting, a port taken) ends the wait within 0.1 s
# with its exit code and its last log lines, and so does one not ready within
# READY_TIMEOUT seconds (90).
wait_ready() {
  local n waiting=("$@") deadline=$((SECONDS + ${READY_TIMEOUT:-90}))
  while ((${#waiting[@]})); do
    for n in "${!waiting[@]}"; do
      local app=${waiting[$n]}
      if curl -fsS -o /dev/null "http://127.0.0.1:${OPS_PORTS[$app]}/health/ready" 2>/dev/null; then
        unset 'waiting[n]'
      elif ! kill -0 "${app_pids[$app]}" 2>/dev/null; then
        reap "${app_pids[$app]}"
        # Its last lines are still on their way through the prefixer.
        [ -z "${prefixer_pids[$app]:-}" ] || wait "${prefixer_pids[$app]}" 2>/dev/null || true
        echo "app$app exited while booting, with code $reaped" >&2
        show_log "app$app" "${app_logs[$app]}"
        unset 'app_pids[app]' # reaped: stop_apps has nothing to wait for
        return 1
      elif ((SECONDS > deadline)); then
        echo "app$app is not ready after ${READY_TIMEOUT:-90} s" >&2
        show_log "app$app" "${app_logs[$app]}"
        return 1
      fi
    done
    ((${#waiting[@]})) && sleep 0.1
  done
  return 0
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
  timeout check 2s # a late answer is a busy host, not a 503 (deploy/haproxy.cfg)
  default-server inter ${LB_CHECK_INTERVAL:-500ms} fall 1 rise 2
  server app1 127.0.0.1:${API_PORTS[1]} check port ${OPS_PORTS[1]}
  server app2 127.0.0.1:${API_PORTS[2]} check port ${OPS_PORTS[2]}
CFG
  setsid "$haproxy" -f "$DIR/haproxy.cfg" -db >"$DIR/haproxy.log" 2>&1 &
  server_pids+=($!)
  lb_pid=$!
}

# wait_lb N UP|DOWN waits until HAProxy itself reports appN in that state,
# read from its stats page: HAProxy routes by what its own checks saw, not by
# what the instance says right now. HAProxy starts with every server UP and
# checks them one after the other, spread over the check interval: UP counts
# once a check has passed (check_status L7OK). HAProxy exiting ends the wait
# at once.
wait_lb() {
  for _ in $(seq 1 600); do
    curl -fsS "http://127.0.0.1:$LB_PORT/lb-stats;csv" 2>/dev/null |
      awk -F, -v s="app$1" -v want="$2" '$1 == "apps" && $2 == s && $18 == want && (want != "UP" || $37 ~ /^L7OK/) { found = 1 }
        END { exit !found }' && return 0
    if ! kill -0 "$lb_pid" 2>/dev/null; then
      reap "$lb_pid"
      echo "HAProxy exited, with code $reaped (set LB_PORT=… to use another port)" >&2
      show_log HAProxy "$DIR/haproxy.log"
      return 1
    fi
    sleep 0.1
  done
  echo "HAProxy did not mark app$1 $2 within 60 s" >&2
  show_log HAProxy "$DIR/haproxy.log"
  return 1
}
