"""GLM-5.x (``model_type: glm_moe_dsa``: GLM-5, 5.1, 5.2) with IndexCache.

The same DSA block as DeepSeek-V3.2 (DESIGN.md §6); what differs is in its defaults
(interleaved indexer RoPE, rms_norm_eps 1e-5, one expert group) and in the checkpoint itself
(widths, 78 layers, MTP at ``model.layers.78``, and, from GLM-5.2, IndexCache settings in
config.json: ``indexer_types``, ``index_topk_freq: 4``, ``index_skip_topk_offset: 3``, which the
plan honours as shipped). transformers' ``GlmMoeDsaForCausalLM`` is the reference it is tested
against.
"""

from __future__ import annotations

from .deepseek_v32 import DeepseekV32ForCausalLM


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    model_type = "glm_moe_dsa"
    architecture = "GlmMoeDsaForCausalLM"
    config_defaults = {"rms_norm_eps": 1e-5, "indexer_rope_interleave": True, "n_group": 1, "topk_group": 1}
