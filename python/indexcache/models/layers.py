"""Deprecated location (kept for one release): the blocks live in :mod:`indexcache.models.blocks`."""

import warnings

from .blocks import (MLA, MLP, AbsentLayer, DecoderLayer, Gate, Indexer, LayerNorm, MoE, MTPLayer, RMSNorm,  # noqa: F401
                     SharedHead, SparseAttention, apply_rope, rope_inv_freq, yarn_get_mscale)

warnings.warn("indexcache.models.layers is deprecated: import from indexcache.models.blocks", DeprecationWarning,
              stacklevel=2)
