"""config.json's ``model_type`` -> the family class that runs it. Adding a family: its file, and
its import here (a family class registers itself by naming its ``model_type``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Union

from . import deepseek_v4, deepseek_v32, glm5, glm5_next, hy_v4, minimax_m3, qwen4_exp  # noqa: F401  (the families register themselves)
from .dsa import FAMILIES, DSAForCausalLM, model_type_of


def model_class(config: Mapping[str, Any]) -> type:
    """The model class for a config.json dict, by its ``model_type`` (or ``architectures``)."""
    return FAMILIES[model_type_of(config)]


def from_pretrained(path: Union[str, Path], **kwargs) -> DSAForCausalLM:
    """Load a DSA checkpoint directory with the class its config.json's ``model_type`` names;
    keywords as ``DSAForCausalLM.from_pretrained`` (DESIGN.md §10)."""
    from indexcache import loader
    return model_class(loader.load_config(path)).from_pretrained(path, **kwargs)
