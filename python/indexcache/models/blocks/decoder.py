"""A DSA decoder layer (norm, MLA, norm, MLP or MoE), the MTP layer and the placeholder for a
layer another pipeline stage runs."""

from __future__ import annotations

import torch
from torch import nn

from indexcache.parallel import ParallelContext, make_lm_head

from ..args import ModelArgs
from ..state import ForwardContext
from .mla import MLA
from .moe import MLP, MoE
from .norms import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool,
                 par: ParallelContext | None = None):
        super().__init__()
        self.par = par = par or ParallelContext()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = MLA(args, layer_id, build_indexer, indexer_fp8, par)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MoE(args, par) if args.is_moe_layer(layer_id) else \
            MLP(args.hidden_size, args.intermediate_size, par, shard=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        with ctx.stage(self.layer_id, "moe" if isinstance(self.mlp, MoE) else "mlp"):
            if isinstance(self.mlp, MoE):  # the MoE reduces its routed and shared parts itself
                y = self.mlp(self.post_attention_layernorm(x), ctx.sync_free)
            else:
                y = self.par.all_reduce(self.mlp(self.post_attention_layernorm(x)), "mlp_all_reduce")
            return x + y


class SharedHead(nn.Module):
    def __init__(self, args: ModelArgs, par: ParallelContext | None = None):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = make_lm_head(args.hidden_size, args.vocab_size, par or ParallelContext())


class MTPLayer(DecoderLayer):
    """Next-n prediction: ``eh_proj([enorm(embed(token_{i+1})), hnorm(h_i)])`` through a full
    decoder layer; its own head predicts token i+2. Always builds an indexer (F)."""

    def __init__(self, args: ModelArgs, layer_id: int, indexer_fp8: bool, par: ParallelContext | None = None):
        super().__init__(args, layer_id, True, indexer_fp8, par)
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)  # bf16 in the official checkpoint
        self.shared_head = SharedHead(args, self.par)

    def forward_mtp(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev_hidden.to(embeds.dtype))), dim=-1))
        return super().forward(h, ctx)


class AbsentLayer(nn.Module):
    """A layer another pipeline stage runs: no parameters, no caches (``self_attn`` is None)."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id, self.self_attn = layer_id, None

    def forward(self, x, ctx):
        raise RuntimeError(f"layer {self.layer_id} lives on another pipeline stage")
