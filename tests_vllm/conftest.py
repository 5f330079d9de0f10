"""Tests of the vLLM plugin. They run in .venv-vllm (``bash scripts/setup_vllm.sh``), which has
vLLM's CPU engine; the main suite (``tests/``) never collects this folder.

Without vLLM the folder collects nothing, except under ``CI=true`` (or 1/yes), where that is an
error: a CI job that runs these tests must have built .venv-vllm."""

import os
import sys

import pytest


# One process for the engine (no spawned engine core): faster start, and the tests can create
# several LLM instances in turn. The plugin registers itself in every process either way
# (test_vllm_serve.py starts `vllm serve` without this, as users do).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm  # noqa: F401
    VLLM_ERROR = None
except ImportError as e:
    VLLM_ERROR = e
    collect_ignore_glob = ["test_*.py"]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config):
    if VLLM_ERROR is not None and in_ci():
        raise pytest.UsageError(
            f"tests_vllm: CI is set but vLLM does not import in {sys.executable} ({VLLM_ERROR}); run "
            "`bash scripts/setup_vllm.sh`, then `.venv-vllm/bin/python -m pytest -q tests_vllm`")
