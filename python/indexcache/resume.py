"""Resume state of the training loops (``train``, training-aware ``train``): written with
``torch.save`` and read back with ``torch.load(weights_only=True)``, so a file placed in an
output folder can hold tensors, numbers, strings, lists and dicts but never runs code; a state
written for another run (schedule, config, pattern, model shape) is refused before anything of
it is used."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch


def save_resume_state(path, state: Mapping) -> None:
    """Write ``state`` (tensors, numbers, strings, None, lists, dicts) to ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(dict(state), tmp)
    os.replace(tmp, path)


def load_resume_state(path, expect: Mapping, model: torch.nn.Module, *, keys=("model", "step", "history")) -> dict:
    """The state at ``path``, checked against this run: every item of ``expect`` equal to the
    state's, the ``keys`` present, and its ``model`` tensors exactly this model's names, shapes
    and dtypes. Any mismatch or a file that is not plain data is a ValueError."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unpickling refusal, a truncated or foreign file
        raise ValueError(f"{path} is not a resume state of this run ({type(e).__name__}: {str(e)[:200]}); "
                         "use a new --out directory") from None
    if not isinstance(state, dict) or any(k not in state for k in list(expect) + list(keys)):
        raise ValueError(f"{path} is not a resume state of this run (missing entries); use a new --out directory")
    for k, v in expect.items():
        if state[k] != v:
            raise ValueError(f"{path} was written for another {k}; use a new --out directory")
    theirs, ours = state["model"], model.state_dict()
    if not isinstance(theirs, dict) or set(theirs) != set(ours):
        raise ValueError(f"{path} holds another model's tensors; use a new --out directory")
    for name, t in ours.items():
        other = theirs[name]
        if not isinstance(other, torch.Tensor) or other.shape != t.shape or other.dtype != t.dtype:
            raise ValueError(f"{path}: {name} does not match this model; use a new --out directory")
    return state
