#!/usr/bin/env bash
# Start or stop N ptcd hosts h0..h{N-1} on loopback, for demos and tests.
#   deploy/local-cluster.sh up N DIR [--gpus G] [--replicas R] [--curve-dir KEYS] [--no-keys]
#                                    [--no-mount] [--registry etcd://HOST:PORT]
#   deploy/local-cluster.sh down DIR
# 'up' picks free ports, writes DIR/cluster.toml (replicas = 2 when N >= 2),
# CurveZMQ keys in DIR/keys (made if missing; --curve-dir KEYS uses those,
# --no-keys none: the cluster file then says insecure = true),
# stores under DIR/hK, starts the daemons and returns once each has written
# its ready file DIR/hK.ready (a bounded poll; it fails with the daemon's log
# if one exits or is not ready within 30 s). Pids go to DIR/hK.pid, logs to
# DIR/hK.log. Each host mounts its /ptc filesystem at DIR/mnt/hK when
# /dev/fuse exists (--no-mount: not). With --registry the cluster file names
# that etcd and no hosts; each daemon joins it with --address/--store/--gpus. 'down' sends SIGTERM, waits, SIGKILLs
# what is left and clears any mount left under DIR/mnt.
# Uses the repo's .venv/bin/ptcd if present, else ptcd on PATH ($PTC_PTCD wins).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${PTC_PTCD:-}" ]; then
    PTCD=$PTC_PTCD
elif [ -x "$ROOT/.venv/bin/ptcd" ]; then
    PTCD=$ROOT/.venv/bin/ptcd
elif ! PTCD=$(command -v ptcd); then
    echo "local-cluster.sh: no ptcd found: run deploy/setup.sh (makes .venv)" \
         "or pip install ptcfs" >&2
    exit 1
fi
# the Python that runs ptcd has ptcfs installed: use it for the launcher too
PY=$(head -n 1 "$PTCD" | sed -n 's/^#! *\([^ ]*\).*/\1/p')
case "$PY" in
    */env|"") PY=$(dirname "$PTCD")/python; [ -x "$PY" ] || PY=python3 ;;
esac
if ! "$PY" -c "import ptcfs.server.testing.localcluster" 2>/dev/null; then
    echo "local-cluster.sh: $PY (the Python of $PTCD) cannot import ptcfs;" \
         "set PTC_PTCD to a ptcd installed with ptcfs" >&2
    exit 1
fi
exec "$PY" -m ptcfs.server.testing.localcluster --ptcd "$PTCD" "$@"
