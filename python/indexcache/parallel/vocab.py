"""The vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a contiguous
range of vocabulary rows; the embedding all-reduces, the head all-gathers fp32 logits."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .groups import ParallelContext
from .linear import Linear, ShardedLinear, linear


class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab_range`` of the embedding; ids outside give zeros; one all-reduce sums the ranks
    (exact: one non-zero term per token)."""

    def __init__(self, vocab: int, dim: int, par: ParallelContext):
        super().__init__()
        self.par, self.vocab = par, vocab
        self.lo, self.hi = par.vocab_range(vocab)
        self.shard_dim, self.shard = 0, (self.lo, self.hi)
        self.full_shape = (vocab, dim)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, dim))

    def checkpoint_slice(self):
        return self.shard_dim, self.shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(inside, ids - self.lo, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.par.all_reduce(out, "embed_all_reduce")


def make_embedding(vocab: int, dim: int, par: ParallelContext) -> nn.Module:
    return nn.Embedding(vocab, dim) if par.tp_size == 1 else VocabParallelEmbedding(vocab, dim, par)


def head_dtype(model_dtype: torch.dtype, stored: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype an LM head is held in (formats.FP32_HEADS): bf16 in a bf16 model whose checkpoint
    stores it in bf16 (or that has no checkpoint), else fp32. Its logits are fp32 sums either way."""
    bf16 = model_dtype == torch.bfloat16 and stored in (None, torch.bfloat16)
    return torch.bfloat16 if bf16 else torch.float32


def make_lm_head(dim: int, vocab: int, par: ParallelContext) -> nn.Module:
    """The LM head (in ``head_dtype``, never FP8): this rank's vocabulary rows."""
    if par.tp_size == 1:
        return Linear(dim, vocab)
    return ShardedLinear(dim, vocab, 0, par.vocab_range(vocab), False)


def head_logits(head: nn.Module, hidden: torch.Tensor, vocab: int, par: ParallelContext) -> torch.Tensor:
    """fp32 full-vocabulary logits (fp32 sums, whatever the head's dtype) on every tensor-parallel
    rank of this stage."""
    return par.all_gather_last(linear(hidden, head.weight, out_dtype=torch.float32), vocab)
