"""Multi-head latent attention with q/kv LoRA (DESIGN.md §5), in two forms over one ``project``:

- the kernels: attention absorbed over the latent cache, sparse over the positions in the
  shared top-k rows (written by this layer's indexer when it is F in this forward, by the last
  F layer below otherwise);
- the torch definition (``ForwardContext.torch_pass`` set): the unabsorbed form over the causal
  window or over the positions the source F layer's indexer selected, differentiable.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from indexcache import differentiable, ops, reference
from indexcache.parallel import ParallelContext, dense_weight
from indexcache.parallel.linear import einsum_16bit, few_rows

from ..args import ATTN_CHUNK_ELEMS, LATENT_NORM_EPS, MLA_LATENT, MLA_ROPE, ModelArgs
from ..state import ForwardContext, LayerRecord, row_chunks
from .indexer import Indexer
from .norms import RMSNorm
from .rope import apply_rope


class SparseAttention(nn.Module):
    """Absorbed sparse MLA over the positions in the top-k rows (no parameters; a hook point:
    its forward receives exactly the position rows this layer attends over). ``sinks`` fp32
    ``[H]`` (HY-V4): a learned logit per head that joins each row's softmax denominator."""

    def __init__(self, layer_id: int, softmax_scale: float, kv_lora_rank: int = MLA_LATENT):
        super().__init__()
        self.layer_id, self.softmax_scale, self.kv_lora_rank = layer_id, softmax_scale, kv_lora_rank

    def forward(self, q: torch.Tensor, topk_positions: torch.Tensor, kv_cache: torch.Tensor,
                req_of_row: torch.Tensor, block_table: torch.Tensor, block_size: int,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        slots = ops.positions_to_slots(topk_positions, req_of_row, block_table, block_size)
        n, h = q.shape[0], q.shape[1]
        # the kernel's widths: 512 + 64 (DSA), or a 512-wide K = V latent without RoPE (GLM-5.3-Flash's
        # NoPE MLA, V4's head form: rows of its latent cache [blocks, block, 512] as slots); others:
        # the op's definition (gather, softmax, weighted sum in fp32)
        nope_512 = q.shape[-1] == kv_cache.shape[-1] == self.kv_lora_rank == MLA_LATENT and kv_cache.dim() == 3
        attend = ops.sparse_mla if q.shape[-1] == MLA_LATENT + MLA_ROPE or nope_512 else reference.sparse_mla
        if nope_512:
            q, kv_cache = q.contiguous(), kv_cache.view(-1, 1, 1, MLA_LATENT)
        chunks = list(row_chunks(n, slots.shape[1] * (q.shape[-1] + h), ATTN_CHUNK_ELEMS))
        if len(chunks) == 1:  # decode rows: the op's own output, no copy into a second buffer
            return attend(q, kv_cache, slots, self.softmax_scale, self.kv_lora_rank, sinks=sinks)[0]
        out = q.new_empty(n, h, self.kv_lora_rank)
        for r0, r1 in chunks:
            out[r0:r1] = attend(q[r0:r1], kv_cache, slots[r0:r1], self.softmax_scale, self.kv_lora_rank, sinks=sinks)[0]
        return out


def absorb_queries(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA's queries (DESIGN §5), for this model and the transformers integration: q_nope
    ``[N, H, nope]`` through W_UK ``[H, nope, latent]``, then the rotated q_pe ``[N, H, rope]`` ->
    ``[N, H, latent + rope]``, what ``ops.sparse_mla`` attends the latent cache with. Decode rows on
    the CPU: one ``ops.rows_matmul`` per head straight into the result (the einsum would copy W_UK).
    ``out`` (that shape, q_nope's dtype): written and returned; q_pe may already be its rope part
    (``MLA.forward`` rotates straight into it), then nothing is copied."""
    latent = w_uk.shape[-1]
    per_head = few_rows(q_nope.transpose(0, 1), w_uk)
    if out is None and not per_head:
        return torch.cat((einsum_16bit("thd,hdc->thc", q_nope, w_uk), q_pe), dim=-1)
    if out is None:
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], latent + q_pe.shape[-1])
    if per_head:
        ops.rows_matmul(q_nope.transpose(0, 1), w_uk, False, out=out[..., :latent].transpose(0, 1))
    else:
        out[..., :latent] = einsum_16bit("thd,hdc->thc", q_nope, w_uk)
    pe = out[..., latent:]
    # (traced for a compiled step the copy always stands: a copy onto itself is a no-op there)
    if torch.compiler.is_compiling() or not (q_pe.data_ptr() == pe.data_ptr() and q_pe.stride() == pe.stride()):
        pe.copy_(q_pe)
    return out


def absorbed_values(out: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Sparse MLA's latent output ``[N, H, latent]`` through W_UV ``[H, v, latent]``: the heads'
    values ``[N, H, v]``, times ``sigmoid(gate)`` when a gate ``[N, H * v]`` is given (HY-V4). Decode
    rows on the CPU: ``ops.rows_matmul`` per head (the einsum would copy W_UV transposed each call)."""
    if few_rows(out.transpose(0, 1), w_uv):
        o = out.new_empty(out.shape[0], out.shape[1], w_uv.shape[1])
        ops.rows_matmul(out.transpose(0, 1), w_uv, True, out=o.transpose(0, 1))
        return gate_heads(o, gate)
    return gate_heads(einsum_16bit("thc,hdc->thd", out, w_uv), gate)


def gate_heads(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The heads' outputs ``[N, H, v]`` times the sigmoid of the gate logits ``[N, H * v]`` (HY-V4), or
    as they are when there is no gate."""
    return o if gate is None else o * torch.sigmoid(gate).view(o.shape)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor,
                   selection: torch.Tensor | None, chunks: list, recompute: bool = False) -> torch.Tensor:
    """``differentiable.masked_attention`` with a learned logit per head in every row's softmax (the
    differentiable form of sparse MLA with sinks): q/k ``[B, H, T, d]``, v ``[B, H, T, v_dim]``,
    sinks fp32 ``[H]`` -> ``[B, H, T, v_dim]``, chunk by chunk over the query rows."""
    from torch.utils.checkpoint import checkpoint

    b, outs = q.shape[0], []
    for r0, r1 in chunks:
        allowed = differentiable.allowed_keys(selection, r0, r1, b, q.device)
        args = (q[:, :, r0:r1], k[:, :, :r1], v[:, :, :r1], scale, allowed, sinks)
        outs.append(checkpoint(_sink_rows, *args, use_reentrant=False) if recompute else _sink_rows(*args))
    return torch.cat(outs, dim=2)


def _sink_rows(q, k, v, scale, allowed, sinks):
    s = ((q @ k.transpose(-1, -2)).float() * scale).masked_fill(~allowed.unsqueeze(1), -math.inf)
    sink = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    probs = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


class MLA(nn.Module):
    """Multi-head latent attention with q/kv LoRA; ``indexer`` is None on layers that are never F."""

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
        self.rope_interleave = args.mla_rope_interleave
        # HY-V4: a sigmoid gate on each head's output (gate_proj, split with the heads) and a
        # learned softmax sink per head (sinks, fp32, split with the heads)
        self.gate_proj = par.linear(args.hidden_size, args.num_attention_heads * self.v_dim, "gate_proj", "col",
                                    (h0 * self.v_dim, h1 * self.v_dim)) if args.attn_gate else None
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if args.attn_sinks else None
        self._head_range, self._num_heads = (h0, h1), args.num_attention_heads
        ys = args.rope_scaling or {}
        scale = ops.mla_softmax_scale(self.nope, self.rope, ys.get("mscale_all_dim", 0.0), ys.get("factor", 1.0))
        self.sparse_attn = SparseAttention(layer_id, scale, self.latent)

    def project(self, x: torch.Tensor, ctx: ForwardContext, q_pe_out: torch.Tensor | None = None):
        """Rows ``[N, hidden]`` -> (query latent ``[N, q_lora]``, q_nope ``[N, H, nope]``, rotated q_pe
        ``[N, H, rope]`` (rotated into ``q_pe_out`` when given), normed kv latent ``[N, latent]``,
        rotated k_pe ``[N, rope]``)."""
        n = x.shape[0]
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_pe = self.q_b_proj(qr).view(n, self.n_heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        kv = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(kv[:, :self.latent])
        k_pe = apply_rope(kv[:, self.latent:], ctx.cos, ctx.sin, interleaved=self.rope_interleave)
        into = q_pe_out if q_pe_out is not None and q_pe_out.dtype == q_pe.dtype else None
        q_pe = apply_rope(q_pe, ctx.cos, ctx.sin, interleaved=self.rope_interleave, out=into)
        return qr, q_nope, q_pe, kv_c, k_pe

    def param_slice(self, attr: str):
        """The checkpoint slice of this block's own parameter ``attr`` (the loader's hook): the
        sinks of this rank's heads."""
        if attr == "sinks" and self._num_heads != self.n_heads:
            return 0, self._head_range
        return None, None

    def param_full_shape(self, attr: str) -> tuple:
        return (self._num_heads,)

    def _gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """The output gate's logits of the block's input (HY-V4), or None."""
        return None if self.gate_proj is None else self.gate_proj(x)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h, meta = x.shape[0], self.n_heads, ctx.meta
        with ctx.stage(self.layer_id, "mla_proj"):
            # decode rows on the CPU: the absorbed queries' buffer first, q_pe rotated straight into it
            q_abs = None if ctx.torch_pass is not None or not few_rows(x) else \
                x.new_empty(n, h, self.latent + self.rope)
            qr, q_nope, q_pe, kv_c, k_pe = self.project(x, ctx, None if q_abs is None else q_abs[..., self.latent:])
            absorbed = None if ctx.torch_pass is not None else self._absorb(q_nope, q_pe, kv_c, k_pe, ctx, q_abs)
        if absorbed is None:
            return self._forward_torch(x, qr, q_nope, q_pe, kv_c, k_pe, ctx)
        q_abs, w_uv, kv_cache = absorbed
        if ctx.is_full(self.layer_id):
            self._need_indexer()(x, qr, ctx)
        elif not ctx.topk_valid:
            raise RuntimeError(f"layer {self.layer_id} reuses top-k indices but no F layer wrote them in this forward")
        with ctx.stage(self.layer_id, "attention"):
            out = self.sparse_attn(q_abs, ctx.topk_rows, kv_cache, meta.req_of_row, meta.block_table, meta.block_size,
                                   sinks=self.sinks)
            o = absorbed_values(out, w_uv, self._gate(x))
            return self.par.all_reduce(self.o_proj(o.reshape(n, h * self.v_dim)), "attn_all_reduce")

    def _absorb(self, q_nope, q_pe, kv_c, k_pe, ctx: ForwardContext, q_abs: torch.Tensor | None = None):
        """The kernels' form: (queries absorbed into the latent ``[N, H, latent + rope]`` (into
        ``q_abs`` when given), W_UV ``[H, v, latent]`` of kv_b's weight, the latent cache holding this
        step's keys)."""
        w_uk, w_uv = self._kv_b_parts(q_nope.dtype)
        into = q_abs if q_abs is not None and q_abs.dtype == q_nope.dtype == q_pe.dtype else None
        q_abs = absorb_queries(q_nope, q_pe, w_uk, out=into)
        return q_abs, w_uv, self._cache_keys(kv_c, k_pe, ctx)

    def _kv_b_parts(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's weight ``[H, nope + v, latent]`` split into W_UK ``[H, nope, latent]`` and W_UV
        ``[H, v, latent]``. Views of the parameter itself (held in ``dtype``) are made once and kept
        while it is the same tensor with the same storage (they alias it: an in-place load is seen);
        a cast or dequantized weight, grad mode on (autograd records the views) or a compiled step's
        trace makes them anew."""
        w = dense_weight(self.kv_b_proj, dtype)
        keep = (not torch.compiler.is_compiling() and not torch.is_grad_enabled()
                and w is getattr(self.kv_b_proj, "weight", None))
        key = (w.data_ptr(), w.shape, w.stride(), w.dtype, w.device) if keep else None
        made = self.__dict__.get("_kv_b_views")
        if keep and made is not None and made[0] is w and made[1] == key:
            return made[2]
        w_kv = w.view(self.n_heads, self.nope + self.v_dim, self.latent)
        parts = (w_kv[:, :self.nope], w_kv[:, self.nope:])
        if keep:
            self.__dict__["_kv_b_views"] = (w, key, parts)
        return parts

    def _need_indexer(self) -> Indexer:
        if self.indexer is None:
            raise ValueError(f"layer {self.layer_id} is F in this forward but holds no indexer "
                             "(the model was built with it as an S layer)")
        return self.indexer

    def _cache_keys(self, kv_c: torch.Tensor, k_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Write this step's latent keys into the paged cache and return it (no cache: the batch's
        own keys, B blocks of T tokens)."""
        meta = ctx.meta
        if not meta.paged:
            return torch.cat((kv_c, k_pe), dim=-1).view(-1, meta.block_size, self.latent + self.rope)
        kv_cache = ctx.cache.kv[self.layer_id]
        if kv_cache.shape[-1] == MLA_LATENT + MLA_ROPE or kv_cache.dtype == torch.uint8:
            ops.mla_kv_cache_insert(kv_c, k_pe, meta.slot_mapping, kv_cache)
        else:  # other widths: a plain scatter (slot_mapping has no -1 for tokens being computed)
            kv_cache.view(-1, kv_cache.shape[-1])[meta.slot_mapping] = torch.cat((kv_c, k_pe), -1).to(kv_cache.dtype)
        return kv_cache

    def _forward_torch(self, x, qr, q_nope, q_pe, kv_c, k_pe, ctx: ForwardContext) -> torch.Tensor:
        """The differentiable form (unabsorbed): per-head keys and values from the latent, attention
        by ``differentiable.masked_attention`` over the causal window or the source F layer's selection."""
        tp, n, h = ctx.torch_pass, x.shape[0], self.n_heads
        b, t = tp.batch, tp.seq
        full = ctx.is_full(self.layer_id)
        if tp.attention == "selected":
            if full:
                tp.selection = self._need_indexer().select(x, qr, ctx)
            elif tp.selection is None:
                raise RuntimeError(f"layer {self.layer_id} reuses top-k indices but no F layer selected them in this forward")
        sel = tp.selection if tp.attention == "selected" else None
        k_nope, v = self.kv_b_proj(kv_c).view(n, h, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).view(b, t, h, -1).transpose(1, 2)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)), dim=-1).view(b, t, h, -1).transpose(1, 2)
        v = v.reshape(b, t, h, self.v_dim).transpose(1, 2)
        scale = self.sparse_attn.softmax_scale
        if tp.observe is not None:
            tp.observe(LayerRecord(self.layer_id, full, x.detach().view(b, t, -1), qr.detach().view(b, t, -1),
                                   q.detach(), k.detach(), scale, sel))
        if self.sinks is None:
            out = differentiable.masked_attention(q, k, v, scale, sel, tp.chunks, tp.recompute)
        else:
            out = sink_attention(q, k, v, scale, self.sinks, sel, tp.chunks, tp.recompute)
        o = gate_heads(out.transpose(1, 2).reshape(n, h, self.v_dim), self._gate(x))
        return self.par.all_reduce(self.o_proj(o.reshape(n, h * self.v_dim)), "attn_all_reduce")
