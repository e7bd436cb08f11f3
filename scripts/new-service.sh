#!/usr/bin/env bash
# Usage: scripts/new-service.sh MODULE NAME [--bare]
#
# Turns a fresh copy of this template into service NAME.
#
#   scripts/new-service.sh example.com/acme/orders-svc orders-svc
#   scripts/new-service.sh example.com/acme/billing billing --bare   # without the orders demo
#
# Run it once, in a clean clone (or a copy of `git ls-files`), before changing
# anything else. It rewrites, for NAME=orders-svc:
#   go.mod module path and its imports       github.com/kumiko/kumiko-lifecycle-demo → MODULE
#   the naming block in app.go               serviceName (binary, `version`, OTel service.name),
#                                            metricNamespace (kumiko_* → orders_svc_*),
#                                            redisKeyPrefix (kumiko:events → orders-svc:events),
#                                            advisoryLockKey (derived from NAME)
#   env prefix                               KUMIKO_* → ORDERS_SVC_*
#   config file                              kumiko.config.yaml → orders-svc.config.yaml
#   Dockerfile, compose, k8s, deploy/, scripts, tests and docs: every other spelling of the old name
# and removes itself, its tests (newservice_test.go, scripts/bare-smoke.sh),
# this project's history (docs/measurements.md) and the template's picture of
# its dashboard (docs/dashboard.png, made by scripts/dashboard-png.sh, which
# goes too), with the lines that point at them: a service is made from the
# template once. The copy gets a README of its own (what it is, its two
# commands, its docs), no line naming this script, and a tidy go.mod. It
# prints every file it changed.
#
# --bare also removes the orders demo: its files and folders (demo_files below: the
# feature, its jobs, search and tests, and the scripts that only measure it),
# its line in registerFeatures, and the blocks between "demo:begin" and
# "demo:end" markers elsewhere (its table in the migrations, its feed on the
# dashboard page, its lines in scripts and the README). What is left is the
# lifecycle: boot, health, drain, outbox, jobs, leader, streams, /api/slow.
#
# It says each step as it goes; the last, regenerating the example config
# file and docs/configuration.md, compiles the copy (about a minute the first
# time).
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"

die() { echo "new-service: $*" >&2; exit 1; }

bare=false
args=()
for a in "$@"; do
  case $a in
  --bare) bare=true ;;
  -*) die "unknown option $a (the only one is --bare)" ;;
  *) args+=("$a") ;;
  esac
done
[ ${#args[@]} -eq 2 ] || die "usage: scripts/new-service.sh MODULE NAME [--bare]   (e.g. example.com/acme/orders-svc orders-svc)"
module=${args[0]} name=${args[1]}

# NAME becomes a binary, an image, k8s object names, a Postgres user and a
# Prometheus namespace (dashes → underscores): lowercase letters, digits and
# single dashes keep it valid for all of them.
[[ $name =~ ^[a-z][a-z0-9]*(-[a-z0-9]+)*$ ]] && [ ${#name} -le 40 ] ||
  die "NAME $name: use 1-40 lowercase letters, digits and single dashes, starting with a letter (e.g. orders-svc)"
[[ $name != *kumiko* ]] || die "NAME $name: must not contain the template's name"
# A plausible Go module path: a domain-like first element, then path elements.
[[ $module =~ ^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+(/[A-Za-z0-9._~-]+)+$ ]] ||
  die "MODULE $module: want a module path like example.com/acme/$name"
[[ $module != *kumiko* ]] || die "MODULE $module: must not contain the template's name"

command -v gofmt >/dev/null || die "gofmt is not on PATH: install Go first (the service needs it anyway)"
cd "$(dirname "$0")/.."
old_module=github.com/kumiko/kumiko-lifecycle-demo
self=scripts/new-service.sh
[ -f go.mod ] && [ -f app.go ] || die "run it from a copy of the template (no go.mod or app.go in $PWD)"
if [ "$(sed -n '1s/^module //p' go.mod)" != "$old_module" ] || ! grep -q 'serviceName *= "kumiko-lifecycle-demo"' app.go; then
  die "this copy is already renamed (go.mod says $(sed -n '1s/^module //p' go.mod)): run the script on a fresh copy of the template"
fi

# In a git work tree, start from a clean tree so `git diff` shows exactly what
# the script did and `git checkout .` undoes it.
in_git=false
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  in_git=true
  dirty=$(git status --porcelain)
  [ -z "$dirty" ] || die "the work tree has uncommitted changes; commit or stash them first:
$dirty"
  list_files() { git ls-files; }
else
  echo "new-service: not a git work tree: changing the files in place (keep the original to compare)" >&2
  list_files() { find . -type f -not -path './.git/*' | sed 's|^\./||' | sort; }
fi

snake=${name//-/_}                     # orders_svc: metric namespace, test database names
upper=$(printf '%s' "$snake" | tr a-z A-Z) # ORDERS_SVC: env prefix
camel=$(printf '%s' "$name" | awk -F- '{for (i = 1; i <= NF; i++) printf "%s", toupper(substr($i, 1, 1)) substr($i, 2)}')
# 60 bits of a hash of NAME: a positive int64, different for every name.
lock=0x$(printf '%s' "$name" | sha256sum | cut -c1-15)

echo "new-service: renaming the naming block in app.go, the template's own files, and every spelling of the old name…"
# 1. The naming block in app.go: every name the Go code uses derives from it.
perl -0pi -e '
  s/(serviceName\s*=\s*)"kumiko-lifecycle-demo"/${1}"'"$name"'"/ or die "serviceName not found\n";
  s/(metricNamespace\s*=\s*)"kumiko"/${1}"'"$snake"'"/ or die "metricNamespace not found\n";
  s/(redisKeyPrefix\s*=\s*)"kumiko:"/${1}"'"$name"':"/ or die "redisKeyPrefix not found\n";
  s/\("kumiko" in\n(\s*\/\/) ASCII\)\. /(derived from\n${1} the service name). / or die "advisoryLockKey comment not found\n";
  s/(advisoryLockKey\s*=\s*)0x[0-9a-f]+/${1}'"$lock"'/ or die "advisoryLockKey not found\n";
' app.go
# The outbox's down migration takes the same lock, in decimal (before --bare
# numbers the migrations again).
perl -pi -e 's/\b118152090970991\b/'"$((lock))"'/ and $found = 1; END { exit !$found }' \
  migrations/000014_outbox_partitioned_delivery.down.sql || die "the delivery lock in migration 14's down file not found"

# 2. The template's own machinery goes: a service is made from it once. Its
# history and the picture of its dashboard (the template's name, its orders)
# are not the copy's; the copy's README is written at the end.
remove=("$self" newservice_test.go scripts/bare-smoke.sh scripts/dashboard-png.sh docs/dashboard.png docs/measurements.md)
for f in "${remove[@]}"; do
  if $in_git; then git rm -q -- "$f"; else rm -f -- "$f"; fi
done
# What points at them goes too. In Markdown, "<!-- template:begin -->"
# through "<!-- template:end -->" is cut out where it stands (part of a
# sentence, a link); elsewhere (.ci/run's bare-smoke stage, a table row) a
# line containing template:begin through one containing template:end goes,
# and a line holding both goes alone.
while IFS= read -r f; do
  [ -f "$f" ] && grep -Iq 'template:begin' -- "$f" || continue
  perl -0pi -e 's/<!-- template:begin -->.*?<!-- template:end -->//gs' -- "$f"
  perl -ni -e 'if (/template:begin/) { $skip = !/template:end/; next } if (/template:end/) { $skip = 0; next } print unless $skip' -- "$f"
done < <(list_files)

# 2b. --bare: the orders demo goes.
demo_files=(
  orders*.go # the feature, its jobs and search, and the tests that need orders to happen
  crash_matrix_process_test.go # its load and its exactly-once witness are orders
  migrations/000013_orders_public_id.up.sql migrations/000013_orders_public_id.down.sql
  migrations/000015_order_events_without_order_id.up.sql migrations/000015_order_events_without_order_id.down.sql
  scripts/bench-orders.sh scripts/refhandler scripts/bench-sse.sh scripts/sseload scripts/bench-overload.sh scripts/overload
  scripts/bench-followup.sh scripts/meilistandin scripts/riverbench
)
if $bare; then
  echo "new-service: --bare: removing the orders demo and numbering the migrations again…"
  for f in "${demo_files[@]}"; do
    [ -e "$f" ] || die "--bare: $f is not in this copy (the template changed; update demo_files)"
    if $in_git; then git rm -rq -- "$f"; else rm -rf -- "$f"; fi
  done
  # The migrations: a new service has no database that remembers the
  # template's numbers, so the first one is named for what is left in it and
  # the kept ones are numbered again without the demo's gaps. Migrations 1-12
  # keep their numbers; what points at a later one names it
  # (outbox_partitioned_delivery), not its number.
  mv_file() { if $in_git; then git mv -- "$1" "$2"; else mv -- "$1" "$2"; fi; }
  for ext in up down; do
    [ -e "migrations/000001_orders_and_outbox.$ext.sql" ] || die "--bare: migrations/000001_orders_and_outbox.$ext.sql is not in this copy (the template changed)"
    mv_file "migrations/000001_orders_and_outbox.$ext.sql" "migrations/000001_outbox.$ext.sql"
  done
  n=0 renumbered=("000001_orders_and_outbox → 000001_outbox")
  for up in migrations/*.up.sql; do # sorted by name, so by number
    n=$((n + 1)) from=${up#migrations/}
    from=${from%.up.sql}
    to=$(printf '%06d_%s' "$n" "${from#*_}")
    [ "$from" = "$to" ] && continue
    for ext in up down; do mv_file "migrations/$from.$ext.sql" "migrations/$to.$ext.sql"; done
    renumbered+=("$from → $to")
  done
  perl -ni -e 'print unless /^\s*ordersFeature\(cfg\),/' features.go
  grep -q ordersFeature features.go && die "--bare: the ordersFeature line is still in features.go"
  # Marked blocks: a line containing demo:begin through a line containing
  # demo:end; a line containing both is a block of its own (a table row).
  while IFS= read -r f; do
    [ -f "$f" ] && grep -Iq 'demo:begin' -- "$f" || continue
    perl -ni -e 'if (/demo:begin/) { $skip = !/demo:end/; next } if (/demo:end/) { $skip = 0; next } print unless $skip' -- "$f"
  done < <(list_files)
  remove+=("the orders demo (${#demo_files[@]} files and its marked blocks)")
fi

# 2c. What says this script does something says nothing in a copy: the
# markers' notes that it removes a block, migration 14's note on its lock.
# Settings that cite docs/measurements.md cite nothing (docs/configuration.md
# is generated again below).
while IFS= read -r f; do
  [ -f "$f" ] && grep -Iq 'new-service\|measurements\.md' -- "$f" || continue
  perl -0pi -e '
    s{[;:] (?:scripts/)?new-service\.sh --bare removes (?:this block|it)\)}{)}g;
    s{; scripts/new-service\.sh rewrites\n-- it\)}{)}g;
    s{ \(docs/measurements\.md\)}{}g;
  ' -- "$f"
done < <(list_files)
left=$(list_files | while IFS= read -r f; do # README.md: written again in step 5
  [ -f "$f" ] && [ "$f" != README.md ] && grep -Iq 'new-service\|measurements\.md' -- "$f" && echo "$f"
done; true)
[ -z "$left" ] || die "these files still name new-service or docs/measurements.md (mark the lines template:begin/template:end, see step 2):
$(grep -HIn 'new-service\|measurements\.md' $left)"

# 3. Every other spelling, as text, longest first, in every text file.
changed=()
while IFS= read -r f; do
  [ -f "$f" ] && grep -Iqi kumiko -- "$f" || continue
  perl -pi -e '
    s{\Q'"$old_module"'\E}{'"$module"'}g;
    s/kumiko-lifecycle-demo/'"$name"'/g;
    s/KUMIKO_/'"${upper}"'_/g;
    s/Kumiko/'"$camel"'/g;
    s/kumiko_/'"${snake}"'_/g;
    s/kumiko/'"$name"'/g;
    s/KUMIKO/'"$upper"'/g;
  ' -- "$f"
  changed+=("$f")
done < <(list_files)

# 4. File names: kumiko.config.example.yaml → NAME.config.example.yaml.
while IFS= read -r f; do
  case $f in *kumiko*) ;; *) continue ;; esac
  to=${f//kumiko/$name}
  if $in_git; then git mv -- "$f" "$to"; else mv -- "$f" "$to"; fi
  changed+=("$f → $to")
done < <(list_files)

# Longer or shorter names shift gofmt's alignment of comments and map values.
gofmt -l -w . >/dev/null || die "gofmt failed on the rewritten Go files"

# 5. The copy's own README, in place of the template's: what the service is,
# its two commands, what to watch (the template's drain walk-through, which
# the copy's TestBootAndDrainNamesAreTheDocs holds to its code) and the docs
# the copy kept.
watch=$(perl -0ne 'print $1 if /(With `scripts\/demo\.sh` running, in a second terminal.*?`event=exit code=0`)/s' README.md)
[ -n "$watch" ] || die "README.md: its drain walk-through (\"With \`scripts/demo.sh\` running … \`event=exit code=0\`\") not found (the template changed)"
go_version=$(sed -n 's/^go \([0-9]*\.[0-9]*\).*/\1/p' go.mod)
if $bare; then
  has="It has no business feature yet: add yours in \`features.go\` ([docs/design.md](docs/design.md) says how)."
else
  has="An orders demo (\`orders*.go\` and its line in \`features.go\`) makes them visible."
fi
doc() { if [ -f "docs/$1" ]; then echo "- [docs/$1](docs/$1) — $2"; fi; }
{
  cat <<README
# $name

$name is a Go service that boots in 16 named phases, tells the truth on \`/health/live\` and
\`/health/ready\`, drains on SIGTERM without losing a request or an event, and recovers from
crashes. It has the lifecycle's building blocks: a transactional outbox with an event stream that
survives a drain, River jobs with a fenced leader running the crons, and a cluster dashboard.
$has

## Run it, test it

\`\`\`sh
scripts/demo.sh    # PostgreSQL, Redis, two instances behind HAProxy on :8080; Ctrl+C drains them
scripts/test.sh    # the whole suite, against real PostgreSQL, Redis and S3 servers it starts
\`\`\`

You need Go $go_version on Debian or Ubuntu; each script installs what else it runs when it is
missing (\`scripts/install-deps.sh\`: apt when run as root, else it names the packages). Every
script in \`scripts/\` prints its usage with \`--help\`; \`$name settings\` lists every setting.

## What to watch

Open \`http://localhost:8080/\` while \`scripts/demo.sh\` runs: both instances, their boot timelines,
the events, the leader.

$watch.

## Docs

README
  doc operations.md "endpoints, states and health, the ops runbook, the drain step by step, Docker, compose, Kubernetes"
  doc configuration.md "every setting (generated from \`config.go\`), migrations modes, the master key"
  doc design.md "the boot phases, features and typed jobs, the outbox and the event stream, jobs, leader and cron"
  doc testing.md "what each test holds, and how the suite stays green on a busy machine"
  doc delivery.md "outbox delivery on every instance: partitions, the sequencer, a rolling deploy"
  doc drain-reconnect.md "an event stream across a drain: goodbyes over a window, reconnect, replay"
  doc rolling-deploy.md "a rolling deploy, step by step"
  doc overload.md "past capacity: the adaptive concurrency limit and the cap on connections"
  doc redis-keys.md "every Redis key under the service's prefix, and the advisory lock"
} >README.md
for f in docs/*.md; do
  grep -qF "($f)" README.md || die "README.md: no line for $f (add it to the list in step 5)"
done

# 6. go.mod lists only what the copy uses (--bare: not chromedp, which only
# the demo's browser test used). Tidy reads the go.mod of every module in
# the build, the dependencies' tests' included: from the module cache when it
# has them all, else through GOPROXY.
echo "new-service: go mod tidy…"
if ! GOFLAGS=-mod=mod GOPROXY=off go mod tidy >/dev/null 2>&1 && ! GOFLAGS=-mod=mod go mod tidy; then
  echo "new-service: go mod tidy failed (offline?): run it in the copy once the module proxy is reachable" >&2
fi

# The example config file aligns its comments after the values, which the new
# names made longer or shorter, and --bare removed the demo's settings: it and
# docs/configuration.md's reference are generated again from the settings table.
example=$(ls ./*.config.example.yaml)
echo "new-service: regenerating $example and docs/configuration.md (go test compiles the copy: about a minute the first time)…"
go test -count=1 -run '^(TestExampleConfigFile|TestConfigReferenceInDocs)$' . -update >/dev/null ||
  die "regenerating $example and docs/configuration.md failed: go test -run 'TestExampleConfigFile|TestConfigReferenceInDocs' . -update"

echo "new-service: $old_module → $module, service $name"
echo "  binary/version/OTel service.name $name, metrics ${snake}_*, env ${upper}_*, Redis ${name}:*, config ${name}.config.yaml, advisory lock $lock"
echo "  removed: ${remove[*]}; wrote README.md"
if $bare; then echo "  migrations: ${renumbered[*]}"; fi
echo "  rewrote ${#changed[@]} files:"
printf '    %s\n' "${changed[@]}"

left=$(list_files | while IFS= read -r f; do [ -f "$f" ] && grep -Iqi kumiko -- "$f" && echo "$f"; done; true)
[ -z "$left" ] || die "these files still mention kumiko, check them by hand:
$left"
echo "next: go build ./... && go test ./...   (then commit)"
