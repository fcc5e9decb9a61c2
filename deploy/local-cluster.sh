#!/usr/bin/env bash
# Start or stop N ptcd hosts h0..h{N-1} on loopback, for demos and tests.
#   deploy/local-cluster.sh up N DIR [--gpus G] [--replicas R] [--curve-dir KEYS]
#   deploy/local-cluster.sh down DIR
# 'up' writes DIR/cluster.toml (replicas = 2 when N >= 2) and returns once
# every daemon answers; logs are DIR/hK.log, stores DIR/hK.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
exec "$PY" -m ptcfs.server.localcluster "$@"
