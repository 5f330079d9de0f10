"""The feed-forward blocks: the SwiGLU MLP (dense layers, shared and routed experts), the
sigmoid router with group-limited top-k (noaux_tc) and the MoE that combines them."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import ops
from indexcache.parallel import ParallelContext
from indexcache.parallel.linear import Linear, ShardedLinear, few_rows, linear

from ..args import ModelArgs


class MLP(nn.Module):
    """SwiGLU. ``shard``: split column/row over the tensor-parallel ranks (dense MLP, shared
    experts); the caller sums the partial outputs (``DecoderLayer``, ``MoE``). Routed experts are
    whole on the rank that owns them."""

    def __init__(self, dim: int, inter: int, par: ParallelContext | None = None, shard: bool = False):
        super().__init__()
        par = par or ParallelContext()
        if shard and par.tp_size > 1:
            cut = par.split(inter, "the MLP intermediate size")
            col, row = ("col", cut), ("row", cut)
        else:
            col = row = (None, None)
        self.gate_proj = par.linear(dim, inter, "gate_proj", *col)
        self.up_proj = par.linear(dim, inter, "up_proj", *col)
        self.down_proj = par.linear(inter, dim, "down_proj", *row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = swiglu_sum(x, [self], [1.0])
        if fused is not None:
            return fused.to(x.dtype)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def swiglu_weights(self) -> tuple | None:
        """(gate, up, down) weights for ``ops.swiglu_rows``, or None where a projection is not a
        plain weight (FP8 blocks)."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(type(p) is Linear or (isinstance(p, ShardedLinear) and not p.fp8) for p in projs):
            return None
        return tuple(p.weight for p in projs)


def swiglu_sum(x: torch.Tensor, mlps: list, coef: list) -> torch.Tensor | None:
    """``Σ_e coef[e] · mlps[e](x)`` in fp32 by one ``ops.swiglu_rows`` call (a decode row on the CPU:
    the same roundings as each MLP's own ops, without their 3 x E dispatches), or None where that op
    does not apply (more rows, a gradient to record, FP8 or clamped experts, a CPU path without its
    vectorised projections)."""
    if x.dim() != 2:
        return None
    weights = [m.swiglu_weights() for m in mlps]
    if any(w is None for w in weights) or not few_rows(x, *(t for w in weights for t in w)):
        return None
    if not all(t.is_contiguous() for w in weights for t in w):
        return None
    return ops.swiglu_rows(x, weights, coef)


class FusedExperts(nn.Module):
    """This rank's routed experts ``[e0, e1)`` stored fused (HY-V4's tensors): ``gate_up_proj
    [E, 2 I, D]`` (gate rows first) and ``down_proj [E, D, I]``, with the SwiGLU clamp of
    ``swiglu_limit`` (gate at most ``limit``, up within ``±limit``; <= 0: no clamp)."""

    def __init__(self, args: ModelArgs, e0: int, e1: int):
        super().__init__()
        self.e0, self.e1, self.n_experts, self.limit = e0, e1, args.n_routed_experts, args.swiglu_limit
        d, i = args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e1 - e0, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e1 - e0, d, i))

    def param_slice(self, attr: str):
        """The loader's hook: this rank's experts of the checkpoint's ``[E, ...]`` tensors."""
        return (0, (self.e0, self.e1)) if self.e1 - self.e0 != self.n_experts else (None, None)

    def param_full_shape(self, attr: str) -> tuple:
        return (self.n_experts,) + tuple(getattr(self, attr).shape[1:])

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e - self.e0]).chunk(2, dim=-1)
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return F.linear(F.silu(gate) * up, self.down_proj[e - self.e0])


class Gate(nn.Module):
    """Sigmoid router with a selection-only bias and group-limited top-k (noaux_tc)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))  # kept in fp32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = linear(x, self.weight, out_dtype=torch.float32).sigmoid()
        bias = self.e_score_correction_bias
        choice = scores + (bias if bias.dtype == torch.float32 else bias.float())
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask.unsqueeze(-1), -math.inf).flatten(1)
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.scale


class MoE(nn.Module):
    """Group-limited sigmoid MoE. Expert parallel: the gate is replicated, this rank holds the
    routed experts ``[e0, e1)`` (an ``nn.ModuleDict`` keyed by the global id, so parameter names stay
    the checkpoint's) and its shard of the shared experts; one all-reduce sums all of it."""

    def __init__(self, args: ModelArgs, par: ParallelContext | None = None):
        super().__init__()
        self.par = par = par or ParallelContext()
        self.gate = Gate(args)
        self.n_experts = args.n_routed_experts
        self.e0, self.e1 = par.split(args.n_routed_experts, "n_routed_experts")
        if args.fused_experts:
            self.experts = FusedExperts(args, self.e0, self.e1)
        elif par.tp_size == 1:
            self.experts = nn.ModuleList(MLP(args.hidden_size, args.moe_intermediate_size, par)
                                         for _ in range(args.n_routed_experts))
        else:
            self.experts = nn.ModuleDict({str(e): MLP(args.hidden_size, args.moe_intermediate_size, par)
                                          for e in range(self.e0, self.e1)})
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, par, shard=True)
                               if args.n_shared_experts else None)

    def expert(self, e: int):
        """Routed expert ``e`` (global id) as a callable ``[n, D] -> [n, D]``."""
        if isinstance(self.experts, FusedExperts):
            return functools.partial(self.experts.run, e)
        return self.experts[e] if isinstance(self.experts, nn.ModuleList) else self.experts[str(e)]

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        idx, weights = self.gate(x)
        if sync_free:
            y = self._rows_fused(x, idx, weights)
        else:
            y = None if x.shape[0] != 1 else self._one_row_fused(x, idx, weights)
        if y is None:
            y = self._masked(x, idx, weights) if sync_free else self._routed(x, idx, weights)
            if self.shared_experts is not None:
                y += self.shared_experts(x)  # added in fp32 (y's dtype), as .float() first
        return self.par.all_reduce(y.to(x.dtype), "moe_all_reduce")

    def _one_row_fused(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """``_one_row`` plus the shared expert as one ``ops.swiglu_rows`` call (the same experts, order,
        roundings and fp32 sums), or None where that op does not apply."""
        w = weights[0].tolist()
        chosen = sorted((e, j) for j, e in enumerate(idx[0].tolist()) if self.e0 <= e < self.e1)
        mlps, coef = [self.expert(e) for e, _ in chosen], [w[j] for _, j in chosen]
        if self.shared_experts is not None:
            mlps.append(self.shared_experts)
            coef.append(1.0)
        if not all(isinstance(m, MLP) for m in mlps):
            return None
        return swiglu_sum(x, mlps, coef)

    def _rows_fused(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """Decode rows on the CPU with no host reads (a static or compiled step): ``ops.moe_rows``, the
        routing read inside the op, the experts, order and sums of ``_one_row_fused``; None where
        that op does not apply (then ``_masked``)."""
        if x.dim() != 2 or not x.is_cpu:
            return None
        routed = [self.expert(e) for e in range(self.e0, self.e1)]
        shared = [] if self.shared_experts is None else [self.shared_experts]
        if not all(isinstance(m, MLP) for m in routed + shared):
            return None
        ws = [m.swiglu_weights() for m in routed + shared]
        if any(w is None for w in ws) or not all(t.is_contiguous() for w in ws for t in w):
            return None
        if not few_rows(x, *(t for w in ws for t in w)):
            return None
        return ops.moe_rows(x, ws[:len(routed)], idx, weights, self.e0, self.n_experts, ws[len(routed):])

    def _masked(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """No host reads (CUDA graphs): every local expert runs on every row and keeps the rows routed
        to it. The same sums in the same expert order as ``_routed``; costs n_experts / top_k times
        the routed FLOPs, which a decode batch with B * top_k >= n_experts pays in weight reads anyway."""
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.e0, self.e1):
            hit = idx == e
            w = (weights * hit).sum(dim=-1, keepdim=True)
            y += torch.where(hit.any(dim=-1, keepdim=True), self.expert(e)(x).float() * w, 0.0)
        return y

    def _routed(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_row(x, idx, weights)
        k = idx.shape[1]
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        w = weights.flatten()
        start = 0
        for e, c in enumerate(counts):
            if c and self.e0 <= e < self.e1:
                sel = order[start:start + c]
                tok = sel // k
                # fp32 products (a bf16 router's weights widened too, as a .float() of the output did)
                y.index_add_(0, tok, self.expert(e)(x[tok]) * w[sel].float().unsqueeze(-1))
            start += c
        return y

    def _one_row(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``_routed`` for one row (a decode step of one request): its experts in ascending id
        order, each output times its weight added in fp32, the same sums in the same order without
        the sort, the counts and the gathers."""
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        w = weights if weights.dtype == torch.float32 else weights.float()  # fp32 products, as .float() first
        for e, j in sorted((e, j) for j, e in enumerate(idx[0].tolist())):
            if self.e0 <= e < self.e1:
                y += self.expert(e)(x) * w[:, j:j + 1]
        return y


# ============================================================================ DeepSeek-V4 routing

class ClampedMLP(MLP):
    """SwiGLU with DeepSeek-V4's clamp (gate at most ``limit``, up within ``±limit``): its shared expert."""

    def __init__(self, dim: int, inter: int, limit: float, par: ParallelContext | None = None, shard: bool = False):
        super().__init__(dim, inter, par, shard)
        self.limit = limit

    def swiglu_weights(self) -> tuple | None:
        return None if self.limit > 0 else super().swiglu_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(gate) * up)


class V4Gate(nn.Module):
    """DeepSeek-V4's router: scores ``sqrt(softplus(x · W))`` (``moe_scoring``), the top-k of scores
    plus the selection-only bias, or on a hash layer the fixed experts ``tid2eid[token id]`` (int64
    ``[vocab, top_k]``, loaded from the checkpoint); weights are the chosen scores renormalised, times
    ``routed_scaling_factor``."""

    def __init__(self, args: ModelArgs, hashed: bool):
        super().__init__()
        self.top_k, self.scale, self.scoring, self.hashed = (args.num_experts_per_tok, args.routed_scaling_factor,
                                                             args.moe_scoring, hashed)
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(args.vocab_size, self.top_k, dtype=torch.int64), requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))  # kept in fp32

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.weight.float())
        if self.scoring == "sqrtsoftplus":
            return F.softplus(logits).sqrt()
        if self.scoring == "sigmoid":
            return logits.sigmoid()
        return logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(x)
        if self.hashed:
            if input_ids is None:
                raise ValueError("a hash-routed MoE layer needs the token ids of its rows")
            idx = self.tid2eid[input_ids.long()]
        else:
            idx = (scores + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        return idx, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


class V4MoE(MoE):
    """DeepSeek-V4's MoE: clamped experts, one clamped shared expert of ``moe_intermediate_size``,
    routed by ``V4Gate`` (hash routing on the first ``hash_moe_layers`` layers)."""

    def __init__(self, args: ModelArgs, layer_id: int, par: ParallelContext | None = None):
        super().__init__(args, par)
        self.gate = V4Gate(args, layer_id < args.hash_moe_layers)
        # stored expert by expert (``ffn.experts.E.w1/w3/w2``), clamped like the shared one; under
        # tensor parallelism this rank's experts [e0, e1) keyed by their global id, the shared one split
        d, i, lim, par = args.hidden_size, args.moe_intermediate_size, args.swiglu_limit, self.par
        if par.tp_size == 1:
            self.experts = nn.ModuleList(ClampedMLP(d, i, lim, par) for _ in range(args.n_routed_experts))
        else:
            self.experts = nn.ModuleDict({str(e): ClampedMLP(d, i, lim, par) for e in range(self.e0, self.e1)})
        self.shared_experts = ClampedMLP(d, i, lim, par, shard=True)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None, sync_free: bool = False) -> torch.Tensor:
        idx, weights = self.gate(x, input_ids)
        y = self._masked(x, idx, weights) if sync_free else self._routed(x, idx, weights)
        y += self.shared_experts(x).float()
        return self.par.all_reduce(y.to(x.dtype), "moe_all_reduce")
