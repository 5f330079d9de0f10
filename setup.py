"""Builds indexcache._C: the pybind11 plan module and the torch.library ops in one library.

Environment:
  INDEXCACHE_CUDA=auto|0|1   auto (default): compile CUDA kernels when torch is a CUDA build
                             and nvcc is found. Never looks for a visible GPU.
  TORCH_CUDA_ARCH_LIST       default "9.0a;8.0+PTX": Hopper SASS plus portable PTX.
  MAX_JOBS                   parallel compile jobs (read by torch's ninja builder).
Sources come from csrc/sources.txt, the list CMakeLists.txt reads too.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCH_LIST = "9.0a;8.0+PTX"


def read_sources():
    groups = {}
    for raw in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        group, path = line.split()
        groups.setdefault(group, []).append(path)
    return groups


def cuda_wanted(torch_mod, cuda_home):
    mode = os.environ.get("INDEXCACHE_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        sys.exit(f"INDEXCACHE_CUDA must be auto, 0 or 1, got {mode!r}")
    have = torch_mod.version.cuda is not None and cuda_home is not None
    if mode == "1" and not have:
        sys.exit(
            "INDEXCACHE_CUDA=1 but "
            + ("torch is a CPU-only build" if torch_mod.version.cuda is None else "nvcc was not found (set CUDA_HOME)")
        )
    return mode == "1" or (mode == "auto" and have)


def pip_cuda_dirs():
    """The nvidia/cu13 (or cu12) include and lib folders that pip's CUDA torch ships.

    The system toolkit may lack cuBLAS/cuSPARSE headers that torch's CUDA headers include.
    """
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return [], []
    incs, libs = [], []
    for base in spec.submodule_search_locations:
        for sub in ("cu13", "cu12"):
            d = Path(base) / sub
            if (d / "include").is_dir():
                incs.append(str(d / "include"))
            if (d / "lib").is_dir():
                libs.append(str(d / "lib"))
    return incs, libs


def compiler_version(cmd):
    exe = shutil.which(cmd)
    if exe is None:
        return "unknown"
    import subprocess

    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    release = [line for line in out if "release" in line]
    return (release or out or ["unknown"])[0].strip()


def locate_cuda_home():
    """CUDA_HOME for torch's builder: a toolkit folder that holds nvcc and libcudart.

    torch guesses dirname(dirname(which nvcc)), which is /usr/local when nvcc is a link or
    wrapper script in /usr/local/bin, and then cannot link libcudart.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates += sorted(Path("/usr/local").glob("cuda*"), reverse=True)
    for home in candidates:
        has_nvcc = (home / "bin" / "nvcc").is_file()
        has_cudart = any(any((home / lib).glob("libcudart.so*")) for lib in ("lib64", "lib"))
        if has_nvcc and has_cudart:
            os.environ["CUDA_HOME"] = str(home)
            return


def build_extension():
    locate_cuda_home()
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    groups = read_sources()
    sources = groups.get("plan", []) + groups.get("ext", []) + groups.get("cpu", [])
    with_cuda = cuda_wanted(torch, CUDA_HOME)
    include_dirs = [str(ROOT / "csrc" / "include")]
    library_dirs = []
    cxx = os.environ.get("CXX", "c++")
    define_macros = [
        ("INDEXCACHE_BUILD_TORCH", f'"{torch.__version__}"'),
        ("INDEXCACHE_CXX_COMPILER", f'"{compiler_version(cxx)}"'),
    ]
    # torch >= 2.10 headers need C++20; -O3 for the CPU kernels, which dispatch on CPU
    # features at run time (function target attributes), never at build time. at::parallel_for
    # is an inline `#pragma omp parallel` in torch's headers: without -fopenmp every CPU kernel
    # would silently run on one thread.
    extra = {"cxx": ["-O3", "-std=c++20", "-fvisibility=hidden", "-fopenmp"]}
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        arch_list = os.environ["TORCH_CUDA_ARCH_LIST"]
        sources += groups.get("cuda", [])
        incs, libs = pip_cuda_dirs()
        include_dirs += incs
        library_dirs += libs
        define_macros += [
            ("INDEXCACHE_WITH_CUDA", "1"),
            ("INDEXCACHE_CUDA_ARCHS", f'"{arch_list}"'),
            ("INDEXCACHE_NVCC", f'"{compiler_version(os.path.join(CUDA_HOME, "bin", "nvcc"))}"'),
        ]
        extra["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
        ext_cls = CUDAExtension
    else:
        ext_cls = CppExtension
    print(f"indexcache: CUDA kernels {'ON, archs ' + os.environ['TORCH_CUDA_ARCH_LIST'] if with_cuda else 'OFF'}")
    ext = ext_cls(
        name="indexcache._C",
        extra_link_args=["-fopenmp"],
        sources=sources,
        include_dirs=include_dirs,
        library_dirs=library_dirs,
        define_macros=define_macros,
        extra_compile_args=extra,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = build_extension()

setup(
    name="indexcache",
    version="0.1.0",
    description="IndexCache: cross-layer top-k index reuse for DeepSeek Sparse Attention models",
    package_dir={"": "python"},
    packages=find_packages("python"),
    package_data={"indexcache": ["py.typed", "data/*/*"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy", "safetensors", "tqdm"],
    # indexcache.integrations.transformers.enable: the releases it was tested against (SUPPORTED_TRANSFORMERS)
    extras_require={"transformers": ["transformers>=5.24.0,<5.25"]},
    entry_points={
        "console_scripts": ["indexcache=indexcache.cli:main"],
        # vLLM loads this in every process it starts (workers included); the function does
        # nothing unless vLLM runs on its CPU platform within the supported version range.
        "vllm.general_plugins": ["indexcache = indexcache.integrations.vllm:register"],
    },
)
