"""Typed, documented wrappers over ``torch.ops.indexcache`` (their fake kernels: fake_kernels.py).

Shape names follow DESIGN.md §7: s_q query rows, s_kv keys, h heads, d head dim, topk.
Every op checks dtype, device, strides and shapes in C++ and raises RuntimeError naming
the argument; ``-1`` in an index means "no token" everywhere. Index *values* out of range
(slots, positions, block ids, windows, sequence lengths) raise on CPU; on CUDA they are
treated as invalid and counted, with no host sync (``cuda_error_count``), unless
``INDEXCACHE_CHECK=1`` asks for the CPU's host-side checks and messages.
"""

from __future__ import annotations

import os

import torch

from . import _C  # noqa: F401  (registers the ops)
from . import fake_kernels  # noqa: F401  (registers their fake kernels)

_ops = torch.ops.indexcache


def fill_topk_buffer_(buf: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Set rows ``[:num_rows]`` of a shared top-k buffer to -1, in place.

    buf: int32 ``[max_num_batched_tokens, index_topk]``, rows contiguous (a column slice of a
    wider buffer is fine). ``num_rows`` larger than the buffer is an error. Returns ``buf``.
    """
    _ops.fill_topk_buffer_(buf, num_rows)
    return buf


# Small torch-level helpers that are part of the op contract but are not kernels.
from .reference import decode_windows, hadamard_128, indexer_weights, mla_softmax_scale  # noqa: E402,F401
from .reference import INDEX_K_EPS, INDEX_Q_EPS, kpool_pool_shapes  # noqa: E402,F401


def quantize_fp8(x: torch.Tensor, eps: float, hadamard: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., d]`` (fp32/bf16, contiguous, d % 128 == 0) to e4m3 with one
    power-of-two scale per 128 values: ``scale = 2^ceil(log2(max(amax, eps) / 448))``.

    Returns ``(values float8_e4m3fn [..., d], scales fp32 [..., d // 128])``. ``hadamard``
    rotates each 128-group by the orthonormal Walsh-Hadamard matrix first. For the indexer
    use eps ``INDEX_Q_EPS`` for q ``[s, h, 128]`` and ``INDEX_K_EPS`` for k ``[s, 128]``.
    """
    return _ops.quantize_fp8(x, eps, hadamard)


def index_k_cache_insert(k: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, hadamard: bool = False) -> None:
    """Quantize ``k [n, 128]`` (fp32/bf16) and write it into the paged index-K cache, in place.

    cache: uint8 ``[num_blocks, block_size * 132]``; a block holds block_size x 128 e4m3
    bytes, then block_size fp32 scales. slot_mapping: int64 ``[n]``, -1 skips a token; a
    slot past the cache is an error.
    """
    _ops.index_k_cache_insert(k, slot_mapping, cache, hadamard)


def indexer_logits(q, k, k_scale, weights, ks, ke, out=None) -> torch.Tensor:
    """Prefill indexer logits: ``out[t, s] = k_scale[s] * Σ_h weights[t, h] * ReLU(q[t, h] · k[s])``
    for ``ks[t] <= s < ke[t]``, -inf elsewhere.

    q ``[s_q, h, d]`` and k ``[s_kv, d]``: both float8_e4m3fn (k_scale fp32 ``[s_kv]``
    required) or both bf16/fp32 (k_scale optional). d: the lightning indexer's 128, or any even
    width up to 256 (the key-pooled and QSA indexers; on CUDA a plain kernel, docs/ops.md). weights fp32 ``[s_q, h]`` with q's scales
    and the softmax constants folded in (:func:`indexer_weights`). ks, ke int32 ``[s_q]``.
    out: fp32 ``[s_q, >= s_kv]``, allocated when None; written in place and returned.
    """
    if out is None:
        out = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float32, device=q.device)
    _ops.indexer_logits(q, k, k_scale, weights, ks, ke, out)
    return out


def indexer_logits_paged(q, weights, cache, block_table, seq_lens, next_n: int, max_seq_len: int, out=None) -> torch.Tensor:
    """Decode indexer logits read from the paged index-K cache.

    q float8_e4m3fn ``[B * next_n, h, 128]`` (rows grouped by request), weights fp32
    ``[B * next_n, h]``, block_table int32 ``[B, max_blocks]``, seq_lens int32 ``[B]``.
    Row j of request b sees positions ``[0, seq_len - next_n + j + 1)``. Returns fp32
    ``[B * next_n, max_seq_len]`` (``max_seq_len`` >= every seq_len), -inf past the window.
    """
    if out is None:
        out = torch.empty((q.shape[0], max_seq_len), dtype=torch.float32, device=q.device)
    _ops.indexer_logits_paged(q, weights, cache, block_table, seq_lens, next_n, out)
    return out


def _topk_out(out, rows, topk, width, device):
    if out is None:
        out = torch.empty((rows, topk if width is None else width), dtype=torch.int32, device=device)
    return out


def topk_indices(logits, ks, ke, topk: int, width=None, out=None) -> torch.Tensor:
    """Per row, the ``min(topk, ke - ks)`` largest logits in ``[ks, ke)`` as positions ``s - ks``.

    logits fp32 ``[rows, s_kv]``; ks, ke int32 ``[rows]``. Writes rows ``[:rows]`` of ``out``
    (int32 ``[>= rows, width >= topk]``, e.g. the model's shared top-k buffer): selected
    positions ascending, then -1 to the full width. Ties go to lower positions. Returns
    ``out[:rows]``.
    """
    out = _topk_out(out, logits.shape[0], topk, width, logits.device)
    _ops.topk_indices(logits, ks, ke, topk, out)
    return out[: logits.shape[0]]


def indexer_topk(q, k, k_scale, weights, ks, ke, topk: int, width=None, out=None) -> torch.Tensor:
    """Fused :func:`indexer_logits` + :func:`topk_indices`: same arguments and result, but the
    ``[s_q, s_kv]`` logits are never stored (memory independent of s_kv)."""
    out = _topk_out(out, q.shape[0], topk, width, q.device)
    _ops.indexer_topk(q, k, k_scale, weights, ks, ke, topk, out)
    return out if out.shape[0] == q.shape[0] else out[: q.shape[0]]


def indexer_topk_paged(q, weights, cache, block_table, seq_lens, next_n: int, topk: int, width=None, out=None) -> torch.Tensor:
    """Fused :func:`indexer_logits_paged` + top-k over each row's decode window."""
    out = _topk_out(out, q.shape[0], topk, width, q.device)
    _ops.indexer_topk_paged(q, weights, cache, block_table, seq_lens, next_n, topk, out)
    return out if out.shape[0] == q.shape[0] else out[: q.shape[0]]


def positions_to_slots(positions, req_of_row, block_table, block_size: int, num_blocks=None, out=None) -> torch.Tensor:
    """``slot = block_table[req, pos // block_size] * block_size + pos % block_size``, -1 kept.

    positions int32 ``[n, k]``, req_of_row int32 ``[n]`` (request of each row), block_table
    int32 ``[B, max_blocks]``. ``num_blocks`` (the cache's) bounds the block ids read; a
    position past the table or a block id outside the cache is an error.
    """
    if out is None:
        out = torch.empty_like(positions)
    _ops.positions_to_slots(positions, req_of_row, block_table, block_size,
                            2**31 - 1 if num_blocks is None else num_blocks, out)
    return out


def mla_kv_cache_insert(kv_c, k_pe, slot_mapping, cache) -> None:
    """Write rows ``[kv_c | k_pe]`` into the MLA cache at their slots, in place.

    DSA: latents ``kv_c [n, 512]``, RoPE keys ``k_pe [n, 64]``, cache bf16/fp32 ``[num_blocks,
    block_size, 576]`` or uint8 ``[num_blocks, block_size, 656]`` (fp8_ds_mla: 512 e4m3, 4 fp32
    scales = max(amax, 1e-4) / 448 per 128, 64 bf16 RoPE). DeepSeek-V4: the K=V row split as
    ``kv_c [n, 448]`` + ``k_pe [n, 64]`` (its last 64, RoPE applied) into a bf16/fp32 ``[..,
    512]`` cache. kv_c and k_pe contiguous, one dtype. slot_mapping int64 ``[n]``, -1 skips.
    """
    _ops.mla_kv_cache_insert(kv_c, k_pe, slot_mapping, cache)


def sparse_mla(q, kv_cache, indices, sm_scale: float, d_v: int = 512, out=None, lse=None, sinks=None,
               extra_indices=None):
    """Sparse attention of one shared K=V cache head over selected slots (DESIGN.md §5, §6).

    q bf16/fp32 ``[s_q, h_q, d_qk]``: d_qk 576 (DSA's absorbed form: 512 latent + 64 RoPE) or
    512 (DeepSeek-V4's shared K=V head, RoPE on its last 64 already applied). kv_cache as
    :func:`mla_kv_cache_insert`, rows of d_qk (fp8_ds_mla only for 576); the value is the first
    d_v dims of each row (for 512: the whole row, K = V). indices int32 ``[s_q, topk]`` physical
    slots, -1 = none. Returns ``(out [s_q, h_q, d_v] in q's dtype, lse fp32 [s_q, h_q])``; rows
    with no valid slot give 0 and -inf.

    sinks: fp32 ``[h_q]`` (contiguous, q's device) or None: one attention-sink logit per head
    that joins every row's softmax denominator with no value row (HY-V4, DeepSeek-V4). lse
    includes it; a row with no valid slot still gives 0, with lse = the sink. -inf is no sink;
    NaN / +inf make the head's out and lse NaN on rows with a valid slot (docs/ops.md).

    extra_indices: int32 ``[s_q, n_extra]`` (contiguous, q's device) or None: a second list of
    physical slots into the same cache (V4: the sliding window of raw entries, with indices the
    selected compressed entries). The softmax runs over both lists together; each listed valid
    slot counts once per listing, as duplicates within indices do.
    """
    # The op checks every argument (csrc/checks.h); the outputs allocated here take q's first two
    # dims whatever q's rank, so a wrong q reaches those checks and their message.
    if out is None:
        out = q.new_empty((*q.shape[:2], max(d_v, 0)))
    if lse is None:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    _ops.sparse_mla(q, kv_cache, indices, sm_scale, d_v, out, lse, sinks, extra_indices)
    return out, lse


def block_topk(q, k, ks, ke, block_size: int, topk_blocks: int, local_blocks: int, out=None) -> torch.Tensor:
    """MiniMax-M3 indexer, prefill: block scoring + block top-k (DESIGN.md §6).

    q ``[s_q, h, d]`` and k ``[s_kv, d]`` (both bf16 or both fp32, contiguous; one key head
    shared by the h indexer heads); ks, ke int32 ``[s_q]``: row t's request keys are
    ``k[ks[t]:ke[t]]`` and its query sits at request position ``ke[t] - ks[t] - 1``. Scores are
    fp32 dot products max-pooled over blocks of ``block_size`` keys; the ``local_blocks`` blocks
    ending at the query are always kept, then the best blocks up to ``topk_blocks``.
    Returns int32 ``[s_q, h, topk_blocks]``: request-relative block ids ascending, then -1.
    out: that tensor, allocated when None. Never materialises ``[s_q, s_kv]`` scores.
    """
    if out is None:
        out = torch.empty((q.shape[0], q.shape[1], topk_blocks), dtype=torch.int32, device=q.device)
    elif out.dim() == 3 and out.shape[2] != topk_blocks:
        raise ValueError(f"out has {out.shape[2]} columns but topk_blocks is {topk_blocks}")
    _ops.block_topk(q, k, ks, ke, block_size, local_blocks, out)
    return out


def block_topk_paged(q, k_cache, block_table, seq_lens, next_n: int, block_size: int, topk_blocks: int,
                     local_blocks: int, out=None) -> torch.Tensor:
    """MiniMax-M3 indexer, paged decode: :func:`block_topk` with keys read from a paged cache.

    q ``[B * next_n, h, d]`` (rows grouped by request); k_cache ``[num_pages, page_size, d]``
    in q's dtype; block_table int32 ``[B, max_pages]``; seq_lens int32 ``[B]`` (tokens in the
    cache, drafts included): row j of request b sees ``seq_len - next_n + j + 1`` keys.
    """
    if out is None:
        out = torch.empty((q.shape[0], q.shape[1], topk_blocks), dtype=torch.int32, device=q.device)
    elif out.dim() == 3 and out.shape[2] != topk_blocks:
        raise ValueError(f"out has {out.shape[2]} columns but topk_blocks is {topk_blocks}")
    _ops.block_topk_paged(q, k_cache, block_table, seq_lens, next_n, block_size, local_blocks, out)
    return out


def block_sparse_attention(q, k_cache, v_cache, block_table, req, pos, blocks, block_size: int, scale: float,
                           out=None):
    """MiniMax-M3 block-sparse GQA attention over a paged KV cache (prefill and decode).

    q ``[s_q, h_q, d]`` bf16/fp32; k_cache, v_cache ``[num_pages, page_size, h_kv, d]`` in q's
    dtype; block_table int32 ``[B, max_pages]``; req, pos int32 ``[s_q]`` (each row's request and
    request position; keys ``[0, pos]`` are causal); blocks int32 ``[s_q, h_kv, topk]`` block ids
    per KV head (:func:`block_topk`), -1 = none, duplicates count once. Query head h reads KV
    head ``h // (h_q // h_kv)``. Returns ``(out [s_q, h_q, d] in q's dtype, lse fp32 [s_q, h_q])``;
    a row with no key gives 0 and -inf. out: an ``(out, lse)`` pair to write, allocated when None.
    """
    if out is None:
        out = (torch.empty_like(q), torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device))
    out, lse = out
    _ops.block_sparse_attention(q, k_cache, v_cache, block_table, req, pos, blocks, block_size, scale, out, lse)
    return out, lse


def _delta_rule_args(q, k, v, g, beta, state, cu_seqlens, state_indices) -> None:
    """The delta-rule contract, checked before the op with ValueErrors naming the field."""
    names = ("q", "k", "v", "g", "beta", "state", "cu_seqlens", "state_indices")
    tensors = (q, k, v, g, beta, state, cu_seqlens, state_indices)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in zip(names[1:], tensors[1:]):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: every argument must be on one device")
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    for name, t in (("g", g), ("beta", beta), ("state", state)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    for name, t in (("cu_seqlens", cu_seqlens), ("state_indices", state_indices)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [T, heads, dim], got shape {tuple(t.shape)}")
        if (t.shape[2] > 1 and t.stride(2) != 1) or (t.shape[1] > 1 and t.stride(1) != t.shape[2]):
            raise ValueError(f"{name}'s [heads, dim] rows must be contiguous (any token stride), "
                             f"got strides {t.stride()}")
    T, h_k, d_k = q.shape
    h_v, d_v = v.shape[1], v.shape[2]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [T, h_k, d_k] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[0] != T:
        raise ValueError(f"v must have q's {T} tokens, got shape {tuple(v.shape)}")
    if min(h_k, h_v, d_k, d_v) < 1:
        raise ValueError(f"q, k and v need at least one head and one channel, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if h_v % h_k:
        raise ValueError(f"v's {h_v} heads (h_v) must be a multiple of q and k's {h_k} (h_k)")
    if tuple(g.shape) not in ((T, h_v), (T, h_v, d_k)):
        raise ValueError(f"g must be [T, h_v] = [{T}, {h_v}] or [T, h_v, d_k] = [{T}, {h_v}, {d_k}], "
                         f"got {tuple(g.shape)}")
    if tuple(beta.shape) != (T, h_v):
        raise ValueError(f"beta must be [T, h_v] = [{T}, {h_v}], got {tuple(beta.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (h_v, d_k, d_v):
        raise ValueError(f"state must be [n_slots, h_v, d_k, d_v] = [n_slots, {h_v}, {d_k}, {d_v}], "
                         f"got {tuple(state.shape)}")
    for name, t in (("g", g), ("beta", beta), ("state", state), ("cu_seqlens", cu_seqlens),
                    ("state_indices", state_indices)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-d with batch + 1 entries, got shape {tuple(cu_seqlens.shape)}")
    batch = cu_seqlens.shape[0] - 1
    if tuple(state_indices.shape) != (batch,):
        raise ValueError(f"state_indices must have batch = {batch} entries (cu_seqlens has batch + 1), "
                         f"got shape {tuple(state_indices.shape)}")
    # Values: always on CPU; on CUDA only with INDEXCACHE_CHECK=1 (a host copy and a sync), else
    # the kernel skips and counts an invalid sequence (cuda_error_count), as the other ops do.
    if q.device.type == "cuda" and os.environ.get("INDEXCACHE_CHECK", "") in ("", "0"):
        return
    cu, si = cu_seqlens.cpu(), state_indices.cpu()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(cu[0])}")
    if batch and bool((cu[1:] < cu[:-1]).any()):
        b = int(torch.nonzero(cu[1:] < cu[:-1])[0])
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{b}] = {int(cu[b])} > "
                         f"cu_seqlens[{b + 1}] = {int(cu[b + 1])}")
    if int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens[-1] must be T = {T} (every token in a sequence), got {int(cu[-1])}")
    n_slots = state.shape[0]
    bad = (si < 0) | (si >= n_slots)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise ValueError(f"state_indices[{b}] = {int(si[b])} is outside the state's {n_slots} slots")
    if si.unique().numel() != batch:
        raise ValueError("state_indices must be distinct (two sequences cannot continue one state row), "
                         f"got {si.tolist()}")


def delta_rule(q, k, v, g, beta, state, cu_seqlens, state_indices, scale: float) -> torch.Tensor:
    """Gated delta-rule linear attention over a varlen batch (GLM-5.3-Flash's KDA, Qwen3.8-Flash-Next's
    Gated DeltaNet; :func:`indexcache.reference.delta_rule` is the definition), updating ``state``.

    q, k ``[T, h_k, d_k]`` and v ``[T, h_v, d_v]`` in one dtype (bf16 or fp32; q and k already
    normalised as the model does; each token's ``[heads, dim]`` block contiguous, any stride
    between tokens), h_v a multiple of h_k (value head h reads query/key head ``h // (h_v //
    h_k)``). g fp32 log-decay ``[T, h_v]`` (one per head: Gated DeltaNet) or ``[T, h_v, d_k]``
    (one per key channel: KDA); beta fp32 ``[T, h_v]``. state fp32 ``[n_slots, h_v, d_k, d_v]``
    (contiguous), updated in place: sequence b (tokens ``cu_seqlens[b]:cu_seqlens[b+1]``,
    cu_seqlens int32 ``[B + 1]`` from 0 to T) continues row ``state_indices[b]`` (int32 ``[B]``,
    distinct; a new sequence's row must hold zeros). Per token::

        S = diag(exp(g_t)) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t

    Returns o ``[T, h_v, d_v]`` in v's dtype, computed in fp32. Decode is the same call with one
    token per sequence. Raises ValueError naming the field for a bad argument.
    """
    _delta_rule_args(q, k, v, g, beta, state, cu_seqlens, state_indices)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _ops.delta_rule(q, k, v, g, beta, state, cu_seqlens, state_indices, float(scale), out)
    return out


def rows_matmul(x: torch.Tensor, w: torch.Tensor, w_nk: bool = True, out: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A few rows through a weight, CPU only (a decode step's projections): ``w_nk`` True:
    ``out[g, m, n] = Σ_k x[g, m, k] · w[g, n, k]`` (``x @ w^T``: ``w`` is a linear layer's ``[out, in]``
    weight), False: ``Σ_k x[g, m, k] · w[g, k, n]`` (``x @ w``). x ``[M, K]`` with w 2-D, or
    ``[G, M, K]`` with w 3-D (one matrix per g, e.g. per head); fp32 or bf16 each, any strides
    with the last dim contiguous (a transposed view of per-head rows is fine). Products are summed
    in fp32 in a fixed order per element (independent of the thread count) and rounded once to
    ``out``'s dtype (default x's); ``out`` (last dim contiguous, may be a view) is written in place.
    :func:`indexcache.reference.rows_matmul` is the definition.
    """
    if x.dim() not in (2, 3) or w.dim() != x.dim():
        raise ValueError(f"rows_matmul takes x [M, K] with w 2-D or x [G, M, K] with w 3-D, got x {tuple(x.shape)} "
                         f"and w {tuple(w.shape)}")
    g = (x.shape[0],) if x.dim() == 3 else ()
    if out is None:
        n = w.shape[-2] if w_nk else w.shape[-1]
        out = torch.empty(*g, x.shape[-2], n, dtype=out_dtype or x.dtype, device=x.device)
    _ops.rows_matmul(x, w, bool(w_nk), out)
    return out


def swiglu_rows(x: torch.Tensor, experts: list, coef: list, out: torch.Tensor | None = None) -> torch.Tensor:
    """A few rows through a weighted list of SwiGLU MLPs, CPU only (a decode step's one-row MoE, or a
    dense MLP with ``coef`` ``[1.0]``): ``experts`` a list of ``(gate [I, D], up [I, D], down [D, I])``
    weights, ``coef`` one float per expert; returns fp32 ``out [M, D] = Σ_e coef[e] · down_e(silu(x
    gate_e^T) · (x up_e^T))``, summed in list order, with every intermediate rounded to x's dtype as
    the module's ops round them. :func:`indexcache.reference.swiglu_rows` is the definition."""
    if len(experts) != len(coef):
        raise ValueError(f"swiglu_rows needs one coef per expert, got {len(experts)} experts and {len(coef)} coefs")
    if any(len(e) != 3 for e in experts):
        raise ValueError("swiglu_rows takes each expert as a (gate, up, down) triple of weights")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _ops.swiglu_rows(x, [e[0] for e in experts], [e[1] for e in experts], [e[2] for e in experts],
                     [float(c) for c in coef], out)
    return out



def moe_rows(x: torch.Tensor, experts: list, topk_ids: torch.Tensor, topk_weights: torch.Tensor, first_expert: int,
             num_experts: int, shared: list = (), out: torch.Tensor | None = None) -> torch.Tensor:
    """A few rows' MoE with its routing as tensors, CPU only (a compiled or static decode step: no
    host reads before the call): ``experts`` this rank's routed experts ``[first_expert, first_expert
    + len(experts))`` and ``shared`` the shared ones, each a ``(gate [I, D], up [I, D], down [D, I])``
    triple; ``topk_ids`` ``[M, k]`` ids in ``[0, num_experts)`` (other ranks' skipped), ``topk_weights``
    ``[M, k]``. Returns fp32 ``out [M, D]``: row m's chosen experts in ascending id, each times its
    weight, then the shared ones at 1.0, as :func:`swiglu_rows` sums them.
    :func:`indexcache.reference.moe_rows` is the definition."""
    every = list(experts) + list(shared)
    if any(len(e) != 3 for e in every):
        raise ValueError("moe_rows takes each expert as a (gate, up, down) triple of weights")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _ops.moe_rows(x, [e[0] for e in every], [e[1] for e in every], [e[2] for e in every], topk_ids, topk_weights,
                  int(first_expert), int(num_experts), len(shared), out)
    return out

def _error_word(device) -> torch.Tensor | None:
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return None  # the CPU ops raise on invalid entries instead of counting them
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _ops.cuda_error_word(torch.empty(0, device=device))


def cuda_error_count(device=None) -> int:
    """How many out-of-range index entries the CUDA ops on ``device`` met since the last reset.

    By default the CUDA ops validate indices, slots, positions, block ids, windows and
    sequence lengths on the device, with no host copy or sync (so the decode step can be
    captured in a CUDA graph): an out-of-range entry is treated as invalid (``-1``, an
    empty window or an empty request) and counted here. Reading the count is one
    device-to-host copy (a sync), when the caller chooses. ``INDEXCACHE_CHECK=1`` restores
    the CPU ops' host-side checks and error messages on CUDA. Always 0 for a CPU device.
    """
    word = _error_word(device)
    return 0 if word is None else int(word.item())


def reset_cuda_error_count(device=None) -> None:
    """Sets the error count of ``device`` back to 0 (stream-ordered, no sync)."""
    word = _error_word(device)
    if word is not None:
        word.zero_()



# ----------------------------------------------------------------------------- a decode step's small ops (CPU)

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x [..., D]`` (fp32 or bf16, last dim contiguous) with ``weight [D]``
    (fp32 or bf16), CPU only: ``x / sqrt(mean(x^2) + eps) * weight`` in fp32, rounded once to
    ``out``'s dtype (default x's). Each row's sum of squares has a fixed order (thread-count and
    ISA independent). :func:`indexcache.reference.rms_norm` is the definition."""
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm takes x [..., D] and weight [D], got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    if x.dim() == 2:  # decode rows: no reshapes around the call
        o = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
        _ops.rms_norm(x, weight, float(eps), o)
        return o
    x2 = x.reshape(-1, x.shape[-1])
    o = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if out is None else out.view(x2.shape)
    _ops.rms_norm(x2, weight, float(eps), o)
    return o.view(x.shape) if out is None else out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of ``x [N, R]`` or ``[N, H, R]`` (fp32 or bf16, last dim contiguous) by
    per-row angles, CPU only: cos / sin fp32 ``[N, R / 2]``; pairs (x[2i], x[2i + 1]) when
    ``interleaved``, else (x[i], x[i + R/2]); each pair (a, b) -> (a c - b s, a s + b c) in fp32,
    rounded once to ``out``'s dtype (default x's). ``out`` may be ``x`` itself (in place).
    :func:`indexcache.reference.rope` is the definition."""
    if x.dim() not in (2, 3):
        raise ValueError(f"rope takes x [N, R] or [N, H, R], got shape {tuple(x.shape)}")
    o = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if o.shape != x.shape:
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(o.shape)}")
    if x.dim() == 3:
        x3, o3 = x, o
    else:  # in place (o is x): one view for both
        x3 = x.unsqueeze(1)
        o3 = x3 if o is x else o.unsqueeze(1)
    _ops.rope(x3, cos, sin, bool(interleaved), o3)
    return o


# ----------------------------------------------------------------------------- GLM-5.3-Flash's key pools

def kpool_pool_paged(index_raw: torch.Tensor, index_pool: torch.Tensor, ape: torch.Tensor, block_table: torch.Tensor,
                     ctx_lens: torch.Tensor, q_lens: torch.Tensor) -> None:
    """The pooled indexer's pools completing in a paged step, one call for the batch, in place into
    ``index_pool [num_blocks, block_size / P, d]`` from ``index_raw [num_blocks, block_size, 2 d]``
    (each token's ``k | gate``; both contiguous, fp32 or bf16), ``ape [P, d]`` (fp32 or bf16),
    ``block_table`` int32 ``[B, max_blocks]``, ``ctx_lens`` / ``q_lens`` int32 ``[B]``: request b's
    pools j with ``ctx_lens[b] // P <= j < (ctx_lens[b] + q_lens[b]) // P``, each channel's
    ``Σ_t softmax_t(gate_t + ape[t mod P]) k_t`` in fp32 with a fixed order (thread-count independent).
    No other row of ``index_pool`` is touched. :func:`indexcache.reference.kpool_pool_paged` is the
    definition; shapes and dtypes that do not fit are ValueErrors, bad lengths or block ids the CPU
    op's errors (on CUDA: skipped and counted, ``cuda_error_count``, unless ``INDEXCACHE_CHECK=1``)."""
    kpool_pool_shapes(index_raw, index_pool, ape, block_table, ctx_lens, q_lens)
    _ops.kpool_pool_paged(index_raw, index_pool, ape.contiguous(), block_table.contiguous(), ctx_lens.contiguous(),
                          q_lens.contiguous())
