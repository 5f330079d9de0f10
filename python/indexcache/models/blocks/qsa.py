"""Qwen3.8-Flash-Next's ``indexed_attention`` layers: gated GQA attention over the tokens a QSA
indexer selects, as transformers' ``Qwen4ExpTextQSAIndexer`` / ``Qwen4ExpTextAttention`` compute them.

QSA (one key head, keys averaged over blocks):

- ``index_qk_proj`` gives ``indexer_n_heads`` query heads and one raw key per token, all of
  ``indexer_head_dim``; queries are RMS-normed (``q_layernorm``, ``1 + w``) and rotated at their
  own position (NeoX, the attention's rotated dims);
- the keys of a request are cut into blocks of ``indexer_compress_ratio`` consecutive tokens
  (block j = positions ``[j r, (j + 1) r)``); a block's key is the fp32 mean of its raw keys
  (cast back), RMS-normed (``k_layernorm``) and rotated at the block's first position;
- a query at position p scores only the blocks it sees **complete** (``(j + 1) r <= p + 1``):
  ``score = Σ_h ReLU(q_h · k_block) / sqrt(indexer_head_dim)``; the top
  ``indexer_budget / r`` blocks are kept (ties toward the lower block, as the DSA indexer's
  top-k), and the query's own incomplete block (the ``(p + 1) mod r`` newest
  tokens, when not 0) is always read.

Scoring and top-k are one fused ``ops.indexer_topk`` call for the batch (every request's block
keys concatenated, per-row windows over them): neither ``[s_q, s_kv]`` nor per-block
``[s_q, s_kv / r]`` scores are stored. A selection row of the shared top-k buffer holds **block ids**: ``budget / r`` columns of selected
complete blocks (ascending, then -1) and a last column with the query's incomplete block or -1.
Attention (``ops.block_sparse_attention``, the MiniMax-M3 op, block size r, causal inside a
block) reads exactly those tokens; every query head shares the one selection.

IndexCache: an S indexed layer has ``indexer = None`` (no parameters, no index-K cache) and
attends over the rows the nearest earlier F indexed layer wrote in this forward.
"""

from __future__ import annotations

import torch
from torch import nn

from indexcache import ops
from indexcache.parallel import ParallelContext

from .. import step_reuse
from ..state import ForwardContext
from .gqa import OffsetRMSNorm, partial_rope
from .kpool_indexer import request_offsets


def rope_angles(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) ``[n, rope_dim / 2]`` at ``positions`` (transformers' default RoPE frequencies)."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    angles = positions.float().unsqueeze(1) * inv.unsqueeze(0)
    return angles.cos(), angles.sin()


class QSAIndexer(nn.Module):
    """The QSA token indexer of one F indexed layer (module docstring)."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, budget: int, ratio: int, eps: float,
                 rope_dim: int, rope_theta: float, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.ratio = n_heads, head_dim, ratio
        self.topk_blocks = budget // ratio
        self.rope_dim, self.rope_theta = rope_dim, rope_theta
        self.index_qk_proj = nn.Linear(hidden, (n_heads + 1) * head_dim, bias=False)
        self.q_layernorm = OffsetRMSNorm(head_dim, eps)
        self.k_layernorm = OffsetRMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[N, hidden]`` -> (queries ``[N, H, D]`` normed and rotated, raw keys ``[N, D]``)."""
        n = x.shape[0]
        q, k = self.index_qk_proj(x).split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        return self._queries(q, ctx.cos, ctx.sin), k.contiguous()

    def _queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The query part of ``index_qk_proj`` ``[N, H * D]`` -> queries ``[N, H, D]`` normed and rotated."""
        return partial_rope(self.q_layernorm(q.reshape(q.shape[0], self.n_heads, self.head_dim)), cos, sin)

    def _tail(self, pos: torch.Tensor) -> torch.Tensor:
        """Each row's own incomplete block id at positions ``pos`` (-1 where its block is complete)."""
        return torch.where((pos + 1) % self.ratio != 0, pos // self.ratio, -1).to(torch.int32)

    def block_keys(self, raw: torch.Tensor) -> torch.Tensor:
        """A request's raw keys ``[S, D]`` -> its complete blocks' keys ``[S // r, D]`` (mean, norm, RoPE)."""
        nb = raw.shape[0] // self.ratio
        pooled = raw[:nb * self.ratio].view(nb, self.ratio, self.head_dim).float().mean(dim=1).to(raw.dtype)
        starts = torch.arange(nb, device=raw.device) * self.ratio
        cos, sin = rope_angles(starts, self.rope_dim, self.rope_theta)
        return partial_rope(self.k_layernorm(pooled), cos, sin)

    def select(self, q: torch.Tensor, block_keys: list, q_lens: list, pos: torch.Tensor, out: torch.Tensor) -> None:
        """All rows of the batch (request after request, ``q_lens`` rows each): queries ``q [N, H, D]``
        at positions ``pos [N]``, each request's complete blocks' keys ``block_keys[b] [S_b // r, D]``;
        writes the selection rows ``out [N, topk_blocks + 1]``. One fused scoring + top-k call
        (``ops.indexer_topk`` with unit head weights: the score's ``1 / sqrt(D)`` is a positive
        constant, so the same blocks win), each row's window the blocks its request has complete."""
        n = q.shape[0]
        keys = torch.cat(block_keys).float().contiguous()
        ks = request_offsets([kb.shape[0] for kb in block_keys], q_lens, q.device)
        ke = ks + ((pos + 1) // self.ratio).to(torch.int32)
        ones = torch.ones(n, self.n_heads, dtype=torch.float32, device=q.device)
        ops.indexer_topk(q.float().contiguous(), keys, None, ones, ks, ke, self.topk_blocks, out=out[:n])
        out[:n, -1] = self._tail(pos)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, index_k: torch.Tensor | None) -> torch.Tensor:
        """Write this forward's selections into the shared rows; returns them ``[N, topk_blocks + 1]``.
        ``index_k``: the layer's paged raw-key cache ``[pages, page, D]`` (None: no cache). Under
        step reuse (``models/step_reuse.py`` over block ids) only the rows that compute project
        queries and score blocks; a reused row keeps its request's last picked blocks with the
        blocks completed since, and its own incomplete block; every row's raw key enters the cache."""
        meta = ctx.meta
        plan = step_reuse.plan_forward(ctx, self.layer_id, self.ratio)
        if plan is not None and plan.rows is not None:
            return self._forward_reusing(x, ctx, index_k, plan)
        with ctx.stage(self.layer_id, "indexer"):
            q, k = self.project(x, ctx)
            rows = ctx.topk_rows
            self._cache_keys(k, index_k, meta)
            block_keys = self._block_keys(k, index_k, meta, range(len(meta.q_lens)))
            self.select(q, block_keys, list(meta.q_lens), meta.positions[:x.shape[0]], rows)
            if plan is not None:
                step_reuse.check(plan, rows[:, :self.topk_blocks])
                step_reuse.save(plan, rows[:, :self.topk_blocks])
        ctx.topk_valid = True
        return rows

    def _forward_reusing(self, x: torch.Tensor, ctx: ForwardContext, index_k: torch.Tensor, plan) -> torch.Tensor:
        """``forward`` when some rows reuse: the keys of every row (the key slice of
        ``index_qk_proj``), queries, block keys and scores for the computing requests only."""
        meta, n, hd = ctx.meta, x.shape[0], self.n_heads * self.head_dim
        rows, sub = ctx.topk_rows, plan.rows
        with ctx.stage(self.layer_id, "indexer"):
            weight = self.index_qk_proj.weight
            k = torch.nn.functional.linear(x, weight[hd:]).contiguous()
            self._cache_keys(k, index_k, meta)
            rows.fill_(-1)
            if plan.meta is not None:
                q = self._queries(torch.nn.functional.linear(x[sub], weight[:hd]), ctx.cos[sub], ctx.sin[sub])
                block_keys = self._block_keys(k, index_k, meta, plan.computing())
                out = torch.full((sub.numel(), rows.shape[1]), -1, dtype=rows.dtype, device=rows.device)
                self.select(q, block_keys, list(plan.meta.q_lens), plan.meta.positions, out)
                rows[sub] = out
            step_reuse.write_reused(plan, rows[:, :self.topk_blocks])
            rows[:, -1] = self._tail(meta.positions[:n]).to(rows.dtype)
            step_reuse.check(plan, rows[:, :self.topk_blocks])
            step_reuse.save(plan, rows[:, :self.topk_blocks])
        ctx.topk_valid = True
        return rows

    def _cache_keys(self, k: torch.Tensor, index_k: torch.Tensor | None, meta) -> None:
        if index_k is not None:
            index_k.view(-1, self.head_dim)[meta.slot_mapping] = k.to(index_k.dtype)

    def _block_keys(self, k: torch.Tensor, index_k: torch.Tensor | None, meta, reqs) -> list:
        """The complete blocks' keys of the requests ``reqs`` (indices into the batch): their raw keys
        from the paged cache (or, without one, this forward's ``k``), pooled by ``block_keys``."""
        page = meta.block_size if index_k is None else index_k.shape[1]
        offs, out = meta.row_offsets(), []
        for b in reqs:
            qn, seq = meta.q_lens[b], meta.ctx_lens[b] + meta.q_lens[b]
            if index_k is None:
                keys = k[offs[b]:offs[b] + qn]
            else:
                p = torch.arange(seq, device=k.device)
                slots = meta.block_table[b, p // page].long() * page + p % page
                keys = index_k.view(-1, self.head_dim)[slots].to(k.dtype)
            out.append(self.block_keys(keys))
        return out


class IndexedAttention(nn.Module):
    """Qwen3.8-Flash-Next's attention of one indexed layer: q_proj gives per head the query and a
    sigmoid output gate (``[q | gate]`` per head), per-head RMS QK-norm (``1 + w``), partial NeoX
    RoPE, GQA over the QSA selection, ``out * sigmoid(gate)``, o_proj. ``indexer``: a
    ``QSAIndexer`` when the layer is F in the plan, else None."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, indexer_cfg: dict,
                 build_indexer: bool, layer_id: int, par: ParallelContext | None = None):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}")
        self.layer_id, self.par = layer_id, par or ParallelContext()
        # tensor parallel: this rank's query heads [h0, h1) (q_proj's [q | gate] rows per head) and
        # the key/value heads they read [k0, k1); o_proj row split, all-reduced; the indexer replicated
        (h0, h1), (k0, k1) = (self.par.split(n_heads, "num_attention_heads"),
                              self.par.split(n_kv_heads, "num_key_value_heads"))
        self.n_heads, self.n_kv_heads, self.head_dim = h1 - h0, k1 - k0, head_dim
        self.scale = head_dim ** -0.5
        self.ratio, self.topk_blocks = indexer_cfg["ratio"], indexer_cfg["budget"] // indexer_cfg["ratio"]
        d, lin = head_dim, self.par.linear
        self.q_proj = lin(hidden, n_heads * d * 2, "q_proj", "col", (h0 * 2 * d, h1 * 2 * d))
        self.k_proj = lin(hidden, n_kv_heads * d, "k_proj", "col", (k0 * d, k1 * d))
        self.v_proj = lin(hidden, n_kv_heads * d, "v_proj", "col", (k0 * d, k1 * d))
        self.o_proj = lin(n_heads * d, hidden, "o_proj", "row", (h0 * d, h1 * d))
        self.q_norm = OffsetRMSNorm(head_dim, eps)
        self.k_norm = OffsetRMSNorm(head_dim, eps)
        self.indexer = QSAIndexer(hidden, eps=eps, layer_id=layer_id, **indexer_cfg) if build_indexer else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, d, meta = x.shape[0], self.head_dim, ctx.meta
        cache = ctx.cache
        if ctx.is_full(self.layer_id):
            if self.indexer is None:
                raise ValueError(f"layer {self.layer_id} is F in this forward but holds no indexer "
                                 "(the model was built with it as an S layer)")
            rows = self.indexer(x, ctx, None if cache is None else cache.index_k[self.layer_id])
        elif not ctx.topk_valid:
            raise RuntimeError(f"layer {self.layer_id} reuses a QSA selection but no F layer wrote one in this forward")
        else:
            rows = ctx.topk_rows
        with ctx.stage(self.layer_id, "attn_proj"):
            qg = self.q_proj(x).view(n, self.n_heads, 2 * d)
            q, gate = qg[..., :d], qg[..., d:].reshape(n, self.n_heads * d)
            q = partial_rope(self.q_norm(q), ctx.cos, ctx.sin)
            k = partial_rope(self.k_norm(self.k_proj(x).view(n, self.n_kv_heads, d)), ctx.cos, ctx.sin)
            v = self.v_proj(x).view(n, self.n_kv_heads, d)
            if cache is None:
                shape = (-1, meta.block_size, self.n_kv_heads, d)
                kc, vc = k.contiguous().view(shape), v.contiguous().view(shape)
            else:
                kc, vc = cache.k[self.layer_id], cache.v[self.layer_id]
                kc.view(-1, self.n_kv_heads, d)[meta.slot_mapping] = k.to(kc.dtype)
                vc.view(-1, self.n_kv_heads, d)[meta.slot_mapping] = v.to(vc.dtype)
        with ctx.stage(self.layer_id, "attention"):
            blocks = rows.view(n, 1, -1).expand(n, self.n_kv_heads, rows.shape[1]).contiguous()
            out, _ = ops.block_sparse_attention(q.to(kc.dtype).contiguous(), kc, vc, meta.block_table, meta.req_of_row,
                                                meta.positions.int(), blocks, self.ratio, self.scale)
        out = out.to(x.dtype).reshape(n, -1) * torch.sigmoid(gate)
        return self.par.all_reduce(self.o_proj(out), "attn_all_reduce")
