"""Pure-torch definitions of MiniMax-M3's block-sparse ops (DESIGN.md §5, §6), re-exported by
reference.py: the formal meaning that the kernels are tested against, checked against
transformers' MiniMax-M3 indexer and attention in tests/test_block_sparse.py.

MiniMax-M3's sparse layers select key *blocks* per indexer head (one per KV head), then run
GQA attention over the selected blocks only. Block b of a request holds its positions
``[b * block_size, (b + 1) * block_size)``. Outputs list block ids ascending, then -1.
"""

from __future__ import annotations

import math

import torch


def block_scores(q: torch.Tensor, k: torch.Tensor, query_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Max-pooled indexer scores of one request.

    q ``[s_q, h, d]``, k ``[n, d]`` (the request's keys, position i at row i), query_pos int
    ``[s_q]`` (query t sees keys ``[0, query_pos[t]]``). Score of (t, h, key s) is the fp32 dot
    product ``q[t, h] · k[s]`` (no scale, no ReLU); block scores ``[s_q, h, ceil(n / block_size)]``
    are the max over the block's visible keys (NaN propagates, as ``amax``), -inf for a block
    with none.
    """
    n = k.shape[0]
    nb = -(-n // block_size)
    scores = torch.einsum("thd,sd->ths", q.float(), k.float())
    future = torch.arange(n, device=q.device).view(1, 1, -1) > query_pos.long().view(-1, 1, 1)
    scores = scores.masked_fill(future, -math.inf)
    scores = torch.nn.functional.pad(scores, (0, nb * block_size - n), value=-math.inf)
    return scores.view(q.shape[0], q.shape[1], nb, block_size).amax(dim=-1)


def select_blocks(scores: torch.Tensor, query_pos: torch.Tensor, block_size: int, topk_blocks: int,
                  local_blocks: int) -> torch.Tensor:
    """Block top-k of block scores ``[s_q, h, nb]`` -> int32 ``[s_q, h, topk_blocks]``.

    The ``local_blocks`` blocks ending at the query's block (``query_pos // block_size - j``,
    clamped at 0) are forced in (their score becomes +inf); then blocks rank by score
    descending (NaN above +inf, as ``torch.sort``), lower block id first on ties; blocks with
    score -inf (nothing visible) are never selected. The kept ids are written ascending, then -1.
    """
    s_q, h, nb = scores.shape
    sc = scores.float().clone()
    qb = query_pos.long() // block_size
    for j in range(local_blocks):
        col = (qb - j).clamp(min=0).clamp(max=nb - 1)
        sc.scatter_(-1, col.view(-1, 1, 1).expand(s_q, h, 1), math.inf)
    out = torch.full((s_q, h, topk_blocks), -1, dtype=torch.int32, device=scores.device)
    k = min(topk_blocks, nb)
    if k == 0:
        return out
    order = torch.sort(sc, dim=-1, descending=True, stable=True).indices[..., :k]
    kept = torch.gather(sc, -1, order) != -math.inf
    ids = torch.where(kept, order, torch.full_like(order, nb))  # nb sorts after every real id
    ids = torch.sort(ids, dim=-1).values
    out[..., :k] = torch.where(ids == nb, torch.full_like(ids, -1), ids).int()
    return out


def block_topk(q: torch.Tensor, k: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, block_size: int,
               topk_blocks: int, local_blocks: int) -> torch.Tensor:
    """MiniMax-M3 indexer, prefill: block scoring + block top-k over per-row key windows.

    q ``[s_q, h, d]`` and k ``[s_kv, d]`` (bf16/fp32; one key head shared by the h indexer
    heads); ks, ke int32 ``[s_q]``: row t's request keys are ``k[ks[t]:ke[t]]`` (request
    position i at ``k[ks[t] + i]``) and its query sits at position ``ke[t] - ks[t] - 1``.
    Returns int32 ``[s_q, h, topk_blocks]`` request-relative block ids (:func:`select_blocks`);
    an empty window gives all -1.
    """
    out = torch.full((q.shape[0], q.shape[1], topk_blocks), -1, dtype=torch.int32, device=q.device)
    for t in range(q.shape[0]):
        lo, hi = int(ks[t]), int(ke[t])
        if hi <= lo:
            continue
        pos = torch.tensor([hi - lo - 1], device=q.device)
        sc = block_scores(q[t:t + 1], k[lo:hi], pos, block_size)
        out[t:t + 1] = select_blocks(sc, pos, block_size, topk_blocks, local_blocks)
    return out


def paged_rows(cache: torch.Tensor, block_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Rows ``[n, ...]`` of request b's positions 0..n-1 in a paged cache ``[pages, page_size, ...]``."""
    page = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[block_table[b, pos // page].long(), pos % page]


def block_topk_paged(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     next_n: int, block_size: int, topk_blocks: int, local_blocks: int) -> torch.Tensor:
    """MiniMax-M3 indexer, paged decode: :func:`block_topk` with keys read from a paged cache.

    q ``[B * next_n, h, d]`` (rows grouped by request); k_cache ``[num_pages, page_size, d]``
    in q's dtype; block_table int32 ``[B, max_pages]``; seq_lens int32 ``[B]`` (tokens in the
    cache, drafts included). Row j of request b sees ``seq_len - next_n + j + 1`` keys
    (reference.decode_windows); a window <= 0 gives all -1.
    """
    out = torch.full((q.shape[0], q.shape[1], topk_blocks), -1, dtype=torch.int32, device=q.device)
    j = torch.arange(next_n, device=seq_lens.device)
    windows = (seq_lens.long().unsqueeze(1) - next_n + j + 1).reshape(-1)
    for b in range(block_table.shape[0]):
        n = int(seq_lens[b])
        if n <= 0:
            continue
        keys = paged_rows(k_cache, block_table, b, n)
        for j in range(next_n):
            t, w = b * next_n + j, int(windows[b * next_n + j])
            if w <= 0:
                continue
            pos = torch.tensor([w - 1], device=q.device)
            sc = block_scores(q[t:t + 1], keys[:w], pos, block_size)
            out[t:t + 1] = select_blocks(sc, pos, block_size, topk_blocks, local_blocks)
    return out


def block_sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           req: torch.Tensor, pos: torch.Tensor, blocks: torch.Tensor, block_size: int,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M3 block-sparse GQA attention over a paged KV cache (prefill and decode alike).

    q ``[s_q, h_q, d]`` (bf16/fp32); k_cache, v_cache ``[num_pages, page_size, h_kv, d]`` in
    q's dtype; block_table int32 ``[B, max_pages]``; req int32 ``[s_q]`` (the row's request),
    pos int32 ``[s_q]`` (the row's request position: keys ``[0, pos]`` are causal); blocks int32
    ``[s_q, h_kv, topk]`` selected block ids per KV head, -1 = none (duplicates count once).
    Query head h reads KV head ``h // (h_q / h_kv)`` at the keys of its selected blocks that
    are ``<= pos``. Returns ``out [s_q, h_q, d]`` in q's dtype and ``lse`` fp32 ``[s_q, h_q]``
    (natural log of the softmax denominator of ``scale * q·k``); a row with no key gives out 0
    and lse -inf. Non-finite inputs: if any score ``scale * q·k`` of a key the head reads is NaN or
    +-inf, that head's out and lse are all NaN; a NaN / inf in a value row reaches out through
    IEEE arithmetic (docs/ops.md, non-finite inputs).
    """
    s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    g = h_q // h_kv
    out = torch.zeros((s_q, h_q, d), dtype=torch.float32, device=q.device)
    lse = torch.full((s_q, h_q), -math.inf, dtype=torch.float32, device=q.device)
    for t in range(s_q):
        b, p = int(req[t]), int(pos[t])
        keys = paged_rows(k_cache, block_table, b, p + 1).float()  # [p + 1, h_kv, d]
        vals = paged_rows(v_cache, block_table, b, p + 1).float()
        key_block = torch.arange(p + 1, device=q.device) // block_size
        for kh in range(h_kv):
            sel = blocks[t, kh].long()
            allowed = (key_block.view(-1, 1) == sel[sel >= 0].view(1, -1)).any(dim=-1)
            if not bool(allowed.any()):
                continue
            heads = slice(kh * g, (kh + 1) * g)
            s = torch.einsum("hd,sd->hs", q[t, heads].float(), keys[allowed, kh]) * scale
            # A NaN or +-inf score makes the head's whole out and lse NaN (docs/ops.md, as sparse_mla).
            bad = ~torch.isfinite(s).all(dim=-1)
            lse[t, heads] = torch.logsumexp(s, dim=-1).masked_fill(bad, math.nan)
            out[t, heads] = (torch.softmax(s, dim=-1) @ vals[allowed, kh]).masked_fill(bad.view(-1, 1), math.nan)
    return out.to(q.dtype), lse
