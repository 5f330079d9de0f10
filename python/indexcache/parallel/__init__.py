"""Scale-out (DESIGN.md §11), in four modules: ``groups`` (process groups, collectives and the
pipeline-stage hand-off of the hidden state and the shared top-k rows), ``linear`` (sharded and
FP8 linear layers) and ``vocab`` (the vocabulary-parallel embedding and head). The per-GPU
memory of a plan is ``indexcache.models.sizing`` (it builds the model).

Nothing here is a module-level global: a :class:`ParallelContext` is built once per model (from
the initialised ``torch.distributed`` default group, or the single-process default) and handed to
every layer at construction. Layout, as DeepSeek's reference and the serving engines have it:

- tensor parallel over ``tp`` ranks: MLA heads split (``q_b_proj``, ``kv_b_proj`` by head,
  ``o_proj`` row-parallel + all-reduce), ``q_a_proj`` / ``kv_a_proj_with_mqa`` replicated, dense MLP
  and shared experts column/row split, vocabulary-parallel embedding (all-reduce) and LM head
  (all-gather);
- expert parallel: routed experts split evenly over the same ranks; each rank runs its experts for
  every token; routed and shared partial sums combine in one all-reduce per MoE layer;
- the indexer, the index-K cache and the top-k buffer are replicated on every rank;
- pipeline parallel over ``pp`` stages of contiguous layers, ranks ``[s*tp, (s+1)*tp)`` forming stage
  ``s``; rank ``r`` of stage ``s`` hands the residual stream, the top-k rows ``[:N]`` and their
  "valid" flag to rank ``r + tp``, so a stage that begins on an S layer reuses the previous stage's
  indices and the plan stays exactly as given.

FP8: a linear layer may hold its weight as e4m3 plus one fp32 ``weight_scale_inv`` per 128x128
block (the official checkpoint's format). On CPU it dequantizes one block-row at a time into the
activation dtype and matmuls; on CUDA it uses torch's block-scaled matmul
(``torch.nn.functional.scaled_mm`` with 1x128 / 128x128 scales) when the installed torch has it,
else the same dequant path.
"""

# the names this module exported before it was split (tests/test_architecture.py)
from indexcache.formats import (FP8_DS_MLA_BYTES, FP8_LINEAR_NAMES, FP8_MAX, FP8_WEIGHT_AMAX_FLOOR,  # noqa: F401
                                FP8_WEIGHT_BLOCK, INDEX_K_BYTES, MLA_KV_WIDTH, MLA_LATENT)
from indexcache.fp8_blocks import quantize_fp8_blocks  # noqa: F401

from .groups import ParallelContext, check_divisible, init_from_env, stage_bounds, stage_start_full_pattern
from .linear import FP8_BLOCK, ShardedLinear, dense_weight
from .vocab import VocabParallelEmbedding, head_dtype, head_logits, make_embedding, make_lm_head

WEIGHTS_CHOICES = ("auto", "fp8", "bf16")

MLA_KV_BYTES = {"fp8_ds_mla": FP8_DS_MLA_BYTES, "bf16": 2 * MLA_KV_WIDTH}  # per token per layer (DESIGN §5)

__all__ = ["FP8_BLOCK", "MLA_KV_BYTES", "ParallelContext", "ShardedLinear", "VocabParallelEmbedding", "WEIGHTS_CHOICES",
           "check_divisible", "dense_weight", "head_dtype", "head_logits", "init_from_env", "make_embedding",
           "make_lm_head", "stage_bounds", "stage_start_full_pattern"]
