#!/usr/bin/env bash
# The main job: set everything up, then show how ptcfs would re-partition a
# real model's state (GPT-2 XL sized, fp16 with Adam) through a sequence of
# parallelism and host changes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
PTCCTL=.venv/bin/ptcctl
MODEL="gpt:layers=48,hidden=1600,heads=25,vocab=50257,seq=1024"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "scale in: tp=1,dp=4 on two hosts -> tp=1,pp=2,dp=1 on h1 and a new host h2"
"$PTCCTL" plan --model "$MODEL" --optimizer adam \
    --from tp=1,dp=4 --from-hosts h0:2,h1:2 --to tp=1,pp=2,dp=1 --to-hosts h1:1,h2:1
step "tensor parallel 5 -> data parallel: tp=5,dp=1 on h0 -> tp=1,dp=2 on h0,h1"
"$PTCCTL" plan --model "$MODEL" --optimizer adam \
    --from tp=5 --from-hosts h0:8 --to tp=1,dp=2 --to-hosts h0:1,h1:1
