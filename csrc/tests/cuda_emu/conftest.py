# The hypothesis profiles of tests/conftest.py, for when this folder runs on its own
# (`--hypothesis-profile=long` must name a registered profile).
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("indexcache_tests_conftest",
                                               Path(__file__).resolve().parents[3] / "tests" / "conftest.py")
_tests_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests_conftest)
pytest_configure = _tests_conftest.pytest_configure
