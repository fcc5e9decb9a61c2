#!/usr/bin/env bash
# The elastic LLaMA example (FSDP2 + tensor parallelism on a DeviceMesh),
# from a clean set-up: a local cluster of two hosts (h0, h1; four GPU slots
# each, on loopback), then
#   1. an uninterrupted run: 4 workers (fsdp=2, tp=2) for 40 steps;
#   2. the same job elastic: 4 workers on h0 (fsdp=2, tp=2) stop after step
#      22 (commits every 5 steps: it resumes from 20), 2 workers on h1
#      (fsdp=2) take over and stop after step 32, 3 workers on h0 (fsdp=3)
#      finish.
# Every start builds its mesh from the world size, asks ptcfs to
# reconfigure the job to it, and loads its rank's shards from the last
# commit. Where FUSE works, each host mounts /ptc (DIR/cluster/mnt/<host>),
# the data set is ingested into both jobs, and every worker reads its
# rank's view there; elsewhere the workers read the token file in the same
# order. Prints both runs' losses per step; the last line is
# "max relative loss difference: X". Usage: examples/elastic_llama.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/torchrun ] || bash deploy/setup.sh
V="$PWD/.venv/bin"
DIR="$(realpath -m "${1:-$(mktemp -d /tmp/ptc-llama.XXXXXX)}")"
mkdir -p "$DIR"
"$V/python" -m ptcfs.server.testing.localcluster down "$DIR/cluster" >/dev/null 2>&1 || true
rm -rf "$DIR/cluster" "$DIR"/*.jsonl
trap '"$V/python" -m ptcfs.server.testing.localcluster down "$DIR/cluster" >/dev/null 2>&1 || true' EXIT
if [ -e /dev/fuse ] && command -v fusermount3 >/dev/null; then MOUNT=1; else MOUNT=0; fi
"$V/python" -m ptcfs.server.testing.localcluster up 2 "$DIR/cluster" --gpus 4 \
  $([ $MOUNT = 1 ] || echo --no-mount) >/dev/null
export PTC_CLUSTER="$DIR/cluster/cluster.toml" OMP_NUM_THREADS=1
# torchrun's agents otherwise reuse one store for the workers across restarts
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
"$V/python" examples/make_tokens.py "$DIR/tokens.npy"
DATA=(--data "$DIR/tokens.npy")
if [ $MOUNT = 1 ]; then
  for job in uninterrupted elastic; do
    "$V/ptcctl" data ingest $job "$DIR/tokens.npy" --format npy --global-batch 12 --seed 1 \
      --dp 2 >/dev/null
  done
  DATA=(--data-view "$DIR/cluster/mnt/{host}")
  echo "-- data: each rank's view under $DIR/cluster/mnt/<host>/<job>/data" >&2
fi

run() {  # HOST WORKERS JOB METRICS [train_llama.py options]
  local host=$1 n=$2 job=$3 metrics=$4
  shift 4
  echo "-- $job: $n workers on $host $*" >&2
  PTC_HOST=$host "$V/torchrun" --standalone --nproc-per-node="$n" examples/train_llama.py \
    --job "$job" "${DATA[@]}" --steps 40 --save-every 5 \
    --metrics "$DIR/$metrics" "$@" >"$DIR/$job-$n.log" 2>&1 \
    || { tail -n 30 "$DIR/$job-$n.log" >&2; exit 1; }
}

run h0 4 uninterrupted uninterrupted.jsonl
run h0 4 elastic elastic.jsonl --exit-after 22
run h1 2 elastic elastic.jsonl --exit-after 32
run h0 3 elastic elastic.jsonl
"$V/python" examples/compare_losses.py "$DIR/uninterrupted.jsonl" "$DIR/elastic.jsonl"
