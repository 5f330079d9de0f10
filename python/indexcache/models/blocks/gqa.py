"""MiniMax-M3's attention (DESIGN.md §6): GQA with per-head RMS QK-norm and partial RoPE, dense
causal on ``full_attention`` layers and block-sparse on ``minimax_m3_sparse`` layers, where the
block indexer picks ``index_topk_blocks`` key blocks per KV head (``ops.block_topk`` /
``ops.block_topk_paged``) and attention reads only those (``ops.block_sparse_attention``).

IndexCache: the block selection of a sparse layer goes to the model's shared top-k buffer,
``[N, num_kv_heads * index_topk_blocks]`` (a ``[N, num_kv_heads, index_topk_blocks]`` view); an S
sparse layer has ``indexer = None`` and attends over the selection the nearest earlier F sparse
layer wrote in the same forward.

Both forms of the batch run the same ops: without a cache (``model(input_ids)``) the batch's own
keys are ``B`` pages of ``T`` tokens; with one, this step's keys are written into the paged
cache first (``MiniMaxM3PagedCache``: K and V per layer, index keys per F sparse layer).
"""

from __future__ import annotations

import torch
from torch import nn

from indexcache import ops
from indexcache.parallel import ParallelContext

from ..args import ModelArgs
from ..state import ForwardContext
from .rope import apply_rope

SPARSE = "minimax_m3_sparse"
FULL = "full_attention"


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight`` (Gemma's form, MiniMax-M3's every norm): fp32 inside,
    the input's dtype out; a zero weight is the identity scale."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on the first ``2 * cos.shape[-1]`` dims of ``x [N, ..., d]``; the rest pass through."""
    r = 2 * cos.shape[-1]
    return torch.cat((apply_rope(x[..., :r], cos, sin, interleaved=False), x[..., r:]), dim=-1)


class BlockIndexer(nn.Module):
    """MiniMax-M3's block indexer: ``index_n_heads`` (== KV heads) query heads against one key
    head, RMS-normed and RoPE'd, plain fp32 dot products max-pooled over ``index_block_size``
    keys, the ``index_local_blocks`` blocks ending at the query forced in, the top
    ``index_topk_blocks`` blocks kept per head (ascending ids, then -1). Replicated on every
    tensor-parallel rank (identical inputs, identical selections)."""

    def __init__(self, args: ModelArgs, layer_id: int, par: ParallelContext | None = None):
        super().__init__()
        par = par or ParallelContext()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.block, self.topk_blocks, self.local_blocks = (args.index_block_size, args.index_topk_blocks,
                                                           args.index_local_blocks)
        self.q_proj = par.linear(args.hidden_size, self.n_heads * self.head_dim, "index_q_proj")
        self.k_proj = par.linear(args.hidden_size, self.head_dim, "index_k_proj")
        self.q_norm = OffsetRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, args.rms_norm_eps)

    def project(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[N, hidden]`` -> (queries ``[N, H, D]``, keys ``[N, D]``), normed and rotated."""
        n = x.shape[0]
        q = partial_rope(self.q_norm(self.q_proj(x).view(n, self.n_heads, self.head_dim)), ctx.cos, ctx.sin)
        k = partial_rope(self.k_norm(self.k_proj(x)), ctx.cos, ctx.sin)
        return q.contiguous(), k.contiguous()

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Write this forward's block selection into the shared rows; returns them ``[N, H, topk_blocks]``."""
        n, meta = x.shape[0], ctx.meta
        with ctx.stage(self.layer_id, "indexer"):
            q, k = self.project(x, ctx)
            rows = ctx.topk_rows.view(n, self.n_heads, self.topk_blocks)
            if not meta.paged:  # B requests of T tokens: row t of request b sees keys [b*T, b*T + pos + 1)
                ks = (meta.req_of_row * meta.block_size).int()
                ke = (ks + meta.positions.int() + 1).int()
                ops.block_topk(q, k, ks, ke, self.block, self.topk_blocks, self.local_blocks, out=rows)
            else:
                cache = ctx.cache.index_k[self.layer_id]
                cache.view(-1, self.head_dim)[meta.slot_mapping] = k.to(cache.dtype)
                self._topk_paged(q.to(cache.dtype), cache, rows, ctx)
        ctx.topk_valid = True
        return rows

    def _topk_paged(self, q, cache, rows, ctx: ForwardContext) -> None:
        meta = ctx.meta
        nq = meta.uniform_q
        if nq is not None:  # every request brings nq rows (decode, or equal chunks): one call
            ops.block_topk_paged(q, cache, meta.block_table, meta.seq_lens, nq, self.block, self.topk_blocks,
                                 self.local_blocks, out=rows)
            return
        if ctx.sync_free:
            raise ValueError(f"layer {self.layer_id}: a sync-free forward needs the same number of rows per request")
        for b, off in enumerate(meta.row_offsets()):
            qn = meta.q_lens[b]
            ops.block_topk_paged(q[off:off + qn], cache, meta.block_table[b:b + 1], meta.seq_lens[b:b + 1], qn,
                                 self.block, self.topk_blocks, self.local_blocks, out=rows[off:off + qn])


class GQAAttention(nn.Module):
    """MiniMax-M3 attention of one layer. ``indexer``: a ``BlockIndexer`` on sparse layers that are
    F in the plan, None on S sparse layers and on ``full_attention`` layers (``sparse`` tells them
    apart)."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, par: ParallelContext | None = None):
        super().__init__()
        self.par = par = par or ParallelContext()
        self.layer_id = layer_id
        self.sparse = args.attn_layer_types[layer_id] == SPARSE
        d, hq, hkv = args.gqa_head_dim, args.num_attention_heads, args.num_kv_heads
        # tensor parallel: this rank's query heads [h0, h1) and their KV heads [g0, g1) (tp divides both)
        h0, h1 = par.split(hq, "num_attention_heads")
        self.kv_range = g0, g1 = par.split(hkv, "num_key_value_heads")
        self.head_dim, self.n_heads, self.n_kv_heads, self.all_kv_heads = d, h1 - h0, g1 - g0, hkv
        self.scale = d ** -0.5
        self.block, self.topk_blocks = args.index_block_size, args.index_topk_blocks
        self.q_proj = par.linear(args.hidden_size, hq * d, "q_proj", "col", (h0 * d, h1 * d))
        self.k_proj = par.linear(args.hidden_size, hkv * d, "k_proj", "col", (g0 * d, g1 * d))
        self.v_proj = par.linear(args.hidden_size, hkv * d, "v_proj", "col", (g0 * d, g1 * d))
        self.o_proj = par.linear(hq * d, args.hidden_size, "o_proj", "row", (h0 * d, h1 * d))
        self.q_norm = OffsetRMSNorm(d, args.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, args.rms_norm_eps)
        self.indexer = BlockIndexer(args, layer_id, par) if build_indexer and self.sparse else None

    def project(self, x: torch.Tensor, ctx: ForwardContext):
        """Rows ``[N, hidden]`` -> (q ``[N, Hq, d]``, k ``[N, Hkv, d]``, v ``[N, Hkv, d]``), q and k normed per head and rotated."""
        n, d = x.shape[0], self.head_dim
        q = partial_rope(self.q_norm(self.q_proj(x).view(n, self.n_heads, d)), ctx.cos, ctx.sin)
        k = partial_rope(self.k_norm(self.k_proj(x).view(n, self.n_kv_heads, d)), ctx.cos, ctx.sin)
        return q, k, self.v_proj(x).view(n, self.n_kv_heads, d)

    def _caches(self, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext):
        """(K pages, V pages, page size): this step's keys written into the paged cache, or without
        one the batch's own keys as ``B`` pages of ``T`` tokens."""
        meta = ctx.meta
        if not meta.paged:
            shape = (-1, meta.block_size, self.n_kv_heads, self.head_dim)
            return k.contiguous().view(shape), v.contiguous().view(shape), meta.block_size
        kc, vc = ctx.cache.k[self.layer_id], ctx.cache.v[self.layer_id]
        kc.view(-1, self.n_kv_heads, self.head_dim)[meta.slot_mapping] = k.to(kc.dtype)
        vc.view(-1, self.n_kv_heads, self.head_dim)[meta.slot_mapping] = v.to(vc.dtype)
        return kc, vc, kc.shape[1]

    def _blocks(self, x: torch.Tensor, ctx: ForwardContext, capacity: int) -> tuple[torch.Tensor, int]:
        """(block ids of this rank's KV heads ``[N, Hkv, topk]``, block size) this layer attends
        over. A full-attention layer reads one block spanning every key (causal inside it)."""
        n = x.shape[0]
        if not self.sparse:
            return torch.zeros(n, self.n_kv_heads, 1, dtype=torch.int32, device=x.device), max(capacity, 1)
        if ctx.is_full(self.layer_id):
            if self.indexer is None:
                raise ValueError(f"layer {self.layer_id} is F in this forward but holds no indexer "
                                 "(the model was built with it as an S layer)")
            rows = self.indexer(x, ctx)
        elif not ctx.topk_valid:
            raise RuntimeError(f"layer {self.layer_id} reuses block selections but no F layer wrote them in this forward")
        else:
            rows = ctx.topk_rows.view(n, self.all_kv_heads, self.topk_blocks)
        if self.n_kv_heads != self.all_kv_heads:  # the replicated selection, this rank's heads
            rows = rows[:, self.kv_range[0]:self.kv_range[1]].contiguous()
        return rows, self.block

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.torch_pass is not None:
            raise ValueError("MiniMax-M3 has no differentiable torch form (training runs the DSA families)")
        n, meta = x.shape[0], ctx.meta
        with ctx.stage(self.layer_id, "attn_proj"):
            q, k, v = self.project(x, ctx)
            kc, vc, page = self._caches(k, v, ctx)
        if not self.sparse and not ctx.sync_free:  # dense causal: torch's fused attention
            with ctx.stage(self.layer_id, "attention"):
                out = self._dense_causal(q.to(kc.dtype), kc, vc, page, meta)
                return self.par.all_reduce(self.o_proj(out.to(x.dtype).reshape(n, -1)), "attn_all_reduce")
        blocks, block = self._blocks(x, ctx, meta.block_table.shape[1] * page)
        with ctx.stage(self.layer_id, "attention"):
            out, _ = ops.block_sparse_attention(q.to(kc.dtype).contiguous(), kc, vc, meta.block_table, meta.req_of_row,
                                                meta.positions.int(), blocks, block, self.scale)
            return self.par.all_reduce(self.o_proj(out.to(x.dtype).reshape(n, -1)), "attn_all_reduce")

    def _dense_causal(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, page: int, meta) -> torch.Tensor:
        """A full-attention layer: each request's rows over its keys ``[0, pos]`` with
        ``scaled_dot_product_attention`` (GQA), keys gathered from the pages. ``[N, Hq, d]``."""
        out = torch.empty_like(q)
        flat_k, flat_v = kc.view(-1, self.n_kv_heads, self.head_dim), vc.view(-1, self.n_kv_heads, self.head_dim)
        for b, off in enumerate(meta.row_offsets()):
            c, qn = meta.ctx_lens[b], meta.q_lens[b]
            pos = torch.arange(c + qn, device=q.device)
            slots = meta.block_table[b, pos // page].long() * page + pos % page
            keys, vals = flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)  # [Hkv, c + qn, d]
            mask = None if c == 0 else pos.view(1, -1) <= pos[c:].view(-1, 1)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[off:off + qn].transpose(0, 1), keys, vals, attn_mask=mask, is_causal=c == 0, scale=self.scale,
                enable_gqa=True)
            out[off:off + qn] = o.transpose(0, 1)
        return out
