#!/usr/bin/env bash
# Start or stop N ptcd hosts h0..h{N-1}, each in its own network namespace on
# one bridge, every link shaped with tc; needs root and iproute2.
#   deploy/netns-cluster.sh up N DIR [--rate 1gbit] [--delay 0] [--storage-rate R]
#                                    [--no-storage] [--gpus G] [--replicas R]
#                                    [--curve-dir KEYS] [--no-keys] [--no-mount] [--etcd]
#   deploy/netns-cluster.sh down DIR
# Same files as local-cluster.sh (DIR/cluster.toml, DIR/keys, DIR/hK stores,
# .ready/.pid/.log, mounts at DIR/mnt/hK), plus DIR/netns.json (the network)
# and a storage namespace serving DIR/storage/files over HTTP (--etcd: the
# registry, etcd, in a namespace of its own, which the hosts join). ptcctl works
# from this shell: PTC_CLUSTER=DIR/cluster.toml ptcctl status. 'down' removes
# every process, namespace and link of DIR, also after an interrupted 'up'.
# The network, in detail: ptcfs/server/netnscluster.py's docstring.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" != 0 ]; then
    echo "netns-cluster.sh: network namespaces need root (run it with sudo)" >&2
    exit 1
fi
PY=${PTC_PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import ptcfs.server.testing.netnscluster" 2>/dev/null; then
    echo "netns-cluster.sh: $PY cannot import ptcfs; run deploy/setup.sh (makes .venv)" \
         "or set PTC_PYTHON to a Python with ptcfs installed" >&2
    exit 1
fi
exec "$PY" -m ptcfs.server.testing.netnscluster "$@"
