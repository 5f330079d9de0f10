"""The text the small models train and are evaluated on: the Python standard library that ships
with the interpreter (sources and pydoc documentation), split into train / calibration /
held-out by a hash of each file's path."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Optional

import torch

SPLITS = ("train", "calib", "heldout")


def stdlib_files(root: Optional[Path] = None) -> list[Path]:
    """The standard library's .py files (pydoc's documentation topics included), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_of(relpath: str) -> str:
    """train (90 %), calib (5 %) or heldout (5 %), by a hash of the file's relative path."""
    h = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100
    return "train" if h < 90 else ("calib" if h < 95 else "heldout")


def load_text(split: str, max_bytes: Optional[int] = None, root: Optional[Path] = None) -> bytes:
    """Concatenated bytes of one split's files (in path order), up to max_bytes."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for p in stdlib_files(root):
        if split_of(p.relative_to(root).as_posix()) != split:
            continue
        data = p.read_bytes()
        out.append(data)
        size += len(data) + 1
        if max_bytes is not None and size >= max_bytes:
            break
    text = b"\n".join(out)
    return text[:max_bytes] if max_bytes is not None else text


def text_tensor(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
