# docker.sh: what both smoke tests need from Docker, in one place, so each
# works on its own on a fresh machine. Source it after defining say, fail and
# STEP, with DOCKER_LOGS set to a directory for its logs. It provides:
#   docker_tools     docker.io, jq, curl (Debian) and vegeta (go install) when missing
#   docker_engine    starts dockerd when none answers (ENGINE_PID is then set:
#                    the caller stops it on exit)
#   docker_plugins   the compose and buildx CLI plugins, built from their Go
#                    modules when missing
#   ensure IMAGE     the image present: kept when real or a current stand-in,
#                    else pulled when a registry answers, else built as a
#                    labelled stand-in from deploy/standins/ (Debian packages
#                    and Go modules), tagged with the name the compose file uses
# Built images are kept: later runs reuse them. The stand-ins built are
# listed in the array standins.

COMPOSE_VERSION=v5.6.0
BUILDX_VERSION=v0.38.2
BASE=kumiko-standin/debian:bookworm
ENGINE_PID=""
standins=()

# apt_install PKG...: installs Debian packages; `apt-get update` runs once.
apt_updated=0
apt_install() {
  say "installing $* (Debian packages)"
  [ "$apt_updated" = 1 ] || { apt-get update -qq && apt_updated=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >"$DOCKER_LOGS/apt.log" 2>&1 ||
    { cat "$DOCKER_LOGS/apt.log" >&2; fail "apt-get install $*"; }
}

docker_tools() {
  local missing=()
  command -v dockerd >/dev/null || timeout 10 docker info >/dev/null 2>&1 || missing+=(docker.io)
  command -v jq >/dev/null || missing+=(jq)
  command -v curl >/dev/null || missing+=(curl)
  command -v debootstrap >/dev/null || missing+=(debootstrap) # the stand-ins' base image
  ((${#missing[@]} == 0)) || apt_install "${missing[@]}"
  if ! command -v vegeta >/dev/null; then
    say "installing vegeta (load generator)"
    go install github.com/tsenart/vegeta/v12@v12.13.0 >"$DOCKER_LOGS/build.log" 2>&1 || fail "go install vegeta"
  fi
}

docker_engine() {
  timeout 10 docker info >/dev/null 2>&1 && return
  say "starting dockerd (log: stopped with it)"
  setsid dockerd --storage-driver=overlay2 >"$DOCKER_LOGS/dockerd.log" 2>&1 &
  ENGINE_PID=$!
  for _ in $(seq 120); do timeout 5 docker info >/dev/null 2>&1 && break; kill -0 "$ENGINE_PID" 2>/dev/null || break; sleep 0.5; done
  timeout 10 docker info >/dev/null 2>&1 || fail "dockerd did not answer within 60s"
}

# go_plugin NAME MODULE VERSION PKG LDFLAGS builds a Docker CLI plugin from
# its Go module (go install refuses modules with replace/exclude directives,
# so it is built inside a copy of the module).
go_plugin() {
  local name=$1 module=$2 version=$3 pkg=$4 ldflags=$5 dir src
  say "building docker-$name $version from its Go module"
  dir=$(go mod download -json "$module@$version" | jq -r .Dir) || fail "go mod download $module@$version"
  src=$(mktemp -d /tmp/docker-$name-src.XXXXXX)
  cp -r "$dir/." "$src" && chmod -R u+w "$src"
  mkdir -p /usr/local/lib/docker/cli-plugins
  (cd "$src" && CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath -ldflags "-s -w $ldflags" \
    -o "/usr/local/lib/docker/cli-plugins/docker-$name" "$pkg") >"$DOCKER_LOGS/build.log" 2>&1 || { rm -rf "$src"; fail "building docker-$name"; }
  rm -rf "$src"
}

docker_plugins() {
  docker compose version >/dev/null 2>&1 ||
    go_plugin compose github.com/docker/compose/v5 "$COMPOSE_VERSION" ./cmd "-X github.com/docker/compose/v5/internal.Version=$COMPOSE_VERSION"
  docker buildx version >/dev/null 2>&1 ||
    go_plugin buildx github.com/docker/buildx "$BUILDX_VERSION" ./cmd/buildx "-X github.com/docker/buildx/version.Version=$BUILDX_VERSION"
}

registry="unknown" # set to up/down by the first pull attempt
try_pull() {
  [ "$registry" = down ] && return 1
  if timeout 45 docker pull -q "$1" >"$DOCKER_LOGS/pull.log" 2>&1; then
    registry=up
    return 0
  fi
  [ "$registry" = unknown ] && say "no image registry answers ($(tail -n 1 "$DOCKER_LOGS/pull.log")): building stand-ins"
  registry=down
  return 1
}

# base_image makes a minimal Debian bookworm image with debootstrap, with the
# host's apt sources, Acquire settings (proxy, validity) and local CA
# certificates, so builds reach the same mirror and module proxy.
base_image() {
  docker image inspect "$BASE" >/dev/null 2>&1 && return
  command -v debootstrap >/dev/null || apt_install debootstrap
  say "building $BASE with debootstrap"
  local root mirror
  root=$(mktemp -d /tmp/standin-rootfs.XXXXXX)
  mirror=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
    head -n 1 | awk '{print $2}')
  debootstrap --variant=minbase bookworm "$root" "${mirror:-http://deb.debian.org/debian}" >"$DOCKER_LOGS/build.log" 2>&1 || { rm -rf "$root"; fail "debootstrap"; }
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/" && : >"$root/etc/apt/sources.list"
  fi
  grep -l 'Acquire::' /etc/apt/apt.conf.d/* 2>/dev/null | xargs -r cp -t "$root/etc/apt/apt.conf.d/"
  # The host's local CA certificates (e.g. of a TLS-inspecting egress proxy):
  # images that install ca-certificates then trust what the host trusts.
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
  tar -C "$root" -c . | docker import -c 'CMD ["bash"]' -m "kumiko stand-in base: debootstrap bookworm" - "$BASE" >/dev/null ||
    { rm -rf "$root"; fail "docker import $BASE"; }
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
    -t "$image" -f "deploy/standins/$file.Dockerfile" "$ctx" >"$DOCKER_LOGS/build.log" 2>&1 || fail "building the stand-in for $image"
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
