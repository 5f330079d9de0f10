"""The suite's skip guard (tests/conftest.py): under CI, a skip that is not one this machine may
show (no GPU, a CPU path it lacks) fails the run, so no test passes CI by skipping."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = '''
import pytest

def test_setup_skip():
    pytest.skip("this transformers has no SomeFamilyForCausalLM")

@pytest.mark.skip(reason="no CUDA device")
def test_machine_skip():
    pass

def test_runs():
    assert 1 + 1 == 2
'''


def _run(tmp_path: Path, ci: str | None, select: str = "") -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py" + select]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_setup_skip_fails_ci_and_is_listed(tmp_path):
    r = _run(tmp_path, "true")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "skips that are not this machine's (CI: the run fails)" in r.stdout
    assert "test_probe.py::test_setup_skip: this transformers has no SomeFamilyForCausalLM" in r.stdout
    assert "test_machine_skip" not in r.stdout.split("skips that are not")[1]


def test_outside_ci_it_is_listed_only(tmp_path):
    r = _run(tmp_path, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test_probe.py::test_setup_skip: this transformers has no SomeFamilyForCausalLM" in r.stdout


def test_machine_skips_pass_ci(tmp_path):
    r = _run(tmp_path, "1", "::test_machine_skip")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skips that are not" not in r.stdout
