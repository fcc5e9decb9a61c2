#!/usr/bin/env bash
# Set up ptcfs on a Debian machine (run as root, or as a user with sudo):
# system packages (Python, FUSE 3), a virtual environment at .venv in the
# repository root, torch 2.13.0 (CPU) first, then ptcfs with its test tools and
# megatron-core (the mcore extra: two small wheels, no other torch), then deepspeed.
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"

say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        say "need root for: $*"; exit 1; fi
}

need_apt=()
python_ok() {
    command -v python3 >/dev/null && python3 - <<'PY' 2>/dev/null
import sys, venv, ensurepip
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
}
python_ok || need_apt+=(python3 python3-venv python3-dev)
command -v fusermount3 >/dev/null || need_apt+=(fuse3)
ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so' || need_apt+=(libfuse3-3)
command -v gcc >/dev/null || need_apt+=(gcc)
command -v git >/dev/null || need_apt+=(git)
command -v etcd >/dev/null || need_apt+=(etcd-server)  # the cluster registry (registry =)
command -v tc >/dev/null || need_apt+=(iproute2)    # ip netns and tc: deploy/netns-cluster.sh
command -v nsenter >/dev/null || need_apt+=(util-linux)
if [ ${#need_apt[@]} -gt 0 ]; then
    say "installing system packages: ${need_apt[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${need_apt[@]}" ca-certificates
fi

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
fi
# --no-compile: a module's bytecode is written by the first process that
# imports it (deploy/test.sh and deploy/demo.sh unset PYTHONDONTWRITEBYTECODE),
# and only for what is imported; compiling all of torch, sympy and transformers
# at install took about 55 s of a fresh set-up here
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    say "installing torch 2.13.0 (CPU build)"
    "${PIP[@]}" install --no-compile "torch==2.13.0"
fi
stamp="$VENV/.ptcfs-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    say "installing ptcfs and its dependencies into $VENV"
    "${PIP[@]}" install --no-compile -e ".[torch,test,mcore]"
    # torchtitan's model, optimizer and CheckpointManager (ptcfs[titan]), without the
    # dependencies its metadata names that would bring another torch or unused services
    "${PIP[@]}" install --no-compile --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" \
        "torchdata==0.11.0" "triton==3.9.0"
    "${PIP[@]}" install --no-compile "tyro>=1"
    touch "$stamp"
fi
# DeepSpeed (the deepspeed extra, for the --format deepspeed tests) is an sdist whose build
# would fetch another torch: build it against ours, without its C++ ops
if ! "$VENV/bin/python" -c 'import deepspeed' 2>/dev/null; then
    say "installing deepspeed 0.19.8 (no ops, against the installed torch)"
    DS_BUILD_OPS=0 "${PIP[@]}" install --no-compile --no-build-isolation "deepspeed==0.19.8"
fi
say "ready: $VENV/bin/ptcctl"
