"""The blocks DSA families are built from, one module per kind: ``rope``, ``norms``, ``indexer``
(the lightning indexer), ``mla`` (latent attention, kernels and torch forms), ``moe`` (MLP,
router, MoE) and ``decoder`` (decoder, MTP and absent layers)."""

from .decoder import AbsentLayer, DecoderLayer, MTPLayer, SharedHead
from .indexer import Indexer
from .mla import MLA, SparseAttention
from .moe import MLP, Gate, MoE
from .norms import LayerNorm, RMSNorm
from .rope import apply_rope, rope_inv_freq, yarn_get_mscale

__all__ = ["AbsentLayer", "DecoderLayer", "Gate", "Indexer", "LayerNorm", "MLA", "MLP", "MTPLayer", "MoE", "RMSNorm",
           "SharedHead", "SparseAttention", "apply_rope", "rope_inv_freq", "yarn_get_mscale"]
