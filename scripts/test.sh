#!/usr/bin/env bash
# The test suite (the README's second command runs setup first, then this).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# tests/: every op, the model and the tools (CUDA cases skip without a GPU); csrc/tests/cuda_emu:
# the CUDA kernels' own code run on the CPU through an emulator, so CI checks their logic too. Not -q:
# the header says which CPU paths run here and which are skipped and why (tests/conftest.py).
python -m pytest tests csrc/tests/cuda_emu "$@"
