"""GLM-5.3-Flash's key-pooled DSA indexer (transformers' ``Glm5NextTextIndexer``), DESIGN.md §6.

One key head ``k = LayerNorm(wk(x))`` (eps 1e-6, no RoPE). Request positions are cut into pools of
``index_kpool`` tokens (pool ``j``: positions ``[j P, (j + 1) P)``); a complete pool's key is the
softmax-weighted mean of its tokens' keys, the weights ``softmax_t(gate[t] + ape[t mod P])`` per
channel, ``gate = index_kpool_compress_gate · x``. A query at position ``p`` scores each complete
pool it sees (the ``(p + 1) // P`` pools ending at or before ``p``) by
``Σ_h w_h · H^-½ · ReLU(q_h · k_pool · d^-½)`` (``w = weights_proj(x)``, ``q = wq_b(qr)``), keeps the
``index_topk / P`` best (ties toward the lower pool), expands them to their ``P`` positions each and,
with ``index_kpool_always_select_tail``, adds the positions of its own unfinished pool
(``[(p + 1) - (p + 1) mod P, p]``). The row it writes into the shared top-k buffer holds
``index_topk + P - 1`` request positions (-1 padded). Scoring and top-k are the lightning
indexer's own fused op (``ops.indexer_topk`` at the config's ``index_head_dim``: the same
ReLU-weighted sum over the pooled keys, the constants folded into the head weights since
``ReLU(a x) = a ReLU(x)`` for ``a > 0``), one call for the batch: every request's pools
concatenated, each row's window ``[ks, ke)`` the pools its request has complete at its position.
Neither ``[s_q, s_kv]`` nor ``[s_q, s_kv / P]`` scores are stored.

Caches (``Glm5NextPagedCache``): per F layer each token's ``k | gate`` (``index_raw``, what a pool
is built from once it completes) and the pooled keys (``index_pool``, one row per ``P`` slots of
a block: pool ``j`` of a request lives in the block holding position ``j P``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import ops

from .. import step_reuse
from ..state import ForwardContext
from .norms import LayerNorm

POOL_K_NORM_EPS = 1e-6  # transformers builds the indexer's key LayerNorm with eps 1e-6


def pooled_keys(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Complete pools' keys: k, gate ``[n_pools * P, d]`` (in position order), ape ``[P, d]`` ->
    fp32 ``[n_pools, d]``, ``Σ_t softmax_t(gate + ape) · k`` per channel."""
    p, d = ape.shape
    logits = gate.float().view(-1, p, d) + ape.float()
    return (logits.softmax(dim=1) * k.float().view(-1, p, d)).sum(dim=1)


def request_offsets(keys_per_request: list, rows_per_request: list, device) -> torch.Tensor:
    """int32 ``[rows]``: for each row, where its request's keys begin in the requests' concatenated keys."""
    starts = torch.tensor([0, *keys_per_request[:-1]], dtype=torch.int64).cumsum(0)
    return starts.repeat_interleave(torch.tensor(rows_per_request, dtype=torch.int64)).to(device, torch.int32)


class PooledIndexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, kpool: int,
                 always_select_tail: bool, layer_id: int):
        super().__init__()
        self.layer_id, self.n_heads, self.head_dim = layer_id, n_heads, head_dim
        self.kpool, self.topk_pools, self.tail = kpool, topk // kpool, always_select_tail
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = LayerNorm(head_dim, eps=POOL_K_NORM_EPS)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)  # fp32
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(head_dim, hidden))

    @property
    def row_width(self) -> int:
        """Columns of a selection row: the selected pools' positions, then the tail's."""
        return self.topk_pools * self.kpool + (self.kpool - 1 if self.tail else 0)

    def key_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Per row fp32 ``[N, 2 d]``: the key ``LayerNorm(wk x)`` then the pooling gate logits."""
        k = self.k_norm(self.wk(x)).float()
        return torch.cat((k, F.linear(x, self.index_kpool_compress_gate.to(x.dtype)).float()), dim=-1)

    def _pools(self, raw: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        return pooled_keys(raw[:, :d], raw[:, d:], self.index_kpool_compress_ape)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext) -> None:
        """Select for every row of the batch and write ``ctx.topk_rows`` (request positions, -1 padded).
        Under step reuse (``models/step_reuse.py`` over pool ids) only the rows that compute project
        queries and score pools; a reused row keeps its request's last picked pools with the pools
        completed since, and its own tail; every row's ``k | gate`` enters the cache."""
        meta, n = ctx.meta, x.shape[0]
        P = self.kpool
        plan = step_reuse.plan_forward(ctx, self.layer_id, P)
        sub = None if plan is None or plan.rows is None else plan.rows
        with ctx.stage(self.layer_id, "indexer"):
            xq, qrq = (x, qr) if sub is None else (x[sub], qr[sub])
            q = self.wq_b(qrq).view(xq.shape[0], self.n_heads, self.head_dim).float()
            w = self.weights_proj(xq.to(self.weights_proj.weight.dtype)).float() * (self.n_heads * self.head_dim) ** -0.5
            raw = self.key_inputs(x)
            skip = set() if sub is None else {b for b, *_ in plan.reused}
            pools_of = self._paged_pools(raw, ctx, skip) if meta.paged else self._fresh_pools(raw, meta)
        with ctx.stage(self.layer_id, "topk"):
            rows, pos = ctx.topk_rows, meta.positions[:n].long()
            rows.fill_(-1)
            picked = self._pick(q, w, pools_of, pos, meta, plan)
            if plan is not None:
                step_reuse.write_reused(plan, picked)
                step_reuse.check(plan, picked)
                step_reuse.save(plan, picked)
            if picked is not None:
                tok = picked.long().unsqueeze(-1) * P + torch.arange(P, device=x.device)
                tok = torch.where(picked.unsqueeze(-1) >= 0, tok, torch.full_like(tok, -1)).flatten(1)
                rows[:n, :tok.shape[1]] = tok.int()
            if self.tail and P > 1:
                start = (pos + 1) // P * P
                tail = start.unsqueeze(1) + torch.arange(P - 1, device=x.device)
                tail = torch.where(tail <= pos.unsqueeze(1), tail, torch.full_like(tail, -1))
                rows[:n, self.topk_pools * P:self.row_width] = tail.int()
        ctx.topk_valid = True

    def _pick(self, q, w, pools_of: list, pos: torch.Tensor, meta, plan):
        """Each row's picked pool ids, int32 ``[N, topk_pools]`` (-1: none): one fused scoring +
        top-k call over the rows that compute (``q``, ``w``: theirs), every request's pools
        concatenated. None when step reuse is off and no request has a complete pool."""
        n, P = pos.shape[0], self.kpool
        keys = torch.cat(pools_of).contiguous()  # every request's pools, request after request
        ks = request_offsets([pk.shape[0] for pk in pools_of], meta.q_lens, pos.device)
        ke = ks + ((pos + 1) // P).int()
        if plan is None or plan.rows is None:
            if keys.shape[0]:
                return ops.indexer_topk(q.contiguous(), keys, None, w.contiguous(), ks, ke, self.topk_pools)
            return None if plan is None else torch.full((n, self.topk_pools), -1, dtype=torch.int32, device=q.device)
        picked = torch.full((n, self.topk_pools), -1, dtype=torch.int32, device=q.device)
        if plan.meta is not None and keys.shape[0]:
            sub = plan.rows
            picked[sub] = ops.indexer_topk(q.contiguous(), keys, None, w.contiguous(), ks[sub], ke[sub], self.topk_pools)
        return picked

    def _fresh_pools(self, raw: torch.Tensor, meta) -> list:
        """No cache: each request is this forward's rows from position 0; its complete pools' keys."""
        out, r0 = [], 0
        for c, m in zip(meta.ctx_lens, meta.q_lens):
            if c:
                raise ValueError("a forward without a cache starts every request at position 0")
            out.append(self._pools(raw[r0:r0 + m // self.kpool * self.kpool]))
            r0 += m
        return out

    def _paged_pools(self, raw: torch.Tensor, ctx: ForwardContext, skip=frozenset()) -> list:
        """Write this step's ``k | gate`` rows, pool the pools that completed in it (one
        ``ops.kpool_pool_paged`` for the batch) and return each
        request's pooled keys ``[complete pools, d]`` read from the cache (none for the requests
        ``skip``: their rows reuse a selection and score nothing)."""
        meta, cache, P = ctx.meta, ctx.cache, self.kpool
        raw_cache, pool_cache = cache.index_raw[self.layer_id], cache.index_pool[self.layer_id]
        bs = meta.block_size
        flat_raw = raw_cache.view(-1, raw_cache.shape[-1])
        flat_raw[meta.slot_mapping] = raw.to(flat_raw.dtype)
        lens = torch.tensor([meta.ctx_lens, meta.q_lens], dtype=torch.int32).to(raw.device)
        ops.kpool_pool_paged(raw_cache, pool_cache, self.index_kpool_compress_ape.detach(), meta.block_table, lens[0], lens[1])
        per_block = bs // P
        flat_pool = pool_cache.view(-1, pool_cache.shape[-1])
        table = meta.block_table.long()
        out = []
        for b, (c, m) in enumerate(zip(meta.ctx_lens, meta.q_lens)):
            first = torch.arange(0 if b in skip else (c + m) // P, device=raw.device) * P
            out.append(flat_pool[table[b, first // bs] * per_block + (first % bs) // P].float())
        return out
