"""The DSA model families that run IndexCache end to end, and ``from_pretrained`` by model_type."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from .args import FAMILIES, ModelArgs, model_type_of
from .deepseek_v32 import DeepseekV32ForCausalLM
from .glm5 import GlmMoeDsaForCausalLM
from .runtime import BatchMeta, PagedKVCache

MODEL_CLASSES = {cls.model_type: cls for cls in (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM)}
assert set(MODEL_CLASSES) == set(FAMILIES)


def model_class(config: dict) -> type:
    """The model class for a config.json dict, by its ``model_type`` (or ``architectures``)."""
    return MODEL_CLASSES[model_type_of(config)]


def from_pretrained(path: Union[str, Path], **kwargs) -> DeepseekV32ForCausalLM:
    """Load a DSA checkpoint directory with the class its config.json's ``model_type`` names;
    keywords as ``DeepseekV32ForCausalLM.from_pretrained`` (DESIGN.md §10)."""
    from indexcache import loader
    return model_class(loader.load_config(path)).from_pretrained(path, **kwargs)


__all__ = ["BatchMeta", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "ModelArgs", "PagedKVCache",
           "from_pretrained", "model_class"]
