import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Property-based fuzzing (tests/test_fuzz.py, csrc/tests/cuda_emu/test_emu_fuzz.py). Failing
# examples are kept in a git-ignored database and replayed first on the next run. "default"
# sizes CI (a few hundred examples per op, ~3 minutes on 2 cores in all); "long" runs
# thousands per op: `python -m pytest -q tests/test_fuzz.py --hypothesis-profile=long`.
_DB = DirectoryBasedExampleDatabase(str(Path(__file__).resolve().parents[1] / ".hypothesis" / "examples"))
_COMMON = dict(deadline=None, database=_DB, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
settings.register_profile("default", max_examples=250, **_COMMON)
settings.register_profile("long", max_examples=3000, **_COMMON)


def pytest_report_header(config):
    """The CPU and the kernel paths this run exercises, printed before the first test, so a
    failure on one kind of machine says which (DESIGN.md §9: three CPU kinds so far)."""
    import indexcache._C as _C

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    feats = ", ".join(k for k, v in _C._cpu_features().items() if v) or "none"
    paths = _C._cpu_paths()
    runs = ", ".join(p for p, why in paths.items() if not why)
    lacks = "; ".join(f"{p}: {why}" for p, why in paths.items() if why) or "none"
    dispatch = ", ".join(f"{k} {v}" for k, v in _C._cpu_dispatch().items())
    return [f"cpu: {model} ({os.cpu_count()} logical CPUs); features: {feats}",
            f"cpu paths: auto -> {_C._cpu_isa()}; tested: {runs}; skipped: {lacks}",
            f"cpu dispatch (auto, per op/dtype): {dispatch}",
            f"gpu: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none (CUDA cases skip)'}"]


def pytest_configure(config):
    # Hypothesis loads its "ci" profile when CI is set (.ci/run sets it), and this conftest is
    # imported after its plugin reads --hypothesis-profile: load ours explicitly.
    name = config.getoption("hypothesis_profile", default=None) or os.environ.get("INDEXCACHE_HYPOTHESIS_PROFILE", "default")
    settings.load_profile(name)


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on cpu, and on cuda where a GPU is visible; the cuda
    # case is listed (and skipped) without one, so a CPU run shows what it did not cover.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device",
            ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
