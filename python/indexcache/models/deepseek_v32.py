"""DeepSeek-V3.2 (``model_type: deepseek_v32``): the DSA family this project started from.

Every block is the generic DSA block (``blocks``: MLA with the lightning indexer, a sigmoid
group-limited MoE, MTP); what is DeepSeek-V3.2's own is its name, its defaults for fields a
config.json may omit (the indexer's RoPE in NeoX split-half layout, rms_norm_eps 1e-6) and its
checkpoint tensor names, which are the blocks' parameter names. transformers'
``DeepseekV32ForCausalLM`` and DeepSeek's reference code are what it is tested against.

This module is the public path of DESIGN.md §10 (``from indexcache.models.deepseek_v32 import
DeepseekV32ForCausalLM``); the blocks, the model core and one forward's state are imported from
where they live (``models.blocks``, ``models.dsa``, ``models.state``).
"""

from __future__ import annotations

from .dsa import DSAForCausalLM


class DeepseekV32ForCausalLM(DSAForCausalLM):
    model_type = "deepseek_v32"
    architecture = "DeepseekV32ForCausalLM"
    config_defaults = {"rms_norm_eps": 1e-6, "indexer_rope_interleave": False}
