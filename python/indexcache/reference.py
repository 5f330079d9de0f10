"""Pure-torch definitions of every op: the formal meaning that the kernels are tested against.

Written for clarity, not speed. Conventions (DESIGN.md §3–§5):
- ``-1`` in an index or slot means "no token".
- Top-k selects under the total order (value descending, position ascending), so ties are
  resolved toward lower positions and the selected set is unique. Output rows list the
  selected request-relative positions in ascending order, then ``-1`` padding.
- FP8 is ``torch.float8_e4m3fn`` (max 448); indexer scales are powers of two (ue8m0).
- Non-finite inputs (docs/ops.md has the table): a quantization group holding a NaN or
  +-inf gets a NaN scale and NaN values; indexer scores follow IEEE fp32 arithmetic with a
  ReLU that keeps NaN; top-k sorts every NaN above +inf (as ``torch.sort``); sparse MLA makes
  ``out``/``lse`` of a (row, head) NaN when one of its valid keys' scores is NaN or +-inf,
  or when its head's attention sink is NaN or +inf (a -inf sink is no sink).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from indexcache.formats import (FP8_MAX, INDEX_K_EPS, INDEX_Q_EPS, MLA_FP8_EPS, MLA_FP8_SCALE_END,  # noqa: F401
                                MLA_FP8_SCALES, MLA_LATENT, MLA_ROPE, QUANT_GROUP)


# ----------------------------------------------------------------------------- fp8 helpers

def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal 128-point Walsh-Hadamard rotation of each group of 128 values (fp32).

    Done as log2(128) butterfly stages, a+b then a-b, then one multiply by 128^-1/2; the
    C++ kernels use the same operation order, so results are bit-identical.
    """
    shape = x.shape
    y = x.float().reshape(-1, QUANT_GROUP)
    h = 1
    while h < QUANT_GROUP:
        y = y.view(-1, QUANT_GROUP // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, QUANT_GROUP)
        h *= 2
    return (y * torch.tensor(QUANT_GROUP ** -0.5, dtype=torch.float32)).reshape(shape)


def ue8m0_scale(amax: torch.Tensor, eps: float) -> torch.Tensor:
    """``2^ceil(log2(max(amax, eps) / 448))``, computed exactly through frexp."""
    r = torch.clamp(amax.float(), min=eps) / FP8_MAX
    mantissa, exponent = torch.frexp(r)  # r = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(r), exponent)


def quantize_fp8(x: torch.Tensor, eps: float, hadamard: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., d]`` (d % 128 == 0) to e4m3 with one power-of-two scale per 128 values.

    Returns ``(values e4m3 [..., d], scales fp32 [..., d // 128])`` with
    ``x ≈ values * scale``. For the indexer: q ``[s, h, 128]`` gives one scale per token and
    head (eps 1e-10), k ``[s, 128]`` one per token (eps 1e-4).
    """
    xf = hadamard_128(x) if hadamard else x.float()
    groups = xf.reshape(*x.shape[:-1], x.shape[-1] // QUANT_GROUP, QUANT_GROUP)
    amax = groups.abs().amax(dim=-1)  # NaN if the group holds one
    bad = ~torch.isfinite(amax)  # a NaN or inf in the group: NaN scale and values
    scale = torch.where(bad, torch.full_like(amax, math.nan), ue8m0_scale(amax, eps))
    values = torch.where(bad.unsqueeze(-1), torch.full_like(groups, math.nan), groups / scale.unsqueeze(-1))
    return values.to(torch.float8_e4m3fn).reshape(x.shape), scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    groups = values.float().reshape(*values.shape[:-1], -1, QUANT_GROUP)
    return (groups * scales.unsqueeze(-1)).reshape(values.shape)


# ----------------------------------------------------------------------------- index-K cache

def index_k_cache_insert(k: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, hadamard: bool = False) -> None:
    """Quantize ``k [n, d]`` and write it into ``cache`` uint8 ``[num_blocks, block_size * (d + 4)]``.

    A block holds ``block_size * d`` e4m3 bytes (token-major) and then ``block_size`` fp32
    scales (DESIGN.md §4: 64 x 128 + 64 x 4 = 132 B per token). ``slot_mapping`` int64
    ``[n]``; slot -1 skips the token.
    """
    n, d = k.shape
    block_size = cache.shape[1] // (d + 4)
    values, scales = quantize_fp8(k, INDEX_K_EPS, hadamard)
    for i in range(n):
        slot = int(slot_mapping[i])
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        cache[blk, off * d:(off + 1) * d] = values[i].view(torch.uint8)
        base = block_size * d + off * 4
        cache[blk, base:base + 4] = scales[i].reshape(1).view(torch.uint8)


def index_k_cache_gather(cache: torch.Tensor, d: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(values e4m3 [n, d], scales fp32 [n])`` of the given slots back out of the cache."""
    block_size = cache.shape[1] // (d + 4)
    blk, off = slots // block_size, slots % block_size
    data = cache[:, : block_size * d].reshape(-1, block_size, d)[blk, off]
    sc = cache[:, block_size * d:].reshape(-1, block_size, 4)[blk, off]
    return data.view(torch.float8_e4m3fn), sc.contiguous().view(torch.float32).reshape(-1)


# ----------------------------------------------------------------------------- indexer logits

def indexer_weights(weights: torch.Tensor, q_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fold the softmax constants (h^-1/2 d^-1/2) and q's fp8 scales into the head weights.

    weights fp32 ``[s_q, h]``; q_scale fp32 ``[s_q, h]`` or None (unquantized q). Exact up to
    fp32 rounding because ReLU(a x) = a ReLU(x) for a > 0.
    """
    h = weights.shape[-1]
    w = (weights if weights.dtype == torch.float32 else weights.float()) * (h ** -0.5) * (QUANT_GROUP ** -0.5)
    return w * q_scale if q_scale is not None else w


def indexer_logits(q, k, k_scale, weights, ks, ke) -> torch.Tensor:
    """``logit[t, s] = k_scale[s] * Σ_h weights[t, h] * ReLU(q[t, h] · k[s])`` for ks[t] <= s < ke[t].

    q ``[s_q, h, d]`` and k ``[s_kv, d]`` (d even, <= 256; the DSA indexer's is 128) in e4m3 (with
    k_scale fp32 ``[s_kv]``) or both bf16/fp32 (k_scale None); weights fp32 ``[s_q, h]`` (see :func:`indexer_weights`);
    ks, ke int32 ``[s_q]``. Returns fp32 ``[s_q, s_kv]``, -inf outside each row's window.
    """
    dots = torch.einsum("thd,sd->ths", q.float(), k.float())
    logits = (dots.relu() * weights.float().unsqueeze(-1)).sum(dim=1)  # relu keeps NaN
    if k_scale is not None:
        logits = logits * k_scale.float().unsqueeze(0)
    cols = torch.arange(k.shape[0], device=q.device)
    inside = (cols.unsqueeze(0) >= ks.long().unsqueeze(1)) & (cols.unsqueeze(0) < ke.long().unsqueeze(1))
    return torch.where(inside, logits, torch.full_like(logits, -math.inf))


def decode_windows(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Keys visible to each decode row: row j of request b sees ``seq_len - next_n + j + 1``."""
    j = torch.arange(next_n, device=seq_lens.device)
    return (seq_lens.long().unsqueeze(1) - next_n + j + 1).reshape(-1)


def indexer_logits_paged(q, weights, cache, block_table, seq_lens, next_n: int, max_seq_len: int) -> torch.Tensor:
    """Decode logits read straight from the paged index-K cache.

    q e4m3 ``[B * next_n, h, d]`` (rows grouped by request), weights fp32 ``[B * next_n, h]``,
    cache as :func:`index_k_cache_insert`, block_table int32 ``[B, max_blocks]``, seq_lens
    int32 ``[B]`` (tokens in the cache, drafts included). Returns fp32
    ``[B * next_n, max_seq_len]``; column p is request position p, -inf past the window.
    """
    d = q.shape[-1]
    block_size = cache.shape[1] // (d + 4)
    out = torch.full((q.shape[0], max_seq_len), -math.inf, dtype=torch.float32, device=q.device)
    windows = decode_windows(seq_lens, next_n)
    for b in range(block_table.shape[0]):
        n = int(seq_lens[b])
        if n <= 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_table[b, pos // block_size].long() * block_size + pos % block_size
        kv, ksc = index_k_cache_gather(cache, d, slots)
        rows = slice(b * next_n, (b + 1) * next_n)
        zeros = torch.zeros(next_n, dtype=torch.int32, device=q.device)
        logits = indexer_logits(q[rows], kv, ksc, weights[rows], zeros, windows[rows].int())
        out[rows, :n] = logits
    return out


# ----------------------------------------------------------------------------- top-k

def topk_indices(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, topk: int, width: Optional[int] = None) -> torch.Tensor:
    """Per row, the ``min(topk, ke - ks)`` largest logits in ``[ks, ke)`` as positions ``s - ks``.

    Returns int32 ``[rows, width]`` (width defaults to topk): selected positions ascending,
    then -1. Selection order: value descending, position ascending on ties.
    """
    rows = logits.shape[0]
    width = topk if width is None else width
    out = torch.full((rows, width), -1, dtype=torch.int32, device=logits.device)
    for r in range(rows):
        lo, hi = int(ks[r]), int(ke[r])
        if hi <= lo:
            continue
        vals = logits[r, lo:hi].float()
        k = min(topk, hi - lo)
        # Stable sort by value descending keeps lower positions first among equal values.
        order = torch.sort(vals, descending=True, stable=True).indices[:k]
        out[r, :k] = torch.sort(order).values.int()
    return out


def indexer_topk(q, k, k_scale, weights, ks, ke, topk: int, width: Optional[int] = None) -> torch.Tensor:
    """Fused scoring + top-k, by definition the composition of the two ops."""
    return topk_indices(indexer_logits(q, k, k_scale, weights, ks, ke), ks, ke, topk, width)


def indexer_topk_paged(q, weights, cache, block_table, seq_lens, next_n: int, topk: int, width: Optional[int] = None) -> torch.Tensor:
    max_len = max(int(seq_lens.max()), 1) if seq_lens.numel() else 1
    logits = indexer_logits_paged(q, weights, cache, block_table, seq_lens, next_n, max_len)
    zeros = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
    return topk_indices(logits, zeros, decode_windows(seq_lens, next_n).clamp(min=0).int(), topk, width)


# ----------------------------------------------------------------------------- slots

def positions_to_slots(positions: torch.Tensor, req_of_row: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """``slot = block_table[req, pos // block_size] * block_size + pos % block_size``, keeping -1.

    positions int32 ``[n, k]``, req_of_row int32 ``[n]``, block_table int32 ``[B, max_blocks]``.
    """
    pos = positions.long()
    valid = pos >= 0
    p = pos.clamp(min=0)
    blocks = block_table[req_of_row.long().unsqueeze(1), p // block_size].long()
    slots = blocks * block_size + p % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1)).int()


# ----------------------------------------------------------------------------- MLA KV cache

def mla_kv_cache_insert(kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    """Write the rows ``[kv_c | k_pe]`` of n tokens into the MLA cache at their slots.

    DSA: kv_c ``[n, 512]`` latents, k_pe ``[n, 64]`` RoPE keys, cache ``[num_blocks, block_size,
    576]`` bf16/fp32, or uint8 ``[num_blocks, block_size, 656]`` in the ``fp8_ds_mla`` format: 512
    e4m3, four fp32 scales (max(amax, 1e-4) / 448 per 128 values), 64 bf16 RoPE values.
    DeepSeek-V4: kv_c ``[n, 448]``, k_pe ``[n, 64]`` (the K=V row's last 64, RoPE applied), cache
    ``[.., 512]`` bf16/fp32.
    """
    lat = kv_c.shape[1]
    flat = cache.view(-1, cache.shape[-1])
    for i in range(kv_c.shape[0]):
        slot = int(slot_mapping[i])
        if slot < 0:
            continue
        if cache.dtype == torch.uint8:
            groups = kv_c[i].float().reshape(MLA_FP8_SCALES, QUANT_GROUP)
            amax = groups.abs().amax(dim=-1)
            bad = ~torch.isfinite(amax)  # NaN scale and values, as quantize_fp8
            scale = torch.where(bad, torch.full_like(amax, math.nan), torch.clamp(amax, min=MLA_FP8_EPS) / FP8_MAX)
            vals = torch.where(bad.unsqueeze(-1), torch.full_like(groups, math.nan), groups / scale.unsqueeze(-1))
            vals = vals.to(torch.float8_e4m3fn).reshape(-1)
            flat[slot, :MLA_LATENT] = vals.view(torch.uint8)
            flat[slot, MLA_LATENT:MLA_FP8_SCALE_END] = scale.view(torch.uint8)
            flat[slot, MLA_FP8_SCALE_END:] = k_pe[i].to(torch.bfloat16).view(torch.uint8)
        else:
            flat[slot, :lat] = kv_c[i].to(cache.dtype)
            flat[slot, lat:] = k_pe[i].to(cache.dtype)


def mla_kv_cache_dequant(cache: torch.Tensor) -> torch.Tensor:
    """The cache as fp32 ``[num_slots, row width]``: 576 (dequantized when fp8_ds_mla) or 512."""
    flat = cache.reshape(-1, cache.shape[-1])
    if cache.dtype != torch.uint8:
        return flat.float()
    vals = flat[:, :MLA_LATENT].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, MLA_FP8_SCALES, QUANT_GROUP)
    scales = flat[:, MLA_LATENT:MLA_FP8_SCALE_END].contiguous().view(torch.float32).reshape(-1, MLA_FP8_SCALES, 1)
    rope = flat[:, MLA_FP8_SCALE_END:].contiguous().view(torch.bfloat16).float()
    return torch.cat(((vals * scales).reshape(-1, MLA_LATENT), rope), dim=1)


# ----------------------------------------------------------------------------- sparse MLA

def mla_softmax_scale(qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, mscale_all_dim: float = 1.0,
                      factor: float = 1.0) -> float:
    """``(d_nope + d_rope)^-1/2 * mscale^2`` with ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``."""
    scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    if factor > 1.0 and mscale_all_dim:
        m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
               d_v: int = MLA_LATENT, sinks: Optional[torch.Tensor] = None,
               extra_indices: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of one shared K=V cache head over the selected slots (DESIGN.md §5, §6).

    q ``[s_q, h_q, d_qk]`` (bf16/fp32): d_qk 576 is DSA's absorbed form (512 latent + 64 RoPE),
    512 DeepSeek-V4's shared K=V head (RoPE on its last 64, applied). kv_cache as
    :func:`mla_kv_cache_insert`, rows of d_qk; the value is the first d_v dims of each row (the
    latent for 576, the whole row for V4). indices int32 ``[s_q, topk]`` physical slots, -1 =
    none. extra_indices int32 ``[s_q, n_extra]`` or None: more slots of the same cache (V4: the
    sliding window of raw entries, indices the selected compressed ones); the softmax runs over
    both lists together, each listed valid slot counting once per listing (as duplicates within
    indices do). Returns ``out [s_q, h_q, d_v]`` in q's dtype and ``lse`` fp32 ``[s_q, h_q]``
    (natural log of the softmax denominator of the scaled scores); a row with no valid slot
    gives out 0 and lse -inf. A (row, head) with a valid slot whose score is NaN or +-inf (a
    NaN/inf in q[t, h] or in a selected cache row, or an fp32 overflow) gets NaN in all of
    out[t, h] and in lse[t, h].

    sinks: fp32 ``[h_q]`` or None, one attention-sink logit per head (HY-V4, DeepSeek-V4). It
    joins every row's softmax denominator and has no value row:
    ``out = Σ_i exp(s_i - m) v_i / (exp(sink_h - m) + Σ_i exp(s_i - m))``, ``m`` the max of the
    scores and the sink, and lse includes it. A row with no valid slot still gives out 0, and
    lse = sink_h (log exp(sink_h)). A sink of -inf is exactly no sink; a NaN or +inf sink makes
    out and lse NaN on every row of that head with a valid slot (docs/ops.md).
    """
    kv = mla_kv_cache_dequant(kv_cache)
    idx = indices.long() if extra_indices is None else torch.cat((indices, extra_indices), dim=1).long()
    valid = idx >= 0
    # -1 entries read nothing: a NaN in whatever row they would point at must not leak in.
    gathered = torch.where(valid.unsqueeze(-1), kv[idx.clamp(min=0)], torch.zeros(()))  # [s_q, topk + n_extra, d_qk]
    scores = torch.einsum("thd,tkd->thk", q.float(), gathered) * sm_scale
    bad = (~torch.isfinite(scores) & valid.unsqueeze(1)).any(dim=-1)  # [s_q, h_q]
    if sinks is not None:
        sink_bad = ~(sinks.float() < math.inf)  # NaN or +inf
        bad = bad | (sink_bad.unsqueeze(0) & valid.any(dim=-1, keepdim=True))
    scores = scores.masked_fill(~valid.unsqueeze(1) | bad.unsqueeze(-1), -math.inf)
    if sinks is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        # The sink as one more logit of the denominator (its max is the max with the sink).
        sink_col = sinks.float().reshape(1, -1, 1).expand(scores.shape[0], -1, 1)
        lse = torch.logsumexp(torch.cat((scores, sink_col), dim=-1), dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse.unsqueeze(-1)), nan=0.0)  # all -inf: exp(-inf - -inf)
    out = torch.einsum("thk,tkd->thd", probs, gathered[..., :d_v])
    out = torch.where(bad.unsqueeze(-1), torch.full_like(out, math.nan), out)
    lse = torch.where(bad, torch.full_like(lse, math.nan), lse)
    return out.to(q.dtype), lse


# ----------------------------------------------------------------------------- MiniMax-M3 block-sparse ops
# Defined in reference_block_sparse.py (kept apart for size), part of this module's contract.
from indexcache.reference_block_sparse import (block_scores, block_sparse_attention, block_topk,  # noqa: E402,F401
                                               block_topk_paged, paged_rows, select_blocks)


# ----------------------------------------------------------------------------- a few rows through a weight
# A decode step's projections on the CPU (ops.rows_matmul).

def rows_matmul(x: torch.Tensor, w: torch.Tensor, w_nk: bool = True, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x @ w^T`` (``w_nk``: w ``[.., N, K]``) or ``x @ w`` (w ``[.., K, N]``), x ``[.., M, K]``, in fp32
    from the inputs' values, rounded once to ``out_dtype`` (default x's)."""
    wf = w.float().transpose(-1, -2) if w_nk else w.float()
    return torch.matmul(x.float(), wf).to(out_dtype or x.dtype)


def swiglu_rows(x: torch.Tensor, experts: list, coef: list) -> torch.Tensor:
    """``Σ_e coef[e] · down_e(silu(x gate_e^T) · (x up_e^T))`` in fp32 (``ops.swiglu_rows``): each
    projection by :func:`rows_matmul` rounded to x's dtype, silu rounded, times up rounded, the down
    projection rounded, then widened, times ``coef[e]`` and added in list order."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for (gate, up, down), c in zip(experts, coef):
        g, u = rows_matmul(x, gate), rows_matmul(x, up)
        a = (torch.nn.functional.silu(g.float()).to(x.dtype).float() * u.float()).to(x.dtype)
        out += torch.tensor(c, dtype=torch.float32) * rows_matmul(a, down).float()
    return out



def moe_rows(x: torch.Tensor, experts: list, topk_ids: torch.Tensor, topk_weights: torch.Tensor, first_expert: int,
             num_experts: int, shared: list = ()) -> torch.Tensor:
    """``ops.moe_rows``: per row, :func:`swiglu_rows` over its chosen experts of ``[first_expert,
    first_expert + len(experts))`` in ascending id with their routing weights (as fp32), then the
    shared experts at 1.0."""
    if ((topk_ids < 0) | (topk_ids >= num_experts)).any():
        raise ValueError(f"topk_ids outside [0, {num_experts})")
    out = torch.zeros(x.shape, dtype=torch.float32)
    for m in range(x.shape[0]):
        pairs = sorted((int(e), j) for j, e in enumerate(topk_ids[m].tolist())
                       if first_expert <= e < first_expert + len(experts))
        chosen = [experts[e - first_expert] for e, _ in pairs] + list(shared)
        coef = [float(topk_weights[m, j].float()) for _, j in pairs] + [1.0] * len(shared)
        out[m] = swiglu_rows(x[m:m + 1], chosen, coef)[0]
    return out

# ----------------------------------------------------------------------------- delta-rule linear attention
# GLM-5.3-Flash's Kimi Delta Attention (per-channel gate) and Qwen3.8-Flash-Next's Gated DeltaNet
# (scalar gate) are one recurrence; kernels compute it chunk-wise for prefill, step-wise for decode.

def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Gated delta-rule linear attention over a varlen batch, continuing each sequence's state.

    q, k ``[T, h_k, d_k]`` (bf16/fp32, already normalised as the model does), v ``[T, h_v, d_v]``,
    h_v a multiple of h_k: value head ``h`` reads query/key head ``h // (h_v // h_k)``.
    g fp32 log-decay, ``[T, h_v]`` (one scalar per head and token: Gated DeltaNet) or
    ``[T, h_v, d_k]`` (one per key channel: KDA); beta fp32 ``[T, h_v]``.
    state fp32 ``[n_slots, h_v, d_k, d_v]``, updated in place; cu_seqlens int32 ``[B + 1]``
    (sequence ``b`` is tokens ``cu_seqlens[b]:cu_seqlens[b+1]``); state_indices int32 ``[B]``,
    the state row sequence ``b`` continues (a new sequence's row holds zeros). Per token t of a
    sequence with state S ``[d_k, d_v]`` (per value head)::

        S = diag(exp(g_t)) S                 # a scalar g_t scales all of S
        S = S + beta_t * k_t (v_t - S^T k_t)^T
        o_t = scale * S^T q_t

    Returns o ``[T, h_v, d_v]`` in v's dtype; all arithmetic in fp32.
    """
    group = v.shape[1] // k.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    qf = q.float().repeat_interleave(group, dim=1)
    kf = k.float().repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    starts = cu_seqlens.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        s = state[slot].clone()  # [h_v, d_k, d_v]
        for t in range(starts[b], starts[b + 1]):
            decay = gf[t].exp()
            s = s * (decay[:, None, None] if gf.dim() == 2 else decay[:, :, None])
            pred = torch.einsum("hkv,hk->hv", s, kf[t])
            s = s + kf[t][:, :, None] * ((vf[t] - pred) * bf[t][:, None])[:, None, :]
            out[t] = scale * torch.einsum("hkv,hk->hv", s, qf[t])
        state[slot] = s
    return out.to(v.dtype)


# ----------------------------------------------------------------------------- a decode step's small ops
# ops.rms_norm and ops.rope (the models' RMSNorm and apply_rope take them on the CPU).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x [..., D] / sqrt(mean(x^2) + eps) * weight [D]`` in fp32, rounded once to ``out_dtype`` (default x's)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(out_dtype or x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Pairs (a, b) of ``x [N, R]`` / ``[N, H, R]`` -> (a c - b s, a s + b c), c, s = cos / sin ``[N, R/2]``
    of the row; pairs (x[2i], x[2i+1]) when ``interleaved``, else (x[i], x[i + R/2]); fp32, rounded once."""
    xf = x.float()
    c = cos.float().view((x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],))
    s = sin.float().view(c.shape)
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    ra, rb = a * c - b * s, a * s + b * c
    out = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
    return out.to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- GLM-5.3-Flash's key pools
# The pooled indexer's paged cache (models/blocks/kpool_indexer.py): ops.kpool_pool_paged.

def kpool_pool_shapes(index_raw, index_pool, ape, block_table, ctx_lens, q_lens) -> tuple[int, int]:
    """(P, d) of a kpool_pool_paged call; ValueError naming the first shape / dtype that does not fit."""
    floats = (torch.float32, torch.bfloat16)
    if ape.dim() != 2 or ape.shape[0] < 1 or ape.dtype not in floats:
        raise ValueError(f"ape must be fp32 / bf16 [P, d], got {ape.dtype} {tuple(ape.shape)}")
    p, d = ape.shape
    if index_raw.dim() != 3 or index_raw.shape[2] != 2 * d or index_raw.dtype not in floats:
        raise ValueError(f"index_raw must be fp32 / bf16 [num_blocks, block_size, 2 d = {2 * d}], "
                         f"got {index_raw.dtype} {tuple(index_raw.shape)}")
    nb, bs = index_raw.shape[:2]
    if bs % p:
        raise ValueError(f"the pool size P = {p} must divide the block size {bs}")
    if tuple(index_pool.shape) != (nb, bs // p, d) or index_pool.dtype not in floats:
        raise ValueError(f"index_pool must be fp32 / bf16 [num_blocks, block_size / P, d] = [{nb}, {bs // p}, {d}], "
                         f"got {index_pool.dtype} {tuple(index_pool.shape)}")
    if not (index_raw.is_contiguous() and index_pool.is_contiguous()):
        raise ValueError("index_raw and index_pool must be contiguous (the cache's own tensors)")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [B, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    for t, name in ((ctx_lens, "ctx_lens"), (q_lens, "q_lens")):
        if t.dim() != 1 or t.shape[0] != block_table.shape[0] or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [B = {block_table.shape[0]}], got {t.dtype} {tuple(t.shape)}")
    devices = {t.device for t in (index_raw, index_pool, ape, block_table, ctx_lens, q_lens)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")
    return p, d


def kpool_pool_paged(index_raw: torch.Tensor, index_pool: torch.Tensor, ape: torch.Tensor, block_table: torch.Tensor,
                     ctx_lens: torch.Tensor, q_lens: torch.Tensor) -> None:
    """Pool the pools that complete in a step, in place into ``index_pool``.

    Request b held ``ctx_lens[b]`` tokens and adds ``q_lens[b]``; its pools ``j`` with
    ``ctx_lens[b] // P <= j < (ctx_lens[b] + q_lens[b]) // P`` complete now. Token ``t`` of request
    b sits at ``index_raw[block_table[b, t // bs], t % bs]`` (``[k (d) | gate (d)]``); pool j
    (positions ``[j P, (j + 1) P)``) is, per channel, ``Σ_t softmax_t(gate_t + ape[t mod P]) k_t``
    in fp32, written to ``index_pool[block_table[b, j P // bs], (j P % bs) // P]`` (rounded to its
    dtype). Every other row of ``index_pool`` is left as it was.
    """
    p, d = kpool_pool_shapes(index_raw, index_pool, ape, block_table, ctx_lens, q_lens)
    nb, bs = index_raw.shape[:2]
    ctx, seq = ctx_lens.long(), ctx_lens.long() + q_lens.long()
    if bool((ctx < 0).any()) or bool((q_lens < 0).any()):
        raise ValueError(f"ctx_lens and q_lens must be >= 0, got {ctx_lens.tolist()} and {q_lens.tolist()}")
    done, total = ctx // p, seq // p
    n_new = total - done
    if int(n_new.sum()) == 0:
        return
    if int(total.max()) * p > block_table.shape[1] * bs:
        raise ValueError(f"block_table's {block_table.shape[1]} blocks of {bs} do not hold "
                         f"{int(total.max()) * p} positions")
    req = torch.repeat_interleave(torch.arange(len(n_new), device=n_new.device), n_new)
    starts = torch.cumsum(n_new, 0) - n_new
    first = (done[req] + torch.arange(len(req), device=req.device) - starts[req]) * p  # [N] each pool's first position
    pos = first[:, None] + torch.arange(p, device=req.device)                           # [N, P]
    table = block_table.long()
    blocks = table[req[:, None], pos // bs]
    if bool(((blocks < 0) | (blocks >= nb)).any()):
        raise ValueError(f"block_table holds a block outside [0, {nb}) where a completed pool lies")
    rows = index_raw.reshape(-1, 2 * d)[blocks * bs + pos % bs].float()                  # [N, P, 2 d]
    weights = (rows[..., d:] + ape.float()).softmax(dim=1)
    pooled = (weights * rows[..., :d]).sum(dim=1)
    dest = table[req, first // bs] * (bs // p) + (first % bs) // p
    index_pool.view(-1, d)[dest] = pooled.to(index_pool.dtype)
