"""MiniMax-M3's feed-forward blocks: the SwiGLU-OAI activation (GPT-OSS's, halves not
interleaved), its MLP (dense layers and the shared expert), fused routed experts and the MoE
(the sigmoid router of ``moe.Gate``, routed experts scaled by ``routed_scaling_factor``, plus the
shared expert).

SwiGLU-OAI: ``gate <= limit``, ``up`` within ``±limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``.

Two checkpoint layouts (``ModelArgs.fused_experts``): transformers' in-memory one (text
checkpoints: ``gate_up_proj`` fused, routed experts stacked ``[E, 2I, D]`` / ``[E, D, I]``) and
the official VL one (separate ``gate_proj`` / ``up_proj`` / ``down_proj``, one module per routed
expert, renamed to ``w1`` / ``w3`` / ``w2`` by the family file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from indexcache.parallel import ParallelContext

from ..args import ModelArgs
from .moe import FusedExperts, Gate, MoE


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class OAIMLP(nn.Module):
    """A SwiGLU-OAI MLP ``dim -> inter -> dim``: ``gate_up_proj`` (gate rows first) when ``fused``,
    else ``gate_proj`` and ``up_proj``; then ``down_proj``.

    ``shard`` (dense MLPs, the shared expert; the caller sums the ranks' outputs): split
    column/row over the tensor-parallel ranks. The fused ``gate_up_proj`` (text checkpoints) has
    no contiguous per-rank slice, so there the MLP stays whole and only the group's first rank
    adds it (the others contribute zeros to the sum)."""

    def __init__(self, dim: int, inter: int, alpha: float, limit: float, fused: bool,
                 par: ParallelContext | None = None, shard: bool = False):
        super().__init__()
        par = par or ParallelContext()
        self.alpha, self.limit, self.fused = alpha, limit, fused
        split = shard and par.tp_size > 1 and not fused
        cut = par.split(inter, "the MLP intermediate size") if split else None
        col, row = (("col", cut), ("row", cut)) if split else ((None, None), (None, None))
        self.silent = shard and par.tp_size > 1 and fused and par.tp_rank != 0
        if fused:
            self.gate_up_proj = par.linear(dim, 2 * inter, "gate_up_proj")
        else:
            self.gate_proj = par.linear(dim, inter, "gate_proj", *col)
            self.up_proj = par.linear(dim, inter, "up_proj", *col)
        self.down_proj = par.linear(inter, dim, "down_proj", *row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silent:
            return torch.zeros_like(x)
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(swiglu_oai(gate, up, self.alpha, self.limit))


class OAIFusedExperts(FusedExperts):
    """Routed experts ``[e0, e1)`` stacked as ``FusedExperts`` stores them, with SwiGLU-OAI."""

    def __init__(self, args: ModelArgs, e0: int, e1: int):
        super().__init__(args, e0, e1)
        self.alpha = args.swiglu_alpha

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e - self.e0]).chunk(2, dim=-1)
        return F.linear(swiglu_oai(gate, up, self.alpha, self.limit), self.down_proj[e - self.e0])


class OAIMoE(MoE):
    """MiniMax-M3's MoE: ``MoE``'s routing and combine (sigmoid scores, a selection-only bias,
    top-k renormalised, times ``routed_scaling_factor``; one all-reduce) over SwiGLU-OAI experts
    and one SwiGLU-OAI shared expert of ``shared_intermediate_size``."""

    def __init__(self, args: ModelArgs, par: ParallelContext | None = None):
        nn.Module.__init__(self)  # MoE's own constructor builds SiLU experts
        self.par = par = par or ParallelContext()
        self.gate = Gate(args)
        self.n_experts = args.n_routed_experts
        self.e0, self.e1 = par.split(args.n_routed_experts, "n_routed_experts")
        alpha, limit, d = args.swiglu_alpha, args.swiglu_limit, args.hidden_size
        if args.fused_experts:
            self.experts = OAIFusedExperts(args, self.e0, self.e1)
        elif par.tp_size == 1:
            self.experts = nn.ModuleList(OAIMLP(d, args.moe_intermediate_size, alpha, limit, False, par)
                                         for _ in range(args.n_routed_experts))
        else:
            self.experts = nn.ModuleDict({str(e): OAIMLP(d, args.moe_intermediate_size, alpha, limit, False, par)
                                          for e in range(self.e0, self.e1)})
        shared = args.shared_intermediate_size
        self.shared_experts = OAIMLP(d, shared, alpha, limit, args.fused_experts, par, shard=True) if shared else None
