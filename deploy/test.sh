#!/usr/bin/env bash
# Set everything up (deploy/setup.sh), then lint, type-check and run the
# whole test suite on three workers (pytest-xdist), a test file each: most
# tests wait on daemons, torchrun jobs, leases and mounts, so two cores run
# three files at once, the heaviest first (tests/conftest.py, tests/weights.json).
# Extra arguments go to pytest (e.g. -k planner,
# -m "not slow"; -n 0 runs in one process). The wider sweeps (marker
# extended) run with PTC_TEST_ALL=1. PTC_TEST_WORKERS sets the
# number of workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
# the suite starts thousands of Python processes (ptcctl, ptcd, mounts,
# ranks): each compiles ptcfs from source again where bytecode is not kept
unset PYTHONDONTWRITEBYTECODE
# three workers on two cores, each starting ranks, daemons and commands: one
# compute thread per process (torch and numpy would start one per core in
# each, and wait for each other's spinning threads)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# a process that dies of a fatal signal (a rare SIGABRT at a rank's exit has
# been seen) prints every thread's Python stack into the test's output
export PYTHONFAULTHANDLER=1
V=.venv/bin
echo "== ruff"
"$V/ruff" check ptcfs client server tests bench
echo "== mypy"
"$V/mypy"
echo "== pytest"
# the default run leaves out the wider sweeps (marker extended: every other
# architecture, repeated trials); PTC_TEST_ALL=1 or -m ... runs them too
MARK=(-m "not extended")
[ "${PTC_TEST_ALL:-}" = 1 ] && MARK=()
exec "$V/python" -m pytest -n "${PTC_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
    --durations=30 "${MARK[@]}" "$@"
