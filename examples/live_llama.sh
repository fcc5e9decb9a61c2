#!/usr/bin/env bash
# The LLaMA example (FSDP2 + tensor parallelism on a DeviceMesh) changing its
# workers live, then the same changes by restarting, from a clean set-up:
#   1. an uninterrupted live run: 4 workers for 12 steps (--hsdp: the data
#      ranks are whole replicas, so a lost worker's state has copies);
#   2. the live run: 4 workers (tp=2,dp=2), after step 3 two leave (dp=2),
#      after step 6 a warm standby joins (dp=3), at step 9 that one is
#      killed (SIGKILL) and the two survivors rebuild its state from their
#      memories; no survivor restarts, nothing is read from a store; the job
#      is kept in a local ptcfs cluster (--job live): each change committed
#      in the background after its first step, the last step at the end;
#   3. the same changes by restart: a local ptcfs cluster of one host and
#      torchrun (train_llama.py): every change saves, stops every worker and
#      starts new ones that reconfigure the job and load it; the lost worker
#      rolls the job back to its last commit;
#   4. the hot switch: every step's short micro-batch on fsdp=4, its long
#      one on fsdp=2,tp=2, against both on one mesh.
# Ends with the lines "max relative loss difference", "steps lost",
# "workers restarted" and "downtime: live A s, restart B s".
# Usage: examples/live_llama.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/torchrun ] || bash deploy/setup.sh
V="$PWD/.venv/bin"
DIR="$(realpath -m "${1:-$(mktemp -d /tmp/ptc-live.XXXXXX)}")"
mkdir -p "$DIR"
"$V/python" -m ptcfs.server.testing.localcluster down "$DIR/cluster" >/dev/null 2>&1 || true
rm -rf "$DIR/cluster" "$DIR"/*.jsonl "$DIR"/*.json
trap '"$V/python" -m ptcfs.server.testing.localcluster down "$DIR/cluster" >/dev/null 2>&1 || true' EXIT
export OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PYTHONFAULTHANDLER=1
"$V/python" examples/make_tokens.py "$DIR/tokens.npy"
TRAIN=(examples/live_llama.py --data "$DIR/tokens.npy" --steps 12 --hsdp)

"$V/python" -m ptcfs.server.testing.localcluster up 1 "$DIR/cluster" --gpus 4 --no-mount >/dev/null
export PTC_CLUSTER="$DIR/cluster/cluster.toml"

echo "-- uninterrupted: 4 workers" >&2
"$V/python" -m ptcfs.client.live --workers 4 --json --logs "$DIR/logs-ref" -- \
  "$V/python" "${TRAIN[@]}" --metrics "$DIR/reference.jsonl" >"$DIR/reference.json"
echo "-- live: 4 -> 2 (step 3) -> 3 (step 6) -> a worker lost (step 9)" >&2
"$V/python" -m ptcfs.client.live --workers 4 --standby 1 --change 3:2 --change 6:3 \
  --job live --json --logs "$DIR/logs-live" -- \
  "$V/python" "${TRAIN[@]}" --die-at s0:9 --metrics "$DIR/live.jsonl" >"$DIR/live.json"

"$V/python" - "$DIR/live.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["job"]
print(f"live job {j['name']} in the stores: version {j['version']} at step {j['step']}, "
      f"{j['config']}")
EOF

echo "-- restart: the same changes through torchrun and the stores" >&2
restart() {  # WORKERS [train_llama.py options]
  local n=$1
  shift
  PTC_HOST=h0 "$V/torchrun" --standalone --nproc-per-node="$n" examples/train_llama.py \
    --job restart --data "$DIR/tokens.npy" --save-every 5 --metrics "$DIR/restart.jsonl" \
    "$@" >"$DIR/restart-$n.log" 2>&1 || { tail -n 30 "$DIR/restart-$n.log" >&2; exit 1; }
}
restart 4 --steps 3
restart 2 --steps 6
restart 3 --steps 12 --exit-after 8   # the lost worker: its job dies during step 9
restart 2 --steps 12

echo "-- hot switch: short micro-batches on fsdp=4, long ones on fsdp=2,tp=2" >&2
for mode in single hot; do
  "$V/torchrun" --standalone --nproc-per-node=4 examples/hotswitch_llama.py \
    --data "$DIR/tokens.npy" --steps 6 --metrics "$DIR/hot-$mode.jsonl" \
    $([ $mode = single ] && echo --single) >"$DIR/hot-$mode.log" 2>&1 \
    || { tail -n 30 "$DIR/hot-$mode.log" >&2; exit 1; }
done
"$V/python" - "$DIR/hot-single.jsonl" "$DIR/hot-hot.jsonl" <<'EOF'
import json, sys
single, hot = ([json.loads(x) for x in open(p)] for p in sys.argv[1:])
worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(single, hot))
step = sorted(d["step_s"] for d in hot)[len(hot) // 2]
switch = sorted(d["switch_s"] for d in hot)[len(hot) // 2]
print(f"hot switch: max relative loss difference {worst:.1e} against one mesh; "
      f"median step {step:.3f} s, of which switching {switch:.3f} s")
EOF
"$V/python" examples/live_summary.py "$DIR/reference.jsonl" "$DIR/live.jsonl" \
  "$DIR/live.json" "$DIR/restart.jsonl"
