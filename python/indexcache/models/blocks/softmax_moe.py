"""Qwen3.8-Flash-Next's MoE (transformers' ``Qwen4ExpTextSparseMoeBlock``): a softmax router,
SwiGLU routed experts (``MoE``'s dispatch) and one shared expert gated by a sigmoid; the widths
come from ``ModelArgs`` (``n_routed_experts``, ``moe_intermediate_size``,
``shared_expert_intermediate_size``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from indexcache.parallel import ParallelContext

from ..args import ModelArgs
from .moe import MLP, MoE


class SoftmaxRouter(nn.Module):
    """Softmax over the experts in fp32, the top ``k`` kept (renormalised when ``norm``)."""

    def __init__(self, n_experts: int, hidden: int, k: int, norm: bool):
        super().__init__()
        self.k, self.norm = k, norm
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        top, idx = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.k, dim=-1)
        if self.norm:
            top = top / top.sum(dim=-1, keepdim=True)
        return idx, top.to(logits.dtype)


class SoftmaxMoE(MoE):
    """Routed SwiGLU experts (``MoE``'s dispatch) plus one shared expert gated by ``sigmoid(shared_expert_gate)``."""

    def __init__(self, args: ModelArgs, par: ParallelContext | None = None):
        nn.Module.__init__(self)  # MoE's constructor builds the sigmoid router
        self.par = par or ParallelContext()
        d = args.hidden_size
        self.gate = SoftmaxRouter(args.n_routed_experts, d, args.num_experts_per_tok, args.norm_topk_prob)
        # tensor parallel: this rank's experts [e0, e1) keyed by global id, the shared expert split
        # column/row, router and shared gate replicated; one all-reduce sums routed and shared parts
        self.n_experts, (self.e0, self.e1) = args.n_routed_experts, self.par.split(args.n_routed_experts,
                                                                                   "n_routed_experts")
        inter = args.moe_intermediate_size
        if self.par.tp_size == 1:
            self.experts = nn.ModuleList(MLP(d, inter) for _ in range(args.n_routed_experts))
        else:
            self.experts = nn.ModuleDict({str(e): MLP(d, inter, self.par) for e in range(self.e0, self.e1)})
        self.shared_experts = None
        self.shared_expert = MLP(d, args.shared_intermediate_size, self.par, shard=True)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        idx, weights = self.gate(x)
        y = self._masked(x, idx, weights) if sync_free else self._routed(x, idx, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.par.all_reduce((y.to(x.dtype) + shared).to(x.dtype), "moe_all_reduce")
