#!/usr/bin/env bash
# Creates .venv with torch (the CUDA 13.0 build, so the CUDA kernels compile and link
# even without a GPU) and builds indexcache into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${INDEXCACHE_TORCH_SPEC:-torch==2.14.1}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "$TORCH_SPEC"
python -m pip install -q -r requirements-dev.txt
# CUDA kernels build whenever nvcc and a CUDA torch are present (INDEXCACHE_CUDA=auto).
# Rebuild only when the native sources changed since the last build here (a build takes minutes).
stamp=.venv/.indexcache-built
if [ -f "$stamp" ] && python -c "import indexcache" 2>/dev/null && [ -z "$(find csrc setup.py -newer "$stamp" -print -quit)" ]; then
  echo "indexcache: extension up to date"
else
  MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q --no-build-isolation --no-deps -e .
  touch "$stamp"
fi
