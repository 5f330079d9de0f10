import functools
import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def _isa_path(name):
    """The path every (op, dtype) takes here when `name` is requested (_cpu_dispatch())."""
    import indexcache._C as _C

    _C._set_cpu_isa(name)
    try:
        return _C._cpu_dispatch()
    finally:
        _C._set_cpu_isa("auto")


AS_AUTO = "what 'auto' takes on this CPU: its cases run as 'auto', not twice"


@functools.lru_cache(maxsize=1)
def cpu_path_plan() -> dict[str, str]:
    """Each CPU path name the `cpu_isa` fixture knows -> "" when its cases run here, or why not.

    'auto' (the default) always runs; each path by name runs where this CPU has it, except one
    that is exactly what 'auto' takes here (its cases would repeat auto's). 'portable' always
    runs by name, so the fallback is covered even where auto picks a faster path."""
    import indexcache._C as _C

    plan = {"auto": ""}
    for name, why in _C._cpu_paths().items():
        if why:
            plan[name] = f"this CPU cannot run it: {why}"
        elif name != "portable" and _isa_path(name) == _isa_path("auto"):
            plan[name] = AS_AUTO
        else:
            plan[name] = ""
    return plan


def pytest_report_header(config):
    """The CPU and, per CPU kernel path, whether its cases run here and why not, printed before
    the first test, so a failure on one kind of machine says which (DESIGN.md §9: three CPU
    kinds so far). The counts per path come at the end (pytest_terminal_summary)."""
    import indexcache._C as _C

    feats = ", ".join(k for k, v in _C._cpu_features().items() if v) or "none"
    lines = [f"cpu: {_cpu_model()} ({os.cpu_count()} logical CPUs); features: {feats}",
             f"cpu paths: auto -> {_C._cpu_isa()} (each op and dtype: the dispatch line below); "
             "the fuzz tests draw from the paths that run",
             "cpu dispatch (auto, per op/dtype): " + ", ".join(f"{k} {v}" for k, v in _C._cpu_dispatch().items())]
    lines += [f"  {name}: {'runs' if not why else why if why == AS_AUTO else 'skipped, ' + why}"
              for name, why in cpu_path_plan().items()]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (the CUDA cases skip: no CUDA device)"
    return lines + [f"gpu: {gpu}"]


def pytest_configure(config):
    # Hypothesis loads its "ci" profile when CI is set (.ci/run sets it), and this conftest is
    # imported after its plugin reads --hypothesis-profile: load ours explicitly.
    name = config.getoption("hypothesis_profile", default=None) or os.environ.get("INDEXCACHE_HYPOTHESIS_PROFILE", "default")
    settings.load_profile(name)


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _cpu_isa_params(device=None):
    """One case per CPU path of cpu_path_plan that is not 'auto' under another name; a path this
    CPU lacks is listed as skipped with its reason. With `device`: (device, cpu_isa) pairs."""
    def case(name, why):
        marks = [pytest.mark.skip(reason=f"cpu path '{name}': {why}")] if why else []
        return pytest.param(*([device] if device else []), name, marks=marks, id=f"{device}-{name}" if device else name)

    return [case(name, why) for name, why in cpu_path_plan().items() if why != AS_AUTO]


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on cpu, and on cuda where a GPU is visible; the cuda
    # case is listed (and skipped, "no CUDA device") without one, so a CPU run shows what it
    # did not cover. A test taking `cpu_isa` runs once per CPU path (cpu_path_plan); its cuda
    # case runs once, with the default path (the CPU path does not reach a CUDA kernel).
    names = metafunc.fixturenames
    if "device" in names and "cpu_isa" in names:
        cases = _cpu_isa_params("cpu") + [pytest.param("cuda", "auto", marks=NO_CUDA, id="cuda")]
        metafunc.parametrize(("device", "cpu_isa"), cases, indirect=["cpu_isa"])
    elif "device" in names:
        metafunc.parametrize("device", ["cpu", pytest.param("cuda", marks=NO_CUDA)])
    elif "cpu_isa" in names:
        metafunc.parametrize("cpu_isa", _cpu_isa_params(), indirect=True)


@pytest.fixture
def cpu_isa(request):
    """The CPU kernels' path for this case (pytest_generate_tests gives one case per path of
    cpu_path_plan): portable, the AVX-512 BF16 kernels, the oneDNN brgemm 'blas' path, and
    'auto'. On AVX2-only CPUs torch's brgemm refuses bf16, so no 'blas'. Back to 'auto' after."""
    import indexcache._C as _C

    _C._set_cpu_isa(request.param)
    yield request.param
    _C._set_cpu_isa("auto")


_ISA_OF: dict[str, str] = {}  # nodeid -> its CPU path, for the cpu cases that take cpu_isa
_TALLY: dict[str, dict[str, int]] = {}  # CPU path -> outcome -> count


# Skips a machine of this project's kinds may show: no GPU, a CPU path this CPU lacks, no cpuinfo.
# Any other skip (a transformers without a family's classes, a module that did not import, a
# comparison whose reference is missing) means the setup is broken; under CI it fails the run,
# so no test passes CI by skipping.
_MACHINE_SKIPS = ("no CUDA device", "cpu path '", "no /proc/cpuinfo")
_SETUP_SKIPS: list[str] = []  # "nodeid: reason" of the other skips


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _note_skip(report):
    if not report.skipped or getattr(report, "wasxfail", None) is not None:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(_MACHINE_SKIPS):
        _SETUP_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if _SETUP_SKIPS and _in_ci() and exitstatus == 0:
        session.exitstatus = 1


def pytest_runtest_logreport(report):
    _note_skip(report)
    # Outcomes per CPU path: a case's call result, or its setup's skip.
    isa = _ISA_OF.get(report.nodeid)
    if isa is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    counts = _TALLY.setdefault(isa, {})
    counts[report.outcome] = counts.get(report.outcome, 0) + 1


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "cpu_isa" in params and params.get("device", "cpu") == "cpu":
            _ISA_OF[item.nodeid] = params["cpu_isa"]


def pytest_terminal_summary(terminalreporter):
    if _SETUP_SKIPS:
        terminalreporter.section("skips that are not this machine's" + (" (CI: the run fails)" if _in_ci() else ""))
        for line in _SETUP_SKIPS:
            terminalreporter.write_line(line)
    if not _TALLY:
        return
    terminalreporter.section("cases per CPU path")
    plan = cpu_path_plan()
    for name in plan:
        counts = _TALLY.get(name, {})
        text = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "none collected"
        terminalreporter.write_line(f"{name}: {plan[name] if plan[name] == AS_AUTO else text}"
                                    + (f" ({plan[name]})" if plan[name] and plan[name] != AS_AUTO else ""))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture
def rng():
    """A random.Random with a fresh seed per test, printed so a failure can be replayed."""
    seed = random.randrange(2 ** 31)
    print(f"inputs seed {seed}")
    return random.Random(seed)
