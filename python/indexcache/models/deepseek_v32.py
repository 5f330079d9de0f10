"""DeepSeek-V3.2 (``model_type: deepseek_v32``): the DSA family this project started from.

Every block is the generic DSA block (``blocks``: MLA with the lightning indexer, a sigmoid
group-limited MoE, MTP); what is DeepSeek-V3.2's own is its name, its defaults for fields a
config.json may omit (the indexer's RoPE in NeoX split-half layout, rms_norm_eps 1e-6) and its
checkpoint tensor names, which are the blocks' parameter names. transformers'
``DeepseekV32ForCausalLM`` and DeepSeek's reference code are what it is tested against.

This module is the public path of DESIGN.md §10 (``from indexcache.models.deepseek_v32 import
DeepseekV32ForCausalLM``) and re-exports the names it always exported.
"""

from __future__ import annotations

from .args import (ATTN_CHUNK_ELEMS, BLOCK_SIZE, FP8_DS_MLA_BYTES, INDEX_HEAD_DIM, INDEX_K_EPS, INDEX_Q_EPS,  # noqa: F401
                   INDEXER_CHUNK_ELEMS, MLA_LATENT, MLA_ROPE, ModelArgs)
from .blocks import (MLA, MLP, AbsentLayer, DecoderLayer, Gate, Indexer, LayerNorm, MoE, MTPLayer, RMSNorm,  # noqa: F401
                     SharedHead, SparseAttention, apply_rope, rope_inv_freq, yarn_get_mscale)
from .dsa import DSAForCausalLM, DSAModel, stage_full_plan, validate_parallel  # noqa: F401
from .state import BatchMeta, CacheManager, ForwardContext, PagedKVCache, StageTimer  # noqa: F401


class DeepseekV32ForCausalLM(DSAForCausalLM):
    model_type = "deepseek_v32"
    architecture = "DeepseekV32ForCausalLM"
    config_defaults = {"rms_norm_eps": 1e-6, "indexer_rope_interleave": False}
