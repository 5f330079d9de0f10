"""Independent hyper-connections (HY-V4): the residual stream is ``hc_mult`` streams ``[N, hc, D]``.

Around attention and around the MLP a ``HyperConnection`` reads the streams: from the unweighted
RMS-normed concatenation of all of them it computes ``pre`` (how much of each stream enters the
block: the block's input is ``Σ_i pre_i · stream_i``) and ``post`` (how much of the block's output
each stream receives: ``stream_i += post_i · out``). ``HyperHead`` collapses the streams before
the final norm. Everything is computed in fp32 whatever the model dtype, as transformers'
``HYV4HyperConnection`` / ``HYV4HyperHead`` do; parameters are fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from indexcache.parallel import ParallelContext

from ..args import ModelArgs
from ..state import ForwardContext
from .decoder import DecoderLayer
from .moe import MoE


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 streams ``[N, hc, D]``, ``flat @ fn^T * rsqrt(mean(flat^2) + eps)`` ``[N, fn rows]``)."""
    s = streams.float()
    flat = s.flatten(1)
    return s, F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """``fn [2 hc, hc D]``, ``base [2 hc]``, ``scale [2]`` (pre, post)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hc, self.eps, self.norm_eps, self.magnitude = args.hc_mult, args.hc_eps, args.rms_norm_eps, args.hc_magnitude
        self.fn = nn.Parameter(torch.empty(2 * self.hc, self.hc * args.hidden_size))
        self.base = nn.Parameter(torch.empty(2 * self.hc))
        self.scale = nn.Parameter(torch.empty(2))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Streams ``[N, hc, D]`` -> (post fp32 ``[N, hc]``, the block's input ``[N, D]`` in the streams' dtype)."""
        s, mixes = _mixes(streams, self.fn, self.norm_eps)
        pre_logits, post_logits = mixes.split(self.hc, dim=-1)
        pre_b, post_b = self.base.float().split(self.hc)
        scale = self.scale.float()
        pre = torch.sigmoid(pre_logits * scale[0] + pre_b) + self.eps
        post = self.magnitude * torch.sigmoid(post_logits * scale[1] + post_b) + self.eps
        return post, (pre.unsqueeze(-1) * s).sum(dim=1).to(streams.dtype)


def add_to_streams(streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``stream_i + post_i · out`` in fp32, back in the streams' dtype."""
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + streams.float()).to(streams.dtype)


class HyperHead(nn.Module):
    """The final collapse: ``hc_fn [hc, hc D]``, ``hc_base [hc]``, ``hc_scale [1]``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hc, self.eps, self.norm_eps = args.hc_mult, args.hc_eps, args.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(self.hc, self.hc * args.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(self.hc))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        s, mixes = _mixes(streams, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * s).sum(dim=1).to(streams.dtype)


class HyperDecoderLayer(DecoderLayer):
    """A DSA decoder layer over ``hc_mult`` residual streams: ``attn_hc`` around attention,
    ``ffn_hc`` around the MLP / MoE (transformers' ``HYV4DecoderLayer``)."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool,
                 par: ParallelContext | None = None):
        super().__init__(args, layer_id, build_indexer, indexer_fp8, par)
        self.attn_hc = HyperConnection(args)
        self.ffn_hc = HyperConnection(args)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        post, h = self.attn_hc(x)
        x = add_to_streams(x, post, self.self_attn(self.input_layernorm(h), ctx))
        with ctx.stage(self.layer_id, "moe" if isinstance(self.mlp, MoE) else "mlp"):
            post, h = self.ffn_hc(x)
            h = self.post_attention_layernorm(h)
            if isinstance(self.mlp, MoE):
                y = self.mlp(h, ctx.sync_free)
            else:
                y = self.par.all_reduce(self.mlp(h), "mlp_all_reduce")
            return add_to_streams(x, post, y)


# ============================================================================ manifold hyper-connections (DeepSeek-V4)

def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic projection of positive ``[..., hc, hc]`` matrices, DeepSeek-V4's order: the
    columns normalised first, then ``iters - 1`` rounds of rows then columns (``+ eps`` in every sum)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class ManifoldHyperConnection(nn.Module):
    """DeepSeek-V4's mHC: ``fn [(2 + hc) hc, hc D]``, ``base [(2 + hc) hc]``, ``scale [3]`` (pre, post,
    comb). Besides ``pre`` and ``post`` (``2 · sigmoid``, no floor) it mixes the streams through a
    Sinkhorn-normalised ``comb [hc, hc]``: ``stream'_k = Σ_j comb[j, k] · stream_j + post_k · out``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hc, self.eps, self.norm_eps, self.iters = args.hc_mult, args.hc_eps, args.rms_norm_eps, args.hc_sinkhorn_iters
        width = (2 + self.hc) * self.hc
        self.fn = nn.Parameter(torch.empty(width, self.hc * args.hidden_size))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streams ``[N, hc, D]`` -> (post fp32 ``[N, hc]``, comb fp32 ``[N, hc, hc]``, block input ``[N, D]``)."""
        hc = self.hc
        s, mixes = _mixes(streams, self.fn, self.norm_eps)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        scale = self.scale.float()
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        return post, comb, (pre.unsqueeze(-1) * s).sum(dim=1).to(streams.dtype)


def mix_streams(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``comb^T · streams + post · out`` in the streams' dtype (as transformers' DeepseekV4DecoderLayer)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.to(dtype).unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams
