#!/usr/bin/env bash
# The test suite (the README's second command runs setup first, then this).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
python -m pytest -q tests "$@"
