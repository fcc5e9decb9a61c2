#!/usr/bin/env bash
# The main job: set everything up, start a local 3-host ptcfs cluster on
# loopback (each host its own ptcd daemon and LMDB store), create a GPT job,
# reconfigure it through tensor/pipeline/data-parallel and host changes, lose a
# host for good, and show after each step that every tensor is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
ROOT=$(pwd)
PTCCTL="$ROOT/.venv/bin/ptcctl"
DIR=$(mktemp -d /tmp/ptcfs-demo.XXXXXX)
export PTC_CLUSTER="$DIR/cluster.toml"
cleanup() { bash "$ROOT/deploy/local-cluster.sh" down "$DIR" >/dev/null 2>&1 || true; rm -rf "$DIR"; }
trap cleanup EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
same() {
    "$PTCCTL" checksum demo --json > "$DIR/now.json"
    "$ROOT/.venv/bin/python" - "$DIR/first.json" "$DIR/now.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
same = all(b[k] == v for k, v in a.items())
print(f"checksums of all {len(a)} tensors {'unchanged' if same else 'CHANGED'}")
sys.exit(0 if same else 1)
PY
}

MODEL="gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=1024"
step "start 3 hosts h0 h1 h2 on loopback (replicas = 2)"
bash deploy/local-cluster.sh up 3 "$DIR"
step "create job 'demo': GPT-2 small sized, fp16 with Adam, tp=2,dp=2 on h0 and h1"
"$PTCCTL" job create demo --model "$MODEL" --optimizer adam --config tp=2,dp=2 \
    --hosts h0:2,h1:2 --seed 42
"$PTCCTL" checksum demo --json > "$DIR/first.json"
"$PTCCTL" status
step "plan only: tp=4 on h1 (dry run)"
"$PTCCTL" reconfigure demo --to tp=4,dp=1 --hosts h1:4 --dry-run
step "reconfigure: tp=2,dp=2 -> tp=4 on h1"
"$PTCCTL" reconfigure demo --to tp=4,dp=1 --hosts h1:4
same
step "reconfigure: tp=4 -> tp=2,pp=2 on h0 and h2"
"$PTCCTL" reconfigure demo --to tp=2,pp=2,dp=1 --hosts h0:2,h2:2
same
"$PTCCTL" verify demo
step "host h2 dies for good (kill -9); rebuild tp=1,dp=2 on h0 and h1 from the surviving copies"
kill -9 "$(cat "$DIR/h2.pid")"
"$PTCCTL" reconfigure demo --to tp=1,dp=2 --hosts h0:1,h1:1
same
"$PTCCTL" status
step "read one tensor back, sliced"
"$PTCCTL" tensor get demo encoder.layers.0.self_attention.query_key_value.weight \
    --slice 0:4,0:6 --out "$DIR/qkv.npy"
"$ROOT/.venv/bin/python" -c "import numpy as np, sys; print(np.load(sys.argv[1]))" "$DIR/qkv.npy"
