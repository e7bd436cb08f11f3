#!/bin/bash
# `minio server DIR`: versitygw serving DIR on :9000 with MinIO's root credentials.
set -euo pipefail
[ "${1:-}" = server ] && [ -n "${2:-}" ] || { echo "stand-in supports only: minio server DIR" >&2; exit 2; }
mkdir -p "$2"
exec versitygw --access "${MINIO_ROOT_USER:?}" --secret "${MINIO_ROOT_PASSWORD:?}" --port :9000 posix "$2"
