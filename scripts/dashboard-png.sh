#!/usr/bin/env bash
# Usage: scripts/dashboard-png.sh
#
# Makes docs/dashboard.png, the README's picture of the cluster dashboard,
# from today's page. The browser test of the dashboard
# (TestDashboardClusterDrainInHeadlessChromium) boots two instances behind a
# load balancer against throwaway PostgreSQL and Redis servers, opens the page
# in headless Chromium (1280×1000), posts orders, sends app1 SIGTERM and saves
# the page as it shows app1 draining with its first drain step and app2
# ready; the image is replaced only when the whole test passes.
#
# Run it whenever dashboard.html changes, and commit the image. It needs what
# the tests need (scripts/install-deps.sh tests: PostgreSQL, Redis,
# Chromium); it takes about a minute with the test binary built, a few more
# the first time (go test compiles the package).
set -euo pipefail
source "$(dirname "$0")/lib/help.sh"
cd "$(dirname "$0")/.."

for bin in chromium redis-server; do
  command -v "$bin" >/dev/null || { echo "dashboard-png: $bin is missing: scripts/install-deps.sh tests installs it" >&2; exit 1; }
done
shot=$(mktemp --suffix=.png)
trap 'rm -f "$shot"' EXIT
echo "dashboard-png: running the dashboard's browser test (go test compiles the package first: minutes the first time)…"
# KUMIKO_REQUIRE_SERVICES=1: a missing server fails the test instead of
# skipping it, which would leave no image.
KUMIKO_REQUIRE_SERVICES=1 KUMIKO_SCREENSHOT="$shot" \
  go test -count=1 -run '^TestDashboardClusterDrainInHeadlessChromium$' .
[ -s "$shot" ] || { echo "dashboard-png: the test passed but saved no image" >&2; exit 1; }
mv "$shot" docs/dashboard.png
chmod 644 docs/dashboard.png
echo "dashboard-png: docs/dashboard.png is today's page: look at it, then commit it"
