"""Tests of the vLLM plugin. They run in .venv-vllm (``bash scripts/setup_vllm.sh``), which has
vLLM's CPU engine; the main suite (``tests/``) never collects this folder."""

import importlib.util
import os
import sys
from pathlib import Path

# tests/hf_weights.py: the random weights every suite's tiny transformers checkpoints share.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# One process for the engine (no spawned engine core): faster start, and the tests can create
# several LLM instances in turn. The plugin registers itself in every process either way.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
