#!/usr/bin/env bash
# Set everything up (deploy/setup.sh), then lint, type-check and run the
# whole test suite. Extra arguments go to pytest (e.g. -k planner, -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
V=.venv/bin
echo "== ruff"
"$V/ruff" check ptcfs client server tests bench
echo "== mypy"
"$V/mypy"
echo "== pytest"
exec "$V/python" -m pytest "$@"
