#!/bin/bash
# `mc ready local`: ready once the S3 port answers HTTP at all (an anonymous
# request gets 403 from a live gateway); nothing else of mc is stood in.
set -euo pipefail
[ "$*" = "ready local" ] || { echo "stand-in supports only: mc ready local" >&2; exit 2; }
code=$(curl -s -o /dev/null -m 2 -w '%{http_code}' http://127.0.0.1:9000/ || true)
[ "$code" != 000 ]
