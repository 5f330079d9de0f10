"""Start and stop a ``vllm serve`` process on this machine: what ``bench/bench_vllm_serve.py`` and
``tests_vllm/test_vllm_serve.py`` both do (no vLLM import: the server is another process).

``start`` runs the command in a session of its own (its API server and engine-core process are one
process group), its output to a log file, with the environment a user's shell would give it (the tests'
in-process engine switch removed); ``wait_ready`` polls ``/health``; ``stop`` sends SIGTERM to the group,
then SIGKILL if it lingers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

STOP_TIMEOUT_S = 30


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body=None, timeout: float = 600):
    """GET ``url`` (its text) or, with ``body``, POST it as JSON (the reply's JSON)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read().decode()
    return json.loads(raw) if body is not None else raw


def start(cmd: list, log: Path, logging_level: str = "INFO") -> subprocess.Popen:
    """``cmd`` (a ``vllm serve`` command line) in its own process group, stdout and stderr into ``log``."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL=logging_level)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the tests' in-process engine: not how users serve
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout_s: float) -> float:
    """Seconds until ``base``/health answered; RuntimeError with the log's tail if the server exited or
    did not answer within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}; log tail:\n{log.read_text()[-4000:]}")
        try:
            http(base + "/health", timeout=5)
            return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(2)
    raise RuntimeError(f"vllm serve not ready after {timeout_s} s; log tail:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (API server + engine core), SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT_S)
