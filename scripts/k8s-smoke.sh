#!/usr/bin/env bash
# Usage: scripts/k8s-smoke.sh   (root, Debian; RATE and KUMIKO_K8S_CACHE in the environment)
#
# k8s-smoke.sh: runs k8s/ as shipped (plus the one dev overlay, k8s/dev/) on a
# one-node Kubernetes cluster built from source on this machine, and checks
# what docs/operations.md's Kubernetes section promises of it:
#   - the migrate Job completes before the Deployment turns ready;
#   - `kubectl rollout restart` under load through the Service's ClusterIP
#     (80 % GET, 20 % POST; one keep-alive pool and one fresh connection per
#     request) loses no request; every old pod logs its whole drain and exits
#     0 by itself (no SIGKILL);
#   - per terminated pod, the race the linger exists for: SIGTERM → removal
#     from the EndpointSlice → kube-proxy's iptables no longer naming it →
#     the last request it served;
#   - an event stream through the Service resumes on another pod with
#     Last-Event-ID, no event missing;
#   - `kubectl delete pod` of the leader hands the lock over within 1 s, and
#     no cron tick is enqueued twice or lost;
#   - `kubectl drain` honours the PodDisruptionBudget;
#   - a drain abandoned by a second SIGTERM restarts the container in place,
#     and `kubectl describe pod` shows the app's termination message.
#
# The cluster: etcd (Debian etcd-server), kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy (iptables
# mode) and kubectl built from the k8s.io/kubernetes module of the Go module
# proxy, CoreDNS built from its module, containerd and runc and the CNI
# bridge plugin from Debian. Binaries are cached in $KUMIKO_K8S_CACHE
# (default /var/cache/kumiko-k8s, outside the checkout), keyed by version.
# Images: postgres, redis and the Dockerfile's bases, present, pulled or built
# as stand-ins by scripts/lib/docker.sh (as scripts/compose-smoke.sh does; after
# it they are reused), the app image built from this checkout, and a pause
# stand-in, copied from Docker into this cluster's own containerd.
#
# Everything listens on loopback or on the cluster's own bridge (10.244.0.1)
# and its pod and service addresses. Everything it starts is stopped on exit,
# also on failure: processes, mounts, network namespaces, iptables chains,
# the bridge, and the sysctls it changed are set back. It needs root on
# Debian with cgroup v1 or v2. Prints one summary line; exits non-zero on any
# failure after printing what it saw. Knobs: RATE (req/s, default 240).
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."

K8S_VERSION=v1.34.2
K8S_STAGING_VERSION=v0.34.2 # the published k8s.io/* modules of that release
COREDNS_VERSION=v1.13.1
PAUSE_IMAGE=registry.k8s.io/pause:3.10
CACHE=${KUMIKO_K8S_CACHE:-/var/cache/kumiko-k8s}
BIN=$CACHE/$K8S_VERSION/bin
COREDNS=$CACHE/coredns-$COREDNS_VERSION/coredns
RATE=${RATE:-240}
NODE=kumiko-node
BRIDGE=kumiko0
NODE_IP=10.244.0.1 # the bridge's address: the node's, and where CoreDNS listens
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/16
ETCD_PORT=12379
API_PORT=16443
APP=kumiko-lifecycle-demo
WORK=$(mktemp -d /tmp/k8s-smoke.XXXXXX)
LOGS=$WORK/logs
SOCK=$WORK/containerd.sock
KUBECONFIG=$WORK/admin.kubeconfig
export KUBECONFIG
export TZ=UTC # vegeta's and the app's timestamps then compare as they are
START=$(date +%s.%N)
STEP="setup"
SUMMARY=""
ENGINE_PID=""
daemons=() # "name:pid", in start order
bg_pids=() # watchers and load generators, stopped first
sysctls=() # "key=old value", set back on exit
netns_before=""
mkdir -p "$LOGS"
export PATH="$BIN:$PATH:$(go env GOPATH 2>/dev/null || echo /root/go)/bin"

# Every kubectl call here is bounded, whatever its own --timeout does
# (`rollout status` of two Deployments was seen to outlive its --timeout).
kubectl() { timeout 300 "$BIN/kubectl" "$@"; }

say() { echo "k8s-smoke: $*" >&2; }
fail() {
  say "FAIL in step '$STEP': $*"
  exit 1
}
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "") print "?"; else printf "%d", (b - a) * 1000 }'; }
# epoch converts an RFC 3339 time (the app's log) into seconds since 1970;
# JQ_EPOCH does the same inside jq (whose fromdate drops fractions).
epoch() { [ -n "$1" ] && date -d "$1" +%s.%N || echo ""; }
JQ_EPOCH='def epoch: (sub("\\.[0-9]+"; "") | sub("\\+00:00$"; "Z") | fromdateiso8601) + (try (capture("(?<f>\\.[0-9]+)").f | tonumber) catch 0);' 

# wait_for DESC SECONDS CMD...: polls CMD every 0.2 s until it succeeds, at
# most SECONDS; a failure names what was awaited.
wait_for() {
  local desc=$1 limit=$2 deadline
  shift 2
  deadline=$(($(date +%s) + limit))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "$desc: not within ${limit}s"
    sleep 0.2
  done
}

# ---- teardown ----

# stop_pid NAME PID SECONDS: SIGTERM, a bounded wait, then SIGKILL.
stop_pid() {
  local name=$1 pid=$2 limit=$3
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq $((limit * 5))); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  say "$name ($pid) did not stop within ${limit}s: SIGKILL"
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}

daemon_pid() {
  local d
  for d in "${daemons[@]}"; do [ "${d%%:*}" = "$1" ] && echo "${d#*:}"; done
  return 0
}

# ipt_remove_ours TOOL: removes every rule that jumps to a KUBE-* or CNI-*
# chain from the built-in chains, then those chains, in every table — the
# chains kubelet, kube-proxy and the CNI plugins made, nothing of anyone else.
ipt_remove_ours() {
  local tool=$1 table rule chain
  command -v "$tool" >/dev/null || return 0
  for table in filter nat mangle raw; do
    "$tool"-save -t "$table" 2>/dev/null | grep -E '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j (KUBE-|CNI-)' |
      while read -r rule; do
        # shellcheck disable=SC2086 # the rule's words are iptables arguments
        eval "$tool -t $table -D ${rule#-A }" 2>/dev/null || true
      done
    for chain in $("$tool"-save -t "$table" 2>/dev/null | sed -n 's/^:\(\(KUBE\|CNI\)-[^ ]*\) .*/\1/p'); do
      "$tool" -t "$table" -F "$chain" 2>/dev/null || true
    done
    for chain in $("$tool"-save -t "$table" 2>/dev/null | sed -n 's/^:\(\(KUBE\|CNI\)-[^ ]*\) .*/\1/p'); do
      "$tool" -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
}

# teardown leaves nothing behind and reports what it could not remove.
teardown() {
  local left=() pid d m ns
  # Workloads first, while the kubelet still runs: it stops each pod's
  # sandbox, which calls the CNI plugin's DEL (veth, IP) and removes the
  # network namespace.
  if [ -n "$(daemon_pid kubelet)" ] && kubectl get --raw /readyz >/dev/null 2>&1; then
    kubectl delete deployment,job,statefulset --all --wait=false >/dev/null 2>&1 || true
    kubectl delete pod --all --grace-period=1 --timeout=90s >"$LOGS/teardown-delete.log" 2>&1 || true
    for _ in $(seq 150); do
      [ -z "$(ctr --address "$SOCK" -n k8s.io tasks ls -q 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  for pid in "${bg_pids[@]}"; do stop_pid watcher "$pid" 5; done
  # kube-proxy and the kubelet, then what containerd still runs (its shims
  # outlive it), then containerd and the control plane, newest first.
  for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do
    d=${daemons[$i]}
    if [ "${d%%:*}" = containerd ] && [ -S "$SOCK" ]; then
      for c in $(ctr --address "$SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
        ctr --address "$SOCK" -n k8s.io tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true
      done
      for _ in $(seq 50); do
        [ -z "$(ctr --address "$SOCK" -n k8s.io tasks ls 2>/dev/null | awk 'NR > 1 && $3 != "STOPPED"')" ] && break
        sleep 0.2
      done
      for c in $(ctr --address "$SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
        ctr --address "$SOCK" -n k8s.io tasks delete -f "$c" >/dev/null 2>&1 || true
      done
      for c in $(ctr --address "$SOCK" -n k8s.io containers ls -q 2>/dev/null); do
        ctr --address "$SOCK" -n k8s.io containers delete "$c" >/dev/null 2>&1 || true
      done
    fi
    stop_pid "${d%%:*}" "${d#*:}" 20
  done
  # Shims of this containerd (they name its socket) that are still alive.
  for pid in $(grep -l -- "$SOCK" /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
    [ "$pid" = $$ ] || kill -KILL "$pid" 2>/dev/null || true
  done
  [ -x "$BIN/kube-proxy" ] && [ -n "$(daemon_pid kube-proxy)" ] &&
    "$BIN/kube-proxy" --cleanup >"$LOGS/kube-proxy-cleanup.log" 2>&1 || true
  ipt_remove_ours iptables
  ipt_remove_ours ip6tables
  while iptables -D FORWARD -i "$BRIDGE" -m comment --comment kumiko-k8s-smoke -j ACCEPT 2>/dev/null; do :; done
  while iptables -D FORWARD -o "$BRIDGE" -m comment --comment kumiko-k8s-smoke -j ACCEPT 2>/dev/null; do :; done
  # Network namespaces the CRI made that its stop did not remove.
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ " $netns_before " == *" $ns "* ]] || [[ "$ns" != cni-* ]] || ip netns delete "$ns" 2>/dev/null || true
  done
  # Mounts under the work dir (pod volumes, overlay snapshots, shm), deepest first.
  for m in $(awk -v w="$WORK" 'index($5, w) == 1 { print $5 }' /proc/self/mountinfo | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE" 2>/dev/null
  for pid in $(ip -o link show type veth 2>/dev/null | awk -F'[ :@]+' -v b="$BRIDGE" '$0 ~ "master " b { print $2 }'); do
    ip link delete "$pid" 2>/dev/null || true
  done
  for ((i = ${#sysctls[@]} - 1; i >= 0; i--)); do
    sysctl -qw "${sysctls[$i]}" >/dev/null 2>&1 || true
  done
  [ -n "$ENGINE_PID" ] && stop_pid dockerd "$ENGINE_PID" 30

  # What is still there?
  for d in "${daemons[@]}" "${bg_pids[@]/#/watcher:}"; do
    kill -0 "${d#*:}" 2>/dev/null && left+=("process ${d%%:*} ${d#*:}")
  done
  m=$(awk -v w="$WORK" 'index($5, w) == 1 { print $5 }' /proc/self/mountinfo)
  [ -n "$m" ] && left+=("mounts: $m")
  ip link show "$BRIDGE" >/dev/null 2>&1 && left+=("interface $BRIDGE")
  for d in iptables ip6tables; do
    command -v "$d" >/dev/null || continue
    m=$("$d"-save 2>/dev/null | grep -cE '^:(KUBE|CNI)-|kumiko-k8s-smoke' || true)
    [ "$m" = 0 ] || left+=("$d: $m KUBE-/CNI- chains or rules")
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ " $netns_before " == *" $ns "* ]] || left+=("netns $ns")
  done
  if ((${#left[@]})); then
    printf '%s\n' "${left[@]}" >&2
    return 1
  fi
}

on_exit() {
  local rc=$? keep
  trap '' EXIT INT TERM
  if [ "$rc" -ne 0 ]; then
    say "---- what was seen (step '$STEP', exit $rc) ----"
    if [ -s "$KUBECONFIG" ] && kubectl get --raw /readyz >/dev/null 2>&1; then
      kubectl get nodes,pods,jobs,endpointslices -o wide 2>&1 | sed 's/^/  /' >&2 || true
      kubectl get events --sort-by=.lastTimestamp 2>&1 | tail -n 25 | sed 's/^/  event: /' >&2 || true
      for p in $(kubectl get pods -o name 2>/dev/null); do
        kubectl logs --tail 15 "$p" 2>&1 | sed "s|^|  ${p#pod/}: |" >&2 || true
      done
    fi
    for f in "$LOGS"/*.log; do
      [ -s "$f" ] || continue
      case "$(basename "$f")" in build* | kubelet.log | kube-apiserver.log | containerd.log | load-failed.log | kube-proxy.log) ;; *) continue ;; esac
      say "---- tail of $(basename "$f") ----"
      tail -n 15 "$f" >&2
    done
  fi
  if ! teardown; then
    say "FAIL: teardown left the above behind"
    rc=1
  fi
  if [ "$rc" -ne 0 ]; then
    keep=$(mktemp -d /tmp/k8s-smoke-logs.XXXXXX)
    cp -r "$LOGS/." "$keep/" 2>/dev/null || true
    say "logs kept in $keep"
  fi
  rm -rf "$WORK"
  [ "$rc" -eq 0 ] && [ -n "$SUMMARY" ] && echo "$SUMMARY total=$(secs "$START" "$(now)")s"
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# start NAME CMD...: a daemon in a session of its own, its output in $LOGS/NAME.log.
start() {
  local name=$1
  shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 &
  daemons+=("$name:$!")
}
# alive NAME: fails (with the log's tail) when the daemon has died.
alive() {
  local pid
  pid=$(daemon_pid "$1")
  kill -0 "$pid" 2>/dev/null && return 0
  tail -n 20 "$LOGS/$1.log" >&2
  fail "$1 exited"
}

# ---- tools ----
STEP="tools"
[ "$(id -u)" -eq 0 ] || fail "run as root (containerd, iptables, mounts)"
missing=()
for pair in containerd:containerd runc:runc iptables:iptables etcd:etcd-server conntrack:conntrack jq:jq curl:curl openssl:openssl; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
# Docker, its stand-in images and vegeta: the steps scripts/compose-smoke.sh
# takes too, so this script also works alone on a fresh machine.
DOCKER_LOGS=$LOGS
# shellcheck source=scripts/lib/docker.sh
. scripts/lib/docker.sh
((${#missing[@]} == 0)) || apt_install "${missing[@]}"
docker_tools

# ---- binaries: built once per version, outside the checkout ----
STEP="build"
t=$(now)
build_what=cached
k8s_bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
need_build=0
for b in "${k8s_bins[@]}"; do [ -x "$BIN/$b" ] || need_build=1; done
if [ "$need_build" = 1 ]; then
  build_what=built
  say "building Kubernetes $K8S_VERSION from the module proxy into $BIN (cold: 35 min here on 2 busy cores)"
  src=$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | jq -r .Dir) || fail "go mod download k8s.io/kubernetes@$K8S_VERSION"
  rm -rf "$CACHE/src-$K8S_VERSION" && mkdir -p "$CACHE" "$BIN.tmp"
  cp -r "$src" "$CACHE/src-$K8S_VERSION" && chmod -R u+w "$CACHE/src-$K8S_VERSION"
  # The module holds the tree but not its staging modules: use the published
  # k8s.io/* modules of the same release instead of ./staging/src/k8s.io/*.
  rm -f "$CACHE/src-$K8S_VERSION/go.work" "$CACHE/src-$K8S_VERSION/go.work.sum"
  sed -i -E "s#^(\s*k8s\.io/[a-z-]+) => \./staging/src/k8s\.io/[a-z-]+\$#\1 => \1 $K8S_STAGING_VERSION#" "$CACHE/src-$K8S_VERSION/go.mod"
  v=k8s.io/component-base/version
  (cd "$CACHE/src-$K8S_VERSION" && GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X $v.gitVersion=$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=34 -X $v.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION" \
    -o "$BIN.tmp/" "${k8s_bins[@]/#/./cmd/}") >"$LOGS/build.log" 2>&1 || fail "building Kubernetes"
  rm -rf "$BIN" && mv "$BIN.tmp" "$BIN" && rm -rf "$CACHE/src-$K8S_VERSION"
fi
if [ ! -x "$COREDNS" ]; then
  build_what=built
  say "building CoreDNS $COREDNS_VERSION (kubernetes, bind, cache, errors, log, ready plugins) into $(dirname "$COREDNS")"
  d=$CACHE/coredns-$COREDNS_VERSION/src
  rm -rf "$d" && mkdir -p "$d"
  cat >"$d/main.go" <<'EOF'
// CoreDNS with only the plugins the k8s smoke test's Corefile uses (the
// upstream main imports every plugin, cloud SDKs included).
package main

import (
	_ "github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() { coremain.Run() }
EOF
  printf 'module kumiko-k8s-smoke/coredns\n\ngo 1.24.0\n\nrequire (\n\tgithub.com/coredns/coredns %s\n\tk8s.io/client-go %s\n)\n' \
    "$COREDNS_VERSION" "$K8S_STAGING_VERSION" >"$d/go.mod"
  (cd "$d" && GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0 go mod tidy && GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0 \
    go build -trimpath -ldflags "-s -w" -o "$COREDNS.tmp" .) >>"$LOGS/build.log" 2>&1 || fail "building CoreDNS"
  mv "$COREDNS.tmp" "$COREDNS" && rm -rf "$d"
fi
build_secs=$(secs "$t" "$(now)")

# ---- images: from Docker into this cluster's containerd ----
STEP="images"
t=$(now)
docker_engine
# docker build --progress needs the buildx plugin: Debian's docker.io has
# only the legacy builder, which refuses the flag.
docker_plugins
for image in postgres:16 redis:7 $(sed -n 's/^FROM \([^ ]*\).*/\1/p' Dockerfile); do
  ensure "$image" || fail "no image $image and no stand-in for it"
done
for s in "${standins[@]}"; do say "stand-in: $s"; done
pause_hash=$(cat deploy/standins/pause.Dockerfile deploy/standins/pause/main.go | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{index .Config.Labels "org.kumiko.standin.source"}}' "$PAUSE_IMAGE" 2>/dev/null)" != "$pause_hash" ]; then
  say "building stand-in $PAUSE_IMAGE from deploy/standins/pause.Dockerfile"
  docker build --progress=plain --label "org.kumiko.standin.source=$pause_hash" -t "$PAUSE_IMAGE" \
    -f deploy/standins/pause.Dockerfile deploy/standins/pause >"$LOGS/build.log" 2>&1 || fail "building $PAUSE_IMAGE"
fi
# The same build arguments as compose-smoke.sh's: right after it (as in CI)
# every layer is cached and this takes a second.
docker build --progress=plain --build-arg GOPROXY="$(go env GOPROXY)" --build-arg VERSION=compose-smoke \
  -t "$APP:local" . >"$LOGS/build.log" 2>&1 || fail "docker build $APP:local"
docker save -o "$WORK/images.tar" "$APP:local" postgres:16 redis:7 "$PAUSE_IMAGE" || fail "docker save"
if [ -n "$ENGINE_PID" ]; then stop_pid dockerd "$ENGINE_PID" 30 && ENGINE_PID=""; fi
images_secs=$(secs "$t" "$(now)")

# ---- the node: sysctls, bridge, certificates ----
STEP="cluster start"
cluster_t=$(now)
netns_before=$(ip netns list 2>/dev/null | awk '{print $1}' | tr '\n' ' ')
# set_sysctl KEY VALUE, remembering the old value for the teardown. The
# kubelet sets the kernel ones itself (protectKernelDefaults: false); they
# are listed here so that they are set back, too.
set_sysctl() {
  local old
  old=$(sysctl -n "$1" 2>/dev/null) || return 0
  sysctls+=("$1=$old")
  [ -n "${2:-}" ] && sysctl -qw "$1=$2"
  return 0
}
set_sysctl net.ipv4.ip_forward 1
set_sysctl net.bridge.bridge-nf-call-iptables 1 # pod → Service → pod on one bridge passes kube-proxy's rules
set_sysctl net.bridge.bridge-nf-call-ip6tables
for k in vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes; do
  set_sysctl "$k"
done
[ "$(sysctl -n net.bridge.bridge-nf-call-iptables 2>/dev/null)" = 1 ] || fail "net.bridge.bridge-nf-call-iptables is not 1 (no br_netfilter?)"
# The bridge exists before the first pod, so the node address and CoreDNS
# can use it; the CNI bridge plugin takes it over as the pods' gateway.
ip link add "$BRIDGE" type bridge || fail "ip link add $BRIDGE type bridge"
ip addr add "$NODE_IP/24" dev "$BRIDGE" && ip link set "$BRIDGE" up
# Docker sets the FORWARD policy to DROP: let the pods' traffic through.
iptables -I FORWARD -i "$BRIDGE" -m comment --comment kumiko-k8s-smoke -j ACCEPT
iptables -I FORWARD -o "$BRIDGE" -m comment --comment kumiko-k8s-smoke -j ACCEPT

pki=$WORK/pki
mkdir -p "$pki"
(
  cd "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=kumiko-k8s-smoke-ca
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver
  printf 'subjectAltName=IP:127.0.0.1,IP:%s,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n' "$NODE_IP" >san.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile san.ext -out apiserver.crt
  openssl genrsa -out sa.key 2048 && openssl rsa -in sa.key -pubout -out sa.pub
) >"$LOGS/pki.log" 2>&1 || fail "openssl (see $LOGS/pki.log)"
TOKEN=$(head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
echo "$TOKEN,kumiko-smoke-admin,1,system:masters" >"$pki/tokens.csv"
kubectl config set-cluster smoke --server="https://127.0.0.1:$API_PORT" --certificate-authority="$pki/ca.crt" --embed-certs >/dev/null
kubectl config set-credentials admin --token="$TOKEN" >/dev/null
kubectl config set-context smoke --cluster=smoke --user=admin >/dev/null
kubectl config use-context smoke >/dev/null

# ---- control plane ----
start etcd etcd --name smoke --data-dir "$WORK/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" --listen-peer-urls http://127.0.0.1:$((ETCD_PORT + 1)) \
  --initial-advertise-peer-urls http://127.0.0.1:$((ETCD_PORT + 1)) --initial-cluster "smoke=http://127.0.0.1:$((ETCD_PORT + 1))" \
  --unsafe-no-fsync
wait_for "etcd healthy" 60 curl -fsS "http://127.0.0.1:$ETCD_PORT/health"
start kube-apiserver kube-apiserver --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=127.0.0.1 --secure-port="$API_PORT" --advertise-address="$NODE_IP" \
  --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" --client-ca-file="$pki/ca.crt" \
  --token-auth-file="$pki/tokens.csv" --authorization-mode=Node,RBAC --allow-privileged=true \
  --service-cluster-ip-range="$SERVICE_CIDR" --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
  --kubelet-preferred-address-types=InternalIP --profiling=false
wait_for "kube-apiserver /readyz" 120 kubectl get --raw /readyz
start kube-controller-manager kube-controller-manager --kubeconfig="$KUBECONFIG" --bind-address=127.0.0.1 \
  --leader-elect=false --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
  --use-service-account-credentials=false --controllers='*,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller' \
  --profiling=false
start kube-scheduler kube-scheduler --kubeconfig="$KUBECONFIG" --bind-address=127.0.0.1 --leader-elect=false --profiling=false

# ---- node: containerd, kubelet, kube-proxy, CoreDNS ----
mkdir -p "$WORK/cni/net.d" "$WORK/containerd"
cat >"$WORK/cni/net.d/10-kumiko.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "kumiko", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "subnet": "$POD_CIDR", "gateway": "$NODE_IP", "dataDir": "$WORK/cni/ipam",
            "routes": [{"dst": "0.0.0.0/0"}]}}]}
EOF
cat >"$WORK/containerd/config.toml" <<EOF
version = 2
root = "$WORK/containerd/root"
state = "$WORK/containerd/state"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.internal.v1.opt"]
  path = "$WORK/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This machine refuses a negative oom_score_adj even to root ("echo -998 >
  # /proc/self/oom_score_adj: Permission denied"), and the CRI gives every pod
  # sandbox -998: runc then fails with "can't get final child's PID from pipe:
  # EOF". Clamp to containerd's own score (0) instead, as rootless setups do.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$WORK/cni/net.d"
EOF
start containerd containerd --config "$WORK/containerd/config.toml"
wait_for "containerd answers" 60 ctr --address "$SOCK" version
ctr --address "$SOCK" -n k8s.io images import "$WORK/images.tar" >"$LOGS/import.log" 2>&1 || { cat "$LOGS/import.log" >&2; fail "ctr images import"; }
rm -f "$WORK/images.tar"

echo "nameserver $NODE_IP" >"$WORK/resolv.conf" # the host's resolvers are not the pods' business
cgroup_v1=false
[ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ] || cgroup_v1=true
cat >"$WORK/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 hosts (this CI machine) are still supported by 1.34 when asked.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$SOCK
address: $NODE_IP
port: 10250
healthzBindAddress: 127.0.0.1
healthzPort: 10248
readOnlyPort: 0
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
resolvConf: $WORK/resolv.conf
failSwapOn: false
podLogsDir: $WORK/pod-logs
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
EOF
[ "$cgroup_v1" = true ] || sed -i '/failCgroupV1/d' "$WORK/kubelet.yaml"
start kubelet kubelet --config="$WORK/kubelet.yaml" --kubeconfig="$KUBECONFIG" --root-dir="$WORK/kubelet" \
  --hostname-override="$NODE" --node-ip="$NODE_IP" --v=1
wait_for "node $NODE registered" 120 kubectl get node "$NODE"
kubectl wait --for=condition=Ready "node/$NODE" --timeout=120s >/dev/null || { alive kubelet; fail "node not Ready"; }

cat >"$WORK/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $KUBECONFIG}
mode: iptables
clusterCIDR: 10.244.0.0/16
hostnameOverride: $NODE
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# Leave the host's conntrack settings and route_localnet alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false}
EOF
start kube-proxy kube-proxy --config="$WORK/kube-proxy.yaml"
wait_for "kube-proxy healthz" 60 curl -fsS http://127.0.0.1:10256/healthz

# CoreDNS runs on the node, on the bridge address the kubelet gives pods as
# their nameserver: the same binary and kubernetes plugin as the in-cluster
# Deployment of a real cluster, without needing a CoreDNS image.
cat >"$WORK/Corefile" <<EOF
cluster.local:53 in-addr.arpa:53 {
  bind $NODE_IP
  errors
  ready 127.0.0.1:18181
  kubernetes cluster.local in-addr.arpa {
    kubeconfig $KUBECONFIG smoke
    pods insecure
  }
  cache 5
}
EOF
start coredns "$COREDNS" -conf "$WORK/Corefile"
wait_for "CoreDNS ready (kubernetes plugin synced)" 60 curl -fsS http://127.0.0.1:18181/ready
wait_for "the default ServiceAccount" 60 kubectl get serviceaccount default
cluster_secs=$(secs "$cluster_t" "$(now)")
say "cluster up in ${cluster_secs}s (build ${build_secs}s $build_what, images ${images_secs}s)"

# ---- deploy: dev dependencies, the migrate Job, then k8s/ ----
STEP="deploy"
kubectl kustomize --load-restrictor=LoadRestrictionsNone k8s/dev >"$WORK/dev.yaml" || fail "kubectl kustomize k8s/dev"
# pick PATTERN: the documents of the rendered overlay that match PATTERN.
pick() { awk -v pat="$1" 'BEGIN { RS = "\n---\n" } $0 ~ pat { print "---"; print }' "$WORK/dev.yaml"; }
pick 'kumiko.dev/dependency' | kubectl apply -f - >"$LOGS/apply.log" || fail "applying the dev dependencies"
kubectl rollout status deployment/postgres deployment/redis --timeout=180s >>"$LOGS/apply.log" 2>&1 ||
  fail "postgres/redis not ready"
pick '\nkind: Job\n' | kubectl apply -f - >>"$LOGS/apply.log" || fail "applying the migrate Job"
kubectl wait --for=condition=complete "job/$APP-migrate" --timeout=180s >/dev/null || fail "the migrate Job did not complete"
kubectl apply -f "$WORK/dev.yaml" >>"$LOGS/apply.log" || fail "kubectl apply k8s/dev"
kubectl rollout status "deployment/$APP" --timeout=240s >>"$LOGS/apply.log" 2>&1 || fail "the Deployment did not turn ready"
job_done=$(epoch "$(kubectl get job "$APP-migrate" -o jsonpath='{.status.completionTime}')")
first_ready=$(kubectl get pods -l app=$APP -o jsonpath='{range .items[*]}{range .status.conditions[?(@.type=="Ready")]}{.lastTransitionTime}{"\n"}{end}{end}' | sort | head -n 1)
[ -n "$first_ready" ] || fail "no app pod has a Ready condition"
awk -v a="$job_done" -v b="$(epoch "$first_ready")" 'BEGIN { exit !(a <= b) }' ||
  fail "an app pod turned ready ($first_ready) before the migrate Job completed"
ip=$(kubectl get service "$APP" -o jsonpath='{.spec.clusterIP}')
URL="http://$ip"
wait_for "GET $URL/api/instance through the ClusterIP" 60 curl -fsS -m 2 "$URL/api/instance"

# ---- a stream through the Service, the load, and the watchers ----
STEP="rollout restart under load"
# The watchers print one timestamped line per change: EndpointSlice
# conditions, kube-proxy's DNAT targets for the Service, pod phases.
stamp() { while IFS= read -r line; do echo "$EPOCHREALTIME $line"; done; }
watch_bg() {
  local name=$1
  shift
  setsid bash -c "$* 2>&1 | { while IFS= read -r line; do echo \"\$EPOCHREALTIME \$line\"; done; }" >"$LOGS/$name.watch" &
  bg_pids+=($!)
}
# (-o jsonpath printed the first state only; JSON through jq prints every update.)
watch_bg endpointslices "$BIN/kubectl get endpointslices -l kubernetes.io/service-name=$APP -w -o json | jq -c --unbuffered '[.endpoints // [] | .[] | \"\\(.targetRef.name)=\\(.conditions.ready),\\(.addresses[0])\"] | join(\" \")'"
watch_bg pods "$BIN/kubectl get pods -l app=$APP -w -o jsonpath='{.metadata.name} {.status.podIP} {.metadata.deletionTimestamp} exit={.status.containerStatuses[0].state.terminated.exitCode} reason={.status.containerStatuses[0].state.terminated.reason}{\"\\n\"}'"
# kube-proxy's view: the endpoints its Service chain sends new connections
# to (the "default/<service>:http -> IP:port" jumps of the KUBE-SVC chain),
# every 50 ms while the test runs (bounded: 12,000 polls).
svc_dnat() { iptables-save -t nat 2>/dev/null | awk -v p="default/$APP:http -> " '{ i = index($0, p); if (i) { s = substr($0, i + length(p)); sub(/".*/, "", s); print s } }' | sort | tr '\n' ' '; }
export -f svc_dnat
export APP
watch_bg iptables "prev=; for _ in \$(seq 12000); do cur=\$(svc_dnat); [ \"\$cur\" = \"\$prev\" ] || echo \"\$cur\"; prev=\$cur; sleep 0.05; done"
old_pods=$(kubectl get pods -l app=$APP --field-selector=status.phase=Running -o jsonpath='{range .items[*]}{.metadata.name}={.status.podIP} {end}')
for p in $old_pods; do watch_bg "log-${p%%=*}" "$BIN/kubectl logs -f ${p%%=*}"; done

# The target mix: of every 10 requests, 4 GET /api/instance (its body names
# the pod that served it) and the others GET the API port's /health.
# The event stream is checked with the instances' state changes, which every
# pod of the rollout writes (starting→ready, ready→draining).
stream_event=instance.state_changed
# demo:begin (the orders demo; scripts/new-service.sh --bare removes this block)
# With the orders demo, orders to read first; then of every 10 requests 4 GET
# an order (with the read token its POST answered) and 2 POST an order, and
# the stream is checked with their order.created events.
stream_event=order.created
ids=() tokens=()
for i in $(seq 20); do
  created=$(curl -fsS -m 5 -H 'Content-Type: application/json' -d "{\"customer\":\"k8s-smoke-$i\",\"items\":[{\"sku\":\"a\",\"qty\":1,\"priceCents\":250}]}" "$URL/api/orders") ||
    fail "POST /api/orders through the ClusterIP"
  ids+=("$(jq -r .id <<<"$created")") tokens+=("$(jq -r .readToken <<<"$created")")
done
body=$(echo -n '{"customer":"k8s-smoke-load","items":[{"sku":"b","qty":2,"priceCents":100}]}' | base64 -w0)
# demo:end
: >"$WORK/targets"
for i in $(seq 0 19); do
  case $((i % 10)) in
  # demo:begin (the orders demo; scripts/new-service.sh --bare removes this block)
  0 | 1 | 2 | 3) echo "{\"method\":\"GET\",\"url\":\"$URL/api/orders/${ids[$i]}\",\"header\":{\"Authorization\":[\"Bearer ${tokens[$i]}\"]}}" ;;
  8 | 9) echo "{\"method\":\"POST\",\"url\":\"$URL/api/orders\",\"body\":\"$body\",\"header\":{\"Content-Type\":[\"application/json\"]}}" ;;
  # demo:end
  4 | 5 | 6 | 7) echo "{\"method\":\"GET\",\"url\":\"$URL/api/instance\"}" ;;
  *) echo "{\"method\":\"GET\",\"url\":\"$URL/health\"}" ;;
  esac
done >>"$WORK/targets"

# The stream: reconnects (bounded) with the last id it saw, as a browser's
# EventSource does after `event: shutdown`.
sse_client() {
  local last="" n
  for n in $(seq 40); do
    [ -f "$WORK/sse.stop" ] && break
    echo "$EPOCHREALTIME connect $n last=$last" >>"$WORK/sse.connects"
    if [ -n "$last" ]; then
      curl -sN -m 600 -H "Last-Event-ID: $last" "$URL/api/events" >>"$WORK/sse.raw" 2>/dev/null || true
    else
      curl -sN -m 600 "$URL/api/events" >>"$WORK/sse.raw" 2>/dev/null || true
    fi
    last=$(sed -n 's/^id: *//p' "$WORK/sse.raw" | tail -n 1)
    sleep 0.2
  done
}
export -f sse_client
export WORK URL
setsid bash -c sse_client &
sse_pid=$!
bg_pids+=("$sse_pid")
wait_for "the event stream connected" 30 test -s "$WORK/sse.connects"

half=$((RATE / 2))
setsid vegeta attack -targets="$WORK/targets" -format=json -rate="$half/s" -duration=300s -timeout=10s -output="$WORK/load-pool.bin" &
pool_pid=$!
setsid vegeta attack -targets="$WORK/targets" -format=json -rate="$half/s" -duration=300s -timeout=10s -keepalive=false -output="$WORK/load-fresh.bin" &
fresh_pid=$!
bg_pids+=("$pool_pid" "$fresh_pid")
wait_for "the load running" 20 test -s "$WORK/load-fresh.bin"
sleep 2 # a steady state to compare with: two seconds of load on the old pods
t=$(now)
kubectl rollout restart "deployment/$APP" >/dev/null
kubectl rollout status "deployment/$APP" --timeout=300s >>"$LOGS/rollout.log" 2>&1 || fail "rollout restart did not complete"
for p in $old_pods; do
  kubectl wait --for=delete "pod/${p%%=*}" --timeout=90s >/dev/null 2>&1 || fail "old pod ${p%%=*} still exists 90s after the rollout"
done
rollout_secs=$(secs "$t" "$(now)")
sleep 2 # two more seconds of load on the new pods only
kill -INT "$pool_pid" "$fresh_pid" 2>/dev/null || true
wait "$pool_pid" "$fresh_pid" 2>/dev/null || true
vegeta encode -to json "$WORK/load-pool.bin" "$WORK/load-fresh.bin" >"$WORK/load.json"
requests=$(wc -l <"$WORK/load.json")
jq -r 'select(.code < 200 or .code > 299) | "\(.timestamp) \(.method) \(.url) code=\(.code) error=\(.error)"' "$WORK/load.json" >"$LOGS/load-failed.log"
failed=$(wc -l <"$LOGS/load-failed.log")
p99=$(vegeta report -type=json "$WORK/load-pool.bin" "$WORK/load-fresh.bin" | jq -r '.latencies["99th"] / 1e6 | floor')
posts=$(jq -c 'select(.method == "POST")' "$WORK/load.json" | wc -l)
[ "$requests" -gt $((RATE * 5)) ] || fail "only $requests requests were sent"
[ "$failed" -eq 0 ] || fail "$failed of $requests requests failed during the rollout (first: $(head -n 1 "$LOGS/load-failed.log"))"
# When each pod served its last /api/instance: the response's end.
jq -r "$JQ_EPOCH"' select(.code == 200 and (.url | endswith("/api/instance"))) |
  "\(.body | @base64d | fromjson | .instanceId) \((.timestamp | epoch) + .latency / 1e9)"' "$WORK/load.json" | sort -k2 -n >"$WORK/served.txt"

# ---- per old pod: the drain, its exit, and the race ----
STEP="drain of the old pods"
race=""
for p in $old_pods; do
  name=${p%%=*} podip=${p#*=}
  log="$LOGS/log-$name.watch"
  drain=$(sed 's/^[0-9.]* //' "$log" | jq -rc 'select(.msg == "lifecycle") |
    if .event == "shutdown_requested" then "shutdown_requested"
    elif .event == "state_changed" and .to == "draining" then "draining"
    elif .event == "exit" then "exit=\(.code)"
    elif .step then "step" else empty end' 2>/dev/null | sort | uniq -c | awk '{printf "%s:%s ", $2, $1}')
  for want in shutdown_requested: draining: exit=0: step:; do
    [[ "$drain" == *"$want"* ]] || { tail -n 30 "$log" >&2; fail "$name's log has no drain line '${want%:}' (got: $drain)"; }
  done
  term=$(grep '"shutdown_requested"' "$log" | head -n 1 | sed 's/^[0-9.]* //' | jq -r .time)
  term=$(epoch "$term")
  exitline=$(grep "^[0-9.]* $name " "$LOGS/pods.watch" | grep -o 'exit=[0-9]* reason=[A-Za-z]*' | tail -n 1)
  [[ "$exitline" == "exit=0 reason=Completed" ]] || fail "$name terminated with '$exitline', want exit=0 reason=Completed (no SIGKILL)"
  # The first EndpointSlice line after SIGTERM where the pod is not ready (or gone).
  eps=$(awk -v n="$name" -v t="$term" '$1 >= t - 1 && !index($0, n "=true") { print $1; exit }' "$LOGS/endpointslices.watch")
  ipt=$(awk -v ip="$podip:8080" -v t="$term" '$1 >= t - 1 && !index($0, ip) { print $1; exit }' "$LOGS/iptables.watch")
  last=$(awk -v n="$name" '$1 == n { t = $2 } END { print t }' "$WORK/served.txt")
  [ -n "$eps" ] || fail "$name: no EndpointSlice change seen after its SIGTERM"
  [ -n "$ipt" ] || fail "$name: iptables still DNATs to $podip"
  race+="$name[endpointslice=+$(ms "$term" "$eps")ms iptables=+$(ms "$term" "$ipt")ms last_request=+$(ms "$term" "$last")ms] "
  say "$name: SIGTERM → EndpointSlice not ready +$(ms "$term" "$eps") ms → iptables without it +$(ms "$term" "$ipt") ms → last request served +$(ms "$term" "$last") ms (linger 3000 ms) drain[${drain% }]"
done

# ---- the stream resumed without a gap ----
STEP="event stream"
touch "$WORK/sse.stop"
stop_pid sse "$sse_pid" 5
psql() { kubectl exec deploy/postgres -- psql -U kumiko -d kumiko -tAc "$1"; }
# The ids of the $stream_event frames (an id line comes before its event line).
awk -v ev="$stream_event" '/^id: / { id = $2 } /^event: / && $2 == ev { print id }' "$WORK/sse.raw" >"$WORK/sse.ids"
! grep -q '^event: reset' "$WORK/sse.raw" || fail "the stream got a reset frame: its Last-Event-ID was not resumable"
connects=$(wc -l <"$WORK/sse.connects")
got=$(sort -n -u "$WORK/sse.ids" | wc -l)
[ "$got" -gt 0 ] || fail "the stream received no event"
first=$(sort -n "$WORK/sse.ids" | head -n 1) lastid=$(sort -n "$WORK/sse.ids" | tail -n 1)
psql "SELECT id FROM outbox_events WHERE event_type = '$stream_event' AND id BETWEEN $first AND $lastid ORDER BY id" >"$WORK/db.ids" ||
  fail "reading outbox_events"
missing_ids=$(comm -23 <(sort "$WORK/db.ids") <(sort -u "$WORK/sse.ids") | wc -l)
[ "$connects" -ge 2 ] || fail "the stream never reconnected (it should, when its pod drains)"
[ "$missing_ids" -eq 0 ] || fail "the stream missed $missing_ids of $(wc -l <"$WORK/db.ids") events between $first and $lastid across $connects connections"
sse="events=$got connections=$connects missing=0"

# ---- the leader: kubectl delete pod ----
STEP="leader hand-over"
leader=$(kubectl exec deploy/redis -- redis-cli GET kumiko:leader | cut -d: -f1) # "<instance id>:<token>"
pods=$(kubectl get pods -l app=$APP -o jsonpath='{.items[*].metadata.name}')
[[ " $pods " == *" $leader "* ]] || fail "the leader lock names '$leader', not one of the pods ($pods)"
watch_bg "log2-$leader" "$BIN/kubectl logs -f $leader"
wait_for "the leader's log follower" 20 test -s "$LOGS/log2-$leader.watch"
kubectl delete pod "$leader" --wait=true --timeout=90s >/dev/null || fail "kubectl delete pod $leader"
stopped=$(grep '"stopped leading"' "$LOGS/log2-$leader.watch" | tail -n 1 | sed 's/^[0-9.]* //' | jq -r .time)
[ -n "$stopped" ] || fail "$leader's log has no 'stopped leading'"
# The lock goes to whichever pod wins the race after the release: the other
# old pod or the replacement the Deployment already started.
new_leader() { kubectl exec deploy/redis -- redis-cli GET kumiko:leader | cut -d: -f1; }
leader_moved() { local v; v=$(new_leader); [ -n "$v" ] && [ "$v" != "$leader" ]; }
wait_for "another pod taking the leader lock" 30 leader_moved
new=$(new_leader)
kubectl logs "$new" >"$LOGS/log-new-leader-$new.txt" || fail "kubectl logs $new"
became=$(jq -r --argjson t "$(epoch "$stopped")" "$JQ_EPOCH"' select(.msg == "became leader" and (.time | epoch) >= $t) | .time' \
  "$LOGS/log-new-leader-$new.txt" 2>/dev/null | head -n 1)
[ -n "$became" ] || fail "$new holds the lock but its log has no 'became leader' after $stopped"
term=$(grep '"shutdown_requested"' "$LOGS/log2-$leader.watch" | tail -n 1 | sed 's/^[0-9.]* //' | jq -r .time)
handover=$(ms "$(epoch "$stopped")" "$(epoch "$became")")
handover_from_term=$(ms "$(epoch "$term")" "$(epoch "$became")")
[ "$handover" -le 1000 ] || fail "hand-over took ${handover} ms (stopped $stopped, became $became), want ≤ 1000"
kubectl rollout status "deployment/$APP" --timeout=180s >/dev/null || fail "the Deployment did not recover"
# Every 2 s tick since the first pod booted, once: no tick twice (the unique
# key makes that impossible) and none lost across the rollout and the delete.
recent_tick() { [ "$(psql "SELECT count(*) FROM river_job WHERE kind = 'purgeOutbox' AND created_at > now() - interval '3 seconds'")" -gt 0 ]; }
wait_for "a tick after the hand-over" 30 recent_tick
psql "SELECT args->>'scheduledAt' FROM river_job WHERE kind = 'purgeOutbox' AND NOT coalesce((args->>'manual')::bool, false) ORDER BY 1" >"$WORK/ticks"
ticks=$(wc -l <"$WORK/ticks")
dups=$(sort "$WORK/ticks" | uniq -d | wc -l)
gaps=$(while read -r t; do date -d "$t" +%s; done <"$WORK/ticks" | awk 'NR > 1 && $1 - prev != 2 { n++ } { prev = $1 } END { print n + 0 }')
[ "$dups" -eq 0 ] && [ "$gaps" -eq 0 ] || fail "cron ticks: $ticks, $dups doubled, $gaps gaps (see $WORK/ticks)"

# ---- kubectl drain honours the PDB ----
STEP="drain"
# One node: the drain evicts one app pod, whose replacement cannot be
# scheduled while the node is cordoned, so the PDB (minAvailable 1) must
# refuse the second eviction until the node is uncordoned again and the
# replacement is ready. Only the app's pods are drained: the dev
# dependencies have no PDB and nowhere else to go.
setsid kubectl drain "$NODE" --pod-selector=app=$APP --delete-emptydir-data --ignore-daemonsets --timeout=180s >"$LOGS/drain.log" 2>&1 &
drain_pid=$!
bg_pids+=("$drain_pid")
wait_for "the PDB refusing an eviction" 90 grep -q 'disruption budget' "$LOGS/drain.log"
ready=$(kubectl get deployment "$APP" -o jsonpath='{.status.readyReplicas}')
[ "${ready:-0}" -ge 1 ] || fail "no ready replica while the drain is refused"
kubectl uncordon "$NODE" >/dev/null
wait "$drain_pid" || { cat "$LOGS/drain.log" >&2; fail "kubectl drain did not finish after the uncordon"; }
kubectl uncordon "$NODE" >/dev/null
kubectl rollout status "deployment/$APP" --timeout=180s >/dev/null || fail "the Deployment did not recover after the drain"
# Ready endpoints never dropped to zero since the rollout began.
zero=$(awk '{ n = gsub(/=true/, "") } n == 0 { z++ } END { print z + 0 }' "$LOGS/endpointslices.watch")
[ "$zero" -eq 0 ] || fail "$zero EndpointSlice states with no ready pod"
refused=$(grep -c 'disruption budget' "$LOGS/drain.log" || true)

# ---- a drain gone wrong, in kubectl describe pod ----
STEP="termination message"
# A container restarted in place keeps its last state, and the kubelet takes
# its message from the file the app writes when a drain goes wrong
# (/dev/termination-log). Here a second SIGTERM, sent to the container by its
# runtime while it drains (not through the API: the pod stays), abandons the
# drain: exit 1, and the kubelet starts the container again in the same pod.
# The drain lasts at least its linger (seconds); the second signal follows the
# first 503 of its readiness within a poll.
pod=$(kubectl get pods -l app=$APP -o jsonpath='{.items[0].metadata.name}')
podip=$(kubectl get pod "$pod" -o jsonpath='{.status.podIP}')
cid=$(kubectl get pod "$pod" -o jsonpath='{.status.containerStatuses[0].containerID}')
cid=${cid#containerd://}
restarts=$(kubectl get pod "$pod" -o jsonpath='{.status.containerStatuses[0].restartCount}')
ctr --address "$SOCK" -n k8s.io tasks kill -s SIGTERM "$cid" || fail "ctr tasks kill -s SIGTERM $cid"
draining() { [ "$(curl -s -o /dev/null -w '%{http_code}' -m 1 "http://$podip:9090/health/ready")" = 503 ]; }
wait_for "$pod draining (its readiness 503)" 20 draining
ctr --address "$SOCK" -n k8s.io tasks kill -s SIGTERM "$cid" || fail "the second SIGTERM to $cid"
restarted() { [ "$(kubectl get pod "$pod" -o jsonpath='{.status.containerStatuses[0].restartCount}')" -gt "$restarts" ]; }
wait_for "$pod restarted in place" 90 restarted
kubectl describe pod "$pod" >"$LOGS/describe-$pod.txt" || fail "kubectl describe pod $pod"
last_exit=$(kubectl get pod "$pod" -o jsonpath='{.status.containerStatuses[0].lastState.terminated.exitCode}')
message=$(kubectl get pod "$pod" -o jsonpath='{.status.containerStatuses[0].lastState.terminated.message}')
[ "$last_exit" = 1 ] || fail "$pod's last state: exit code '$last_exit', want 1 (a drain abandoned by a second signal)"
[[ "$message" == *"second signal"* ]] || fail "$pod's termination message does not say why: '$message'"
grep -q 'second signal' "$LOGS/describe-$pod.txt" || fail "kubectl describe pod $pod does not show the termination message (see $LOGS/describe-$pod.txt)"
say "$pod restarted in place; kubectl describe pod shows: ${message:0:200}"
kubectl rollout status "deployment/$APP" --timeout=180s >/dev/null || fail "the Deployment did not recover after the restart in place"

STEP="teardown"
SUMMARY="k8s-smoke: ok: build=${build_secs}s($build_what) images=${images_secs}s cluster_start=${cluster_secs}s rollout: requests=$requests (post=$posts, keep-alive + fresh connections) failed=$failed p99=${p99}ms duration=${rollout_secs}s race[${race% }] linger=3000ms sse[$sse] handover=${handover}ms(sigterm+${handover_from_term}ms) cron_ticks=$ticks dup=0 gaps=0 drain: pdb_refusals=$refused min_ready>=1 restarted_in_place=1 termination_message=yes"
