"""The layers of a DSA model: RoPE, norms, the lightning ``Indexer``, absorbed sparse MLA, dense
MLP, the group-limited sigmoid MoE, the decoder layer and the MTP layer. Every kernel call goes
through ``indexcache.ops``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import ops, reference
from indexcache.parallel import ParallelContext, dense_weight, make_lm_head

from indexcache.formats import INDEX_K_NORM_EPS

from .args import (ATTN_CHUNK_ELEMS, INDEX_HEAD_DIM, INDEX_K_EPS, INDEX_Q_EPS, INDEXER_CHUNK_ELEMS, LATENT_NORM_EPS,
                   MLA_LATENT, MLA_ROPE, ModelArgs)
from .runtime import ForwardContext, _row_chunks


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [N, ..., 2m]`` by per-row angles (cos/sin fp32 ``[N, m]``).

    interleaved: pairs (x[2i], x[2i+1]) (MLA, DeepSeek reference layout); otherwise NeoX
    split-half pairs (x[i], x[i+m]) (the V3.2 indexer).
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """YaRN-corrected inverse frequencies (DeepSeek reference) and the cos/sin attention factor."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    ys = args.rope_scaling
    if ys is None:
        return inv, 1.0
    factor, orig = ys["factor"], ys["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(ys["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(ys["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    inv = inv / factor * ramp + inv * (1 - ramp)
    attn_factor = 1.0
    if ys["mscale"] and ys["mscale_all_dim"]:
        attn_factor = yarn_get_mscale(factor, ys["mscale"]) / yarn_get_mscale(factor, ys["mscale_all_dim"])
    return inv, attn_factor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class Indexer(nn.Module):
    """The DSA lightning indexer: scores every visible key, writes the top-k rows (§4).

    fp8 scoring (the engines' way, DESIGN §4) needs index_head_dim 128, one scale group per key;
    other widths score in fp32 through the same top-k op (``docs/model.md``: widths).
    """

    def __init__(self, args: ModelArgs, layer_id: int, fp8: bool, par: ParallelContext | None = None):
        super().__init__()
        par = par or ParallelContext()
        self.layer_id, self.fp8, self.hadamard = layer_id, fp8 and args.native_indexer, args.indexer_hadamard
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
        self.topk, self.rope_interleave = args.index_topk, args.indexer_rope_interleave
        # replicated on every tensor-parallel rank (DESIGN §11): identical inputs, identical top-k rows
        self.wq_b = par.linear(args.q_lora_rank, self.n_heads * self.head_dim, "wq_b")
        self.wk = par.linear(args.hidden_size, self.head_dim, "wk")
        self.k_norm = LayerNorm(self.head_dim, eps=INDEX_K_NORM_EPS)
        self.weights_proj = _linear(args.hidden_size, self.n_heads)  # kept in fp32

    def _rope(self, t, ctx):
        r = self.rope_dim
        return torch.cat((apply_rope(t[..., :r], ctx.cos, ctx.sin, self.rope_interleave), t[..., r:]), dim=-1)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Fill rows ``[:N]`` of the shared buffer with request-relative positions; returns them."""
        n, meta = x.shape[0], ctx.meta
        with ctx.stage(self.layer_id, "indexer"):
            q = self._rope(self.wq_b(qr).view(n, self.n_heads, self.head_dim), ctx)
            k = self._rope(self.k_norm(self.wk(x)), ctx)
            w = self.weights_proj(x.float())
            if self.fp8:
                # DeepSeek's act_quant floors every amax at 1e-4; vLLM's q quantization at 1e-10
                q_in, q_scale = ops.quantize_fp8(q, INDEX_K_EPS if self.hadamard else INDEX_Q_EPS, self.hadamard)
                weights = ops.indexer_weights(w, q_scale.squeeze(-1))
            else:
                q_in, weights = q.float(), _indexer_weights_fp32(w, self.head_dim)
            if meta.paged:
                cache = ctx.cache.index_k[self.layer_id]
                if self.fp8:
                    ops.index_k_cache_insert(k, meta.slot_mapping, cache, self.hadamard)
                else:
                    cache.view(-1, self.head_dim)[meta.slot_mapping] = k.float()
                k_in = k_scale = None
            elif self.fp8:
                k_in, k_scale = ops.quantize_fp8(k, INDEX_K_EPS, self.hadamard)
                k_scale = k_scale.view(-1)
            else:
                k_in, k_scale = k.float(), None
        with ctx.stage(self.layer_id, "topk"):
            rows = ctx.topk_rows
            ops.fill_topk_buffer_(ctx.topk_buffer, n)
            if not meta.paged:
                self._topk_dense(q_in, k_in, k_scale, weights, rows, meta)
            elif self.fp8:
                self._topk_paged_fp8(q_in, weights, ctx.cache.index_k[self.layer_id], rows, meta, ctx)
            else:
                self._topk_paged_fp32(q_in, weights, ctx.cache.index_k[self.layer_id], rows, meta, ctx)
        ctx.topk_valid = True
        return rows

    def _score_topk(self, q, k, k_scale, weights, ks, ke, out):
        if k.shape[-1] == INDEX_HEAD_DIM:
            ops.indexer_topk(q, k, k_scale, weights, ks, ke, self.topk, out=out)
        else:  # widths the native kernels do not take: scores by their definition, then the top-k op
            logits = reference.indexer_logits(q, k, k_scale, weights, ks, ke)
            ops.topk_indices(logits, ks, ke, self.topk, out=out)

    def _topk_dense(self, q, k, k_scale, weights, rows, meta):
        # Each request's keys are its own tokens; prefill row t sees keys [0, t].
        seq = meta.block_size
        for off in range(0, meta.num_tokens, seq):
            for r0, r1 in _row_chunks(seq, seq * self.n_heads, INDEXER_CHUNK_ELEMS):
                ks = torch.zeros(r1 - r0, dtype=torch.int32, device=q.device)
                ke = torch.arange(r0 + 1, r1 + 1, dtype=torch.int32, device=q.device)
                keys = slice(off, off + r1)
                self._score_topk(q[off + r0:off + r1], k[keys], None if k_scale is None else k_scale[keys],
                                 weights[off + r0:off + r1], ks, ke, rows[off + r0:off + r1])

    def _topk_paged_fp8(self, q, weights, cache, rows, meta, ctx):
        nq = meta.uniform_q
        if nq is not None and nq <= 8:  # decode / MTP verify: one batched call
            ops.indexer_topk_paged(q, weights, cache, meta.block_table, meta.seq_lens, nq, self.topk, out=rows)
            return
        self._need_host_lengths(ctx)
        for b, off in enumerate(meta.row_offsets()):
            c, qn = meta.ctx_lens[b], meta.q_lens[b]
            for r0, r1 in _row_chunks(qn, (c + qn) * self.n_heads, INDEXER_CHUNK_ELEMS):
                # rows r0..r1 of this chunk are "decode rows" of a request holding c + r1 tokens
                lens = torch.tensor([c + r1], dtype=torch.int32, device=q.device)
                ops.indexer_topk_paged(q[off + r0:off + r1], weights[off + r0:off + r1], cache,
                                       meta.block_table[b:b + 1], lens, r1 - r0, self.topk, out=rows[off + r0:off + r1])

    def _need_host_lengths(self, ctx):
        if ctx.sync_free:
            raise ValueError(f"layer {self.layer_id}: a sync-free forward (CUDA graph) needs the fp8 indexer and "
                             "at most 8 rows per request, all requests alike (this path reads lengths on the host)")

    def _topk_paged_fp32(self, q, weights, cache, rows, meta, ctx):
        self._need_host_lengths(ctx)
        for b, off in enumerate(meta.row_offsets()):
            c, qn = meta.ctx_lens[b], meta.q_lens[b]
            pos = torch.arange(c + qn, device=q.device, dtype=torch.int32).view(1, -1)
            req = torch.zeros(1, dtype=torch.int32, device=q.device)
            slots = ops.positions_to_slots(pos, req, meta.block_table[b:b + 1], meta.block_size).view(-1).long()
            keys = cache.view(-1, self.head_dim)[slots]
            for r0, r1 in _row_chunks(qn, (c + qn) * self.n_heads, INDEXER_CHUNK_ELEMS):
                ks = torch.zeros(r1 - r0, dtype=torch.int32, device=q.device)
                ke = torch.arange(c + r0 + 1, c + r1 + 1, dtype=torch.int32, device=q.device)
                self._score_topk(q[off + r0:off + r1], keys[:c + r1], None, weights[off + r0:off + r1], ks, ke,
                                 rows[off + r0:off + r1])


def _indexer_weights_fp32(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The head weights with the softmax constants h^-1/2 d^-1/2 folded in, for any head width d."""
    return ops.indexer_weights(w) * (INDEX_HEAD_DIM / head_dim) ** 0.5


class SparseAttention(nn.Module):
    """Absorbed sparse MLA over the positions in the top-k rows (no parameters; a hook point:
    its forward receives exactly the position rows this layer attends over)."""

    def __init__(self, layer_id: int, softmax_scale: float, kv_lora_rank: int = MLA_LATENT):
        super().__init__()
        self.layer_id, self.softmax_scale, self.kv_lora_rank = layer_id, softmax_scale, kv_lora_rank

    def forward(self, q: torch.Tensor, topk_positions: torch.Tensor, kv_cache: torch.Tensor,
                req_of_row: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        slots = ops.positions_to_slots(topk_positions, req_of_row, block_table, block_size)
        n, h = q.shape[0], q.shape[1]
        # widths other than 512 + 64: the op's definition (gather, softmax, weighted sum in fp32)
        attend = ops.sparse_mla if q.shape[-1] == MLA_LATENT + MLA_ROPE else reference.sparse_mla
        out = q.new_empty(n, h, self.kv_lora_rank)
        for r0, r1 in _row_chunks(n, slots.shape[1] * (q.shape[-1] + h), ATTN_CHUNK_ELEMS):
            out[r0:r1] = attend(q[r0:r1], kv_cache, slots[r0:r1], self.softmax_scale, self.kv_lora_rank)[0]
        return out


class MLA(nn.Module):
    """Multi-head latent attention with q/kv LoRA; attention runs absorbed over the latent cache."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool,
                 par: ParallelContext | None = None):
        super().__init__()
        self.par = par = par or ParallelContext()
        self.layer_id = layer_id
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        # tensor parallel: this rank's heads [h0, h1); n_heads is the local count
        h0, h1 = par.split(args.num_attention_heads, "num_attention_heads")
        self.n_heads = h1 - h0
        self.latent = args.kv_lora_rank
        qk, kvb = args.qk_head_dim, self.nope + self.v_dim
        # The latent norms use DeepSeek's reference epsilon (1e-6, as transformers does for both
        # families), not rms_norm_eps: see docs/model.md.
        self.q_a_proj = par.linear(args.hidden_size, args.q_lora_rank, "q_a_proj")
        self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = par.linear(args.q_lora_rank, args.num_attention_heads * qk, "q_b_proj", "col", (h0 * qk, h1 * qk))
        self.kv_a_proj_with_mqa = par.linear(args.hidden_size, self.latent + self.rope, "kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = par.linear(self.latent, args.num_attention_heads * kvb, "kv_b_proj", "col", (h0 * kvb, h1 * kvb))
        self.o_proj = par.linear(args.num_attention_heads * self.v_dim, args.hidden_size, "o_proj", "row",
                                 (h0 * self.v_dim, h1 * self.v_dim))
        self.indexer = Indexer(args, layer_id, indexer_fp8, par) if build_indexer else None
        self.skip_topk = not build_indexer  # MTP layers flip this at runtime (set_skip_topk)
        ys = args.rope_scaling or {}
        scale = ops.mla_softmax_scale(self.nope, self.rope, ys.get("mscale_all_dim", 0.0), ys.get("factor", 1.0))
        self.sparse_attn = SparseAttention(layer_id, scale, self.latent)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h, meta = x.shape[0], self.n_heads, ctx.meta
        with ctx.stage(self.layer_id, "mla_proj"):
            qr = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(qr).view(n, h, self.nope + self.rope)
            q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
            q_pe = apply_rope(q_pe, ctx.cos, ctx.sin, interleaved=True)
            kv = self.kv_a_proj_with_mqa(x)
            kv_c = self.kv_a_layernorm(kv[:, :self.latent])
            k_pe = apply_rope(kv[:, self.latent:], ctx.cos, ctx.sin, interleaved=True)
            w_kv = dense_weight(self.kv_b_proj, q_nope.dtype).view(h, self.nope + self.v_dim, self.latent)
            q_abs = torch.cat((torch.einsum("thd,hdc->thc", q_nope, w_kv[:, :self.nope]), q_pe), dim=-1)
            if meta.paged:
                kv_cache = ctx.cache.kv[self.layer_id]
                if kv_cache.shape[-1] == MLA_LATENT + MLA_ROPE or kv_cache.dtype == torch.uint8:
                    ops.mla_kv_cache_insert(kv_c, k_pe, meta.slot_mapping, kv_cache)
                else:  # other widths: a plain scatter (slot_mapping has no -1 for tokens being computed)
                    kv_cache.view(-1, kv_cache.shape[-1])[meta.slot_mapping] = torch.cat((kv_c, k_pe), -1).to(kv_cache.dtype)
            else:  # no cache: the batch's own keys, B blocks of T tokens
                kv_cache = torch.cat((kv_c, k_pe), dim=-1).view(-1, meta.block_size, self.latent + self.rope)
        if self.indexer is not None and not self.skip_topk:
            self.indexer(x, qr, ctx)
        elif not ctx.topk_valid:
            raise RuntimeError(f"layer {self.layer_id} reuses top-k indices but no F layer wrote them in this forward")
        with ctx.stage(self.layer_id, "attention"):
            out = self.sparse_attn(q_abs, ctx.topk_rows, kv_cache, meta.req_of_row, meta.block_table, meta.block_size)
            o = torch.einsum("thc,hdc->thd", out, w_kv[:, self.nope:])
            return self.par.all_reduce(self.o_proj(o.reshape(n, h * self.v_dim)), "attn_all_reduce")


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
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Sigmoid router with a selection-only bias and group-limited top-k (noaux_tc)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))  # kept in fp32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
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
        if par.tp_size == 1:
            self.experts = nn.ModuleList(MLP(args.hidden_size, args.moe_intermediate_size, par)
                                         for _ in range(args.n_routed_experts))
        else:
            self.experts = nn.ModuleDict({str(e): MLP(args.hidden_size, args.moe_intermediate_size, par)
                                          for e in range(self.e0, self.e1)})
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, par, shard=True)
                               if args.n_shared_experts else None)

    def expert(self, e: int) -> nn.Module:
        return self.experts[e] if isinstance(self.experts, nn.ModuleList) else self.experts[str(e)]

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        idx, weights = self.gate(x)
        y = self._masked(x, idx, weights) if sync_free else self._routed(x, idx, weights)
        if self.shared_experts is not None:
            y += self.shared_experts(x).float()
        return self.par.all_reduce(y.to(x.dtype), "moe_all_reduce")

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
                y.index_add_(0, tok, self.expert(e)(x[tok]).float() * w[sel].unsqueeze(-1))
            start += c
        return y


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
        self.eh_proj = _linear(2 * args.hidden_size, args.hidden_size)  # bf16 in the official checkpoint
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
