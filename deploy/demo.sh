#!/usr/bin/env bash
# The main job: set everything up, start a local 3-host ptcfs cluster on
# loopback (each host its own ptcd daemon, LMDB store and /ptc mount at
# DIR/mnt/hK), create a GPT job, read it through the mounts, reconfigure it
# through tensor/pipeline/data-parallel and host changes, save a training step
# through the mount, lose a host for good, and show after each step that every
# tensor is what it should be.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
# each process writes the bytecode of what it imports first (see deploy/setup.sh)
unset PYTHONDONTWRITEBYTECODE
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
same = all(b[k] == v for k, v in a.items() if k in b)  # pp=1 has no separate head
print(f"checksums of all {len(a)} tensors {'unchanged' if same else 'CHANGED'}")
sys.exit(0 if same else 1)
PY
}

MODEL="gpt:layers=12,hidden=768,heads=12,vocab=50257,seq=1024"
PY="$ROOT/.venv/bin/python"
MNT="$DIR/mnt"
step "start 3 hosts h0 h1 h2 on loopback (replicas = 2), each mounted at $MNT/hK"
bash deploy/local-cluster.sh up 3 "$DIR"
step "create job 'demo': GPT-2 small sized, fp16 with Adam, tp=2,dp=2 on h0 and h1"
"$PTCCTL" job create demo --model "$MODEL" --optimizer adam --config tp=2,dp=2 \
    --hosts h0:2,h1:2 --seed 42
"$PTCCTL" checksum demo --json > "$DIR/first.json"
"$PTCCTL" status
step "the job as files: h2 holds none of it, and reads every byte through its mount"
ls -l "$MNT/h2/demo"
ls "$MNT/h2/demo/ranks/0" | head -4
"$PY" - "$MNT/h2/demo" <<'PY'
import sys, numpy as np
from safetensors import safe_open
job = sys.argv[1]
w = np.load(f"{job}/tensors/encoder.layers.0.mlp.dense_4h_to_h.weight.npy")
part = np.load(f"{job}/tensors/encoder.layers.0.mlp.dense_4h_to_h.weight.npy[0:2,1534:1538]")
print("dense_4h_to_h.weight", w.shape, w.dtype, "| slice [0:2,1534:1538] (spans both tp ranks):")
print(part)
with safe_open(f"{job}/ranks/1/state.safetensors", "np") as f:
    print(f"rank 1's state.safetensors: {len(list(f.keys()))} tensors, e.g. "
          f"dense_4h_to_h.weight {f.get_tensor('encoder.layers.0.mlp.dense_4h_to_h.weight').shape}")
PY
step "plan only: tp=4 on h1 (dry run)"
"$PTCCTL" reconfigure demo --to tp=4,dp=1 --hosts h1:4 --dry-run
step "reconfigure: tp=2,dp=2 -> tp=4 on h1"
"$PTCCTL" reconfigure demo --to tp=4,dp=1 --hosts h1:4
same
step "reconfigure: tp=4 -> tp=2,pp=2 on h0 and h2"
"$PTCCTL" reconfigure demo --to tp=2,pp=2,dp=1 --hosts h0:2,h2:2
same
"$PTCCTL" verify demo
step "training goes on: each rank saves its state through its host's mount; commit step 100"
"$PY" - "$MNT" <<'PY'
import json, sys
from safetensors.numpy import load_file, save_file
mnt = sys.argv[1]
cfg = json.load(open(f"{mnt}/h0/demo/config.json"))
for rank, where in sorted(cfg["ranks"].items(), key=lambda kv: int(kv[0])):
    path = f"{mnt}/{where['host']}/demo/ranks/{rank}/state.safetensors"
    state = load_file(path)                      # read this rank's state...
    for name, t in state.items():
        if name.endswith("layernorm.weight"):
            t += 1                               # ...'train' it...
    save_file(state, path)                       # ...and save it back through the mount
    print(f"rank {rank} saved {len(state)} tensors through {where['host']}'s mount")
PY
"$PTCCTL" commit demo --step 100
"$PY" -c "import numpy as np, sys; print('final_layernorm.weight[:4] now', np.load(sys.argv[1]))" \
    "$MNT/h1/demo/tensors/encoder.final_layernorm.weight.npy[:4]"
"$PTCCTL" checksum demo --json > "$DIR/first.json"
step "host h2 dies for good (kill -9); rebuild tp=1,dp=2 on h0 and h1 from the surviving copies"
kill -9 "$(cat "$DIR/h2.pid")"
"$PTCCTL" reconfigure demo --to tp=1,dp=2 --hosts h0:1,h1:1
same
"$PTCCTL" status
step "read one tensor back, sliced, with ptcctl and through h0's mount"
"$PTCCTL" tensor get demo encoder.layers.0.self_attention.query_key_value.weight \
    --slice 0:4,0:6 --out "$DIR/qkv.npy"
"$PY" - "$DIR/qkv.npy" "$MNT/h0/demo" <<'PY'
import sys, numpy as np
a = np.load(sys.argv[1])
b = np.load(f"{sys.argv[2]}/tensors/encoder.layers.0.self_attention.query_key_value.weight.npy[0:4,0:6]")
print(a)
print("the mount gives the same bytes:", bool((a == b).all()), "| versions kept:",
      sorted(__import__("os").listdir(f"{sys.argv[2]}/versions")))
PY
