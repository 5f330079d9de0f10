"""The DSA model families that run IndexCache end to end, and ``from_pretrained`` by model_type.

Layout: ``args`` (configuration), ``state`` (one forward's batch, caches and context),
``blocks/`` (one module per kind of block), ``dsa`` (the causal LM every family specialises),
one file per family (``deepseek_v32``, ``glm5``, ``glm5_next``, ``hy_v4``, ``minimax_m3``, ``deepseek_v4``) and ``registry`` (model_type -> family)."""

from __future__ import annotations

from .args import ModelArgs
from .deepseek_v4 import DeepseekV4ForCausalLM
from .deepseek_v32 import DeepseekV32ForCausalLM
from .dsa import DSAForCausalLM
from .glm5 import GlmMoeDsaForCausalLM
from .glm5_next import Glm5NextForCausalLM
from .hy_v4 import HYV4ForCausalLM
from .minimax_m3 import MiniMaxM3ForCausalLM, MiniMaxM3VLTextTower
from .registry import from_pretrained, model_class, model_type_of
from .state import BatchMeta, PagedKVCache

__all__ = ["BatchMeta", "DSAForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV32ForCausalLM", "Glm5NextForCausalLM", "GlmMoeDsaForCausalLM",
           "HYV4ForCausalLM", "MiniMaxM3ForCausalLM", "MiniMaxM3VLTextTower", "ModelArgs",
           "PagedKVCache", "from_pretrained", "model_class", "model_type_of"]
