#!/usr/bin/env bash
# The GPU suite in one command (about 8 minutes; see benchmarks/gpu_suite.py):
#
#   bash benchmarks/gpu_suite.sh [--minutes 8] [--out DIR] [--dry-run] [--gpus N]
#
# Runs from the repository root; PY picks the interpreter (default python3).
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
PY=${PY:-python3}
exec "$PY" benchmarks/gpu_suite.py --python "$PY" "$@"
