#!/usr/bin/env bash
# The one-script GPU check (issue 6), under 8 minutes on one H200. Prints a short table last and writes
# gpu_check.json (to $OUT when set, else the current directory). Without CUDA it stops at once, exit 2.
#
#   benchmarks/micro/gpu_check.sh                 # everything
#   benchmarks/micro/gpu_check.sh --quick         # 4 layers, small batches: a smoke run
#   benchmarks/micro/gpu_check.sh --sections kernels,bandwidth
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" -m benchmarks.micro.gpu_check --json "${OUT:-.}/gpu_check.json" "$@"
