"""Builds an emulator library (one ``emu_*.cpp`` with the CUDA launchers of ``csrc/cuda``) with g++
on first use, and again whenever a source it includes is newer than the library."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def build_emu_lib(source: str, out: Path) -> ctypes.CDLL:
    """``source``: the file name of an ``emu_*.cpp`` beside this module; ``out``: the library's path."""
    srcs = [HERE / source, HERE / "cuda_emu.h", HERE / "emu_harness.h", *sorted((ROOT / "csrc" / "cuda").glob("*.cuh")),
            ROOT / "csrc" / "cuda" / "kernels.h", *sorted((ROOT / "csrc" / "include" / "indexcache").glob("*.h"))]
    if not out.exists() or any(s.stat().st_mtime > out.stat().st_mtime for s in srcs):
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if cxx is None:
            # CI builds the extension with the same compiler, so none there is a broken setup,
            # and these tests are CI's only check of the CUDA kernels' logic: fail, not skip.
            why = f"no C++ compiler ({os.environ.get('CXX', 'g++')} not on PATH; CXX names another)"
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(f"{why}; in CI (CI={os.environ['CI']}) the emulator tests must run")
            pytest.skip(why)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [cxx, "-std=c++20", "-O1", "-g", "-shared", "-fPIC", "-fno-strict-aliasing", "-include", "cuda_emu.h",
               f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'cuda'}", f"-I{HERE}", str(HERE / source),
               "-o", str(out), "-lpthread"]
        subprocess.run(cmd, check=True, cwd=HERE)
    return ctypes.CDLL(str(out))


_LIBS: dict[str, ctypes.CDLL] = {}


def load_emu_lib(source: str, lib_name: str | None, last_error: str) -> ctypes.CDLL:
    """The emulator library of ``source`` (an ``emu_*.cpp`` here), built by ``build_emu_lib`` on first
    use and kept for the process: ``$INDEXCACHE_EMU_LIB`` (default /tmp/indexcache_emu/libicemu.so)
    itself when ``lib_name`` is None, else the file ``lib_name`` beside it. ``last_error`` names the
    library's function that returns its last error message (a C string)."""
    if source not in _LIBS:
        base = Path(os.environ.get("INDEXCACHE_EMU_LIB", "/tmp/indexcache_emu/libicemu.so"))
        lib = build_emu_lib(source, base if lib_name is None else base.parent / lib_name)
        getattr(lib, last_error).restype = ctypes.c_char_p
        _LIBS[source] = lib
    return _LIBS[source]


def load_reference(file: str, alias: str):
    """``python/indexcache/<file>`` (a pure-torch reference module) loaded from its path as module
    ``alias``, without importing the package (whose ``__init__`` loads the compiled extension these
    tests do without); ``indexcache.formats``, which reference.py imports, is loaded the same way first."""
    if "indexcache.formats" not in sys.modules:
        fspec = importlib.util.spec_from_file_location("indexcache.formats", ROOT / "python" / "indexcache" / "formats.py")
        sys.modules["indexcache.formats"] = importlib.util.module_from_spec(fspec)
        fspec.loader.exec_module(sys.modules["indexcache.formats"])
    spec = importlib.util.spec_from_file_location(alias, ROOT / "python" / "indexcache" / file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
