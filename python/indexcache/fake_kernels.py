"""The fake (meta) kernels of ``torch.ops.indexcache``: what ``torch.compile``, ``opcheck`` and
``FakeTensorMode`` run instead of the kernels. Each checks its arguments' dtypes and shapes with
``torch._check`` as ``csrc/checks.h`` and ``csrc/block_sparse_checks.h`` do (the same names and
bounds, so a wrong shape fails at trace time, not at the first real call), then returns what the
op returns. Index *values* (slots, windows, block ids) are data: only the kernels can check them.
Imported by :mod:`indexcache.ops`, which registers the ops first.
"""

from __future__ import annotations

import torch

from .formats import (FP8_DS_MLA_BYTES, INDEX_HEAD_DIM, INDEX_K_BYTES, MAX_INDEXER_HEAD_DIM, MLA_KV_WIDTH, MLA_LATENT,
                      MLA_ROPE, QUANT_GROUP)

FLOATS = (torch.float32, torch.bfloat16)


def _dtype(t, dtypes, name: str) -> None:
    want = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    torch._check(t.dtype in want, lambda: f"{name} must be {' or '.join(map(str, want))}, got {t.dtype}")


def _dim(t, n: int, name: str) -> None:
    torch._check(t.dim() == n, lambda: f"{name} must have {n} dims, got shape {tuple(t.shape)}")


def _vec(t, n, name: str, dtype=torch.int32) -> None:
    """An int vector of `n` entries (ks, ke, seq_lens, req, pos, slot_mapping)."""
    _dtype(t, dtype, name)
    _dim(t, 1, name)
    torch._check(t.shape[0] == n, lambda: f"{name} has {t.shape[0]} entries for {n} rows")


def _block_table(t) -> None:
    _dtype(t, torch.int32, "block_table")
    _dim(t, 2, "block_table")


def _topk_buffer(out, rows, topk) -> None:
    _dtype(out, torch.int32, "topk buffer")
    _dim(out, 2, "topk buffer")
    torch._check(topk >= 1, lambda: f"topk must be >= 1, got {topk}")
    torch._check(topk <= out.shape[1], lambda: f"topk={topk} exceeds the topk buffer's width {out.shape[1]}")
    torch._check(rows <= out.shape[0],
                 lambda: f"{rows} tokens exceed the topk buffer's {out.shape[0]} rows (max_num_batched_tokens)")


def _logits_out(out, rows, min_cols) -> None:
    _dtype(out, torch.float32, "logits out")
    _dim(out, 2, "logits out")
    torch._check(out.shape[0] == rows, lambda: f"logits out has {out.shape[0]} rows, expected {rows}")
    torch._check(out.shape[1] >= min_cols,
                 lambda: f"logits out has {out.shape[1]} columns but the keys need {min_cols}")


def _index_cache(cache) -> None:
    _dtype(cache, torch.uint8, "index_k_cache")
    _dim(cache, 2, "index_k_cache")
    torch._check(cache.shape[1] > 0 and cache.shape[1] % INDEX_K_BYTES == 0,
                 lambda: f"index_k_cache rows must hold block_size * {INDEX_K_BYTES} bytes, got {cache.shape[1]}")


def _indexer(q, k, k_scale, weights, ks, ke) -> None:
    """make_indexer_params: q [s_q, h, d], k [s_kv, d] of one dtype (d even, <= 256), k_scale, weights, windows."""
    _dim(q, 3, "q")
    _dim(k, 2, "k")
    _dtype(q, (torch.float8_e4m3fn, *FLOATS), "q")
    _dtype(k, q.dtype, "k")
    torch._check(q.shape[2] == k.shape[1],
                 lambda: f"q [s_q, h, d] and k [s_kv, d] need one head width d, got {tuple(q.shape)} and {tuple(k.shape)}")
    torch._check(q.shape[2] % 2 == 0 and 2 <= q.shape[2] <= MAX_INDEXER_HEAD_DIM,
                 lambda: f"the indexer head width d must be even and in [2, {MAX_INDEXER_HEAD_DIM}], got {q.shape[2]}")
    torch._check(q.dtype != torch.float8_e4m3fn or k_scale is not None, lambda: "fp8 k needs k_scale [s_kv]")
    if k_scale is not None:
        _dtype(k_scale, torch.float32, "k_scale")
        torch._check(k_scale.dim() == 1 and k_scale.shape[0] == k.shape[0],
                     lambda: f"k_scale must be [{k.shape[0]}], got {tuple(k_scale.shape)}")
    _weights(weights, q)
    _vec(ks, q.shape[0], "ks")
    _vec(ke, q.shape[0], "ke")


def _weights(weights, q) -> None:
    _dtype(weights, torch.float32, "weights")
    torch._check(weights.dim() == 2 and weights.shape[0] == q.shape[0] and weights.shape[1] == q.shape[1],
                 lambda: f"weights must be [s_q, h] = [{q.shape[0]}, {q.shape[1]}], got {tuple(weights.shape)}")


def _paged(q, weights, cache, block_table, seq_lens, next_n) -> None:
    """make_paged_params: fp8 q [B * next_n, h, 128], the index-K cache, a table and lengths per request."""
    _dtype(q, torch.float8_e4m3fn, "q")
    _dim(q, 3, "q")
    torch._check(q.shape[2] == INDEX_HEAD_DIM, lambda: f"q must be [rows, h, 128], got {tuple(q.shape)}")
    _index_cache(cache)
    _paged_rows(q, block_table, seq_lens, next_n)
    _weights(weights, q)


def _paged_rows(q, block_table, seq_lens, next_n) -> None:
    """A paged decode batch: block_table [B, max_blocks], seq_lens [B], q's B * next_n rows."""
    _block_table(block_table)
    torch._check(next_n >= 1, lambda: f"next_n must be >= 1, got {next_n}")
    _vec(seq_lens, block_table.shape[0], "seq_lens")
    torch._check(q.shape[0] == block_table.shape[0] * next_n,
                 lambda: f"q has {q.shape[0]} rows; expected batch * next_n = {block_table.shape[0]} * {next_n}")


@torch.library.register_fake("indexcache::fill_topk_buffer_")
def _fill_topk_buffer(buf, num_rows):
    _dtype(buf, torch.int32, "topk buffer")
    _dim(buf, 2, "topk buffer")
    torch._check(0 <= num_rows <= buf.shape[0],
                 lambda: f"num_rows={num_rows} must be in [0, {buf.shape[0]}] (the topk buffer's rows)")


@torch.library.register_fake("indexcache::quantize_fp8")
def _quantize_fp8(x, eps, hadamard):
    _dtype(x, FLOATS, "x")
    torch._check(x.dim() >= 1 and x.shape[-1] % QUANT_GROUP == 0,
                 lambda: f"x's last dim must be a multiple of 128, got shape {tuple(x.shape)}")
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], x.shape[-1] // QUANT_GROUP), dtype=torch.float32))


@torch.library.register_fake("indexcache::index_k_cache_insert")
def _index_k_cache_insert(k, slot_mapping, cache, hadamard):
    _dtype(k, FLOATS, "k")
    _dim(k, 2, "k")
    torch._check(k.shape[1] == INDEX_HEAD_DIM, lambda: f"k must be [n, 128], got {tuple(k.shape)}")
    _index_cache(cache)
    _vec(slot_mapping, k.shape[0], "slot_mapping", torch.int64)


@torch.library.register_fake("indexcache::indexer_logits")
def _indexer_logits(q, k, k_scale, weights, ks, ke, out):
    _indexer(q, k, k_scale, weights, ks, ke)
    _logits_out(out, q.shape[0], k.shape[0])


@torch.library.register_fake("indexcache::indexer_logits_paged")
def _indexer_logits_paged(q, weights, cache, block_table, seq_lens, next_n, out):
    _paged(q, weights, cache, block_table, seq_lens, next_n)
    _logits_out(out, q.shape[0], 0)


@torch.library.register_fake("indexcache::topk_indices")
def _topk_indices(logits, ks, ke, topk, out):
    _dtype(logits, torch.float32, "logits")
    _dim(logits, 2, "logits")
    _vec(ks, logits.shape[0], "ks")
    _vec(ke, logits.shape[0], "ke")
    _topk_buffer(out, logits.shape[0], topk)


@torch.library.register_fake("indexcache::indexer_topk")
def _indexer_topk(q, k, k_scale, weights, ks, ke, topk, out):
    _indexer(q, k, k_scale, weights, ks, ke)
    _topk_buffer(out, q.shape[0], topk)


@torch.library.register_fake("indexcache::indexer_topk_paged")
def _indexer_topk_paged(q, weights, cache, block_table, seq_lens, next_n, topk, out):
    _paged(q, weights, cache, block_table, seq_lens, next_n)
    _topk_buffer(out, q.shape[0], topk)


@torch.library.register_fake("indexcache::positions_to_slots")
def _positions_to_slots(positions, req_of_row, block_table, block_size, num_blocks, slots):
    _dtype(positions, torch.int32, "positions")
    _dim(positions, 2, "positions")
    _vec(req_of_row, positions.shape[0], "req_of_row")
    _block_table(block_table)
    torch._check(block_size >= 1, lambda: f"block_size must be >= 1, got {block_size}")
    torch._check(num_blocks >= 1, lambda: f"num_blocks must be >= 1, got {num_blocks}")
    _dtype(slots, torch.int32, "slots")
    torch._check(slots.shape == positions.shape,
                 lambda: f"slots must have positions' shape {tuple(positions.shape)}, got {tuple(slots.shape)}")


@torch.library.register_fake("indexcache::mla_kv_cache_insert")
def _mla_kv_cache_insert(kv_c, k_pe, slot_mapping, cache):
    _dtype(kv_c, FLOATS, "kv_c")
    _dtype(k_pe, kv_c.dtype, "k_pe")
    _dim(kv_c, 2, "kv_c")
    _dim(k_pe, 2, "k_pe")
    torch._check(k_pe.shape[1] == MLA_ROPE and k_pe.shape[0] == kv_c.shape[0],
                 lambda: f"k_pe must be [{kv_c.shape[0]}, {MLA_ROPE}], got {tuple(k_pe.shape)}")
    if cache.dtype == torch.uint8:
        torch._check(cache.shape[-1] == FP8_DS_MLA_BYTES,
                     lambda: f"an fp8_ds_mla cache (uint8) must have rows of 656 bytes, got {tuple(cache.shape)}")
        torch._check(kv_c.shape[1] == MLA_LATENT,
                     lambda: f"kv_c must be [n, 512] for an fp8_ds_mla cache, got {tuple(kv_c.shape)}")
    else:
        _dtype(cache, FLOATS, "mla_kv_cache")
        torch._check(kv_c.shape[1] + MLA_ROPE == cache.shape[-1] and cache.shape[-1] in (MLA_KV_WIDTH, MLA_LATENT),
                     lambda: f"kv_c {tuple(kv_c.shape)} + 64 RoPE values must fill the MLA cache's rows of 576 (DSA) "
                             f"or 512 (DeepSeek-V4), got {tuple(cache.shape)}")
    _vec(slot_mapping, kv_c.shape[0], "slot_mapping", torch.int64)


def _mla_slot_list(idx, q, name: str) -> None:
    _dtype(idx, torch.int32, name)
    _dim(idx, 2, name)
    torch._check(idx.shape[0] == q.shape[0], lambda: f"{name} has {idx.shape[0]} rows for {q.shape[0]} queries")


@torch.library.register_fake("indexcache::sparse_mla")
def _sparse_mla(q, kv_cache, indices, sm_scale, d_v, out, lse, sinks=None, extra_indices=None):
    _dtype(q, FLOATS, "q")
    _dim(q, 3, "q")
    d_qk = q.shape[2]
    torch._check(d_qk in (MLA_KV_WIDTH, MLA_LATENT),
                 lambda: f"q must be [s_q, h_q, 576] (absorbed DSA) or [s_q, h_q, 512] (DeepSeek-V4), "
                         f"got {tuple(q.shape)}")
    row = FP8_DS_MLA_BYTES if kv_cache.dtype == torch.uint8 else d_qk
    torch._check(kv_cache.dtype != torch.uint8 or d_qk == MLA_KV_WIDTH,
                 lambda: f"an fp8_ds_mla cache holds 576-wide rows, but q has d_qk {d_qk}")
    _dtype(kv_cache, (torch.uint8, *FLOATS), "kv_cache")
    torch._check(kv_cache.shape[-1] == row, lambda: f"kv_cache must have rows of {row}, got {tuple(kv_cache.shape)}")
    _mla_slot_list(indices, q, "indices")
    if extra_indices is not None:
        _mla_slot_list(extra_indices, q, "extra_indices")
    torch._check(0 < d_v <= MLA_LATENT and d_v % 64 == 0,
                 lambda: f"d_v must be a multiple of 64 in (0, 512], got {d_v}")
    _dtype(out, q.dtype, "out")
    torch._check(tuple(out.shape) == (q.shape[0], q.shape[1], d_v),
                 lambda: f"out must be [{q.shape[0]}, {q.shape[1]}, {d_v}], got {tuple(out.shape)}")
    _dtype(lse, torch.float32, "lse")
    torch._check(tuple(lse.shape) == tuple(q.shape[:2]),
                 lambda: f"lse must be [{q.shape[0]}, {q.shape[1]}], got {tuple(lse.shape)}")
    if sinks is not None:
        _dtype(sinks, torch.float32, "sinks")
        torch._check(sinks.dim() == 1 and sinks.shape[0] == q.shape[1],
                     lambda: f"sinks must be [h_q] = [{q.shape[1]}] (one logit per query head), "
                             f"got {tuple(sinks.shape)}")


def _block_out(out, q) -> None:
    _dtype(out, torch.int32, "out")
    _dim(out, 3, "out")
    torch._check(out.shape[0] == q.shape[0] and out.shape[1] == q.shape[1],
                 lambda: f"out must be [s_q, h, topk_blocks] = [{q.shape[0]}, {q.shape[1]}, topk_blocks], "
                         f"got {tuple(out.shape)}")


def _block_args(block_size, local_blocks) -> None:
    torch._check(block_size >= 1, lambda: f"block_size must be >= 1, got {block_size}")
    torch._check(local_blocks >= 0, lambda: f"local_blocks must be >= 0, got {local_blocks}")


@torch.library.register_fake("indexcache::block_topk")
def _block_topk(q, k, ks, ke, block_size, local_blocks, out):
    _dtype(q, FLOATS, "q")
    _dtype(k, q.dtype, "k")
    _dim(q, 3, "q")
    _dim(k, 2, "k")
    torch._check(k.shape[1] == q.shape[2],
                 lambda: f"k must be [s_kv, d] with q's d = {q.shape[2]}, got {tuple(k.shape)}")
    _vec(ks, q.shape[0], "ks")
    _vec(ke, q.shape[0], "ke")
    _block_out(out, q)
    _block_args(block_size, local_blocks)


@torch.library.register_fake("indexcache::block_topk_paged")
def _block_topk_paged(q, k_cache, block_table, seq_lens, next_n, block_size, local_blocks, out):
    _dtype(q, FLOATS, "q")
    _dtype(k_cache, q.dtype, "k_cache")
    _dim(q, 3, "q")
    _dim(k_cache, 3, "k_cache")
    torch._check(k_cache.shape[2] == q.shape[2],
                 lambda: f"k_cache must be [num_pages, page_size, d] with q's d = {q.shape[2]}, "
                         f"got {tuple(k_cache.shape)}")
    _paged_rows(q, block_table, seq_lens, next_n)
    _block_out(out, q)
    _block_args(block_size, local_blocks)


@torch.library.register_fake("indexcache::block_sparse_attention")
def _block_sparse_attention(q, k_cache, v_cache, block_table, req, pos, blocks, block_size, scale, out, lse):
    _dtype(q, FLOATS, "q")
    _dim(q, 3, "q")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _dtype(t, q.dtype, name)
        torch._check(t.dim() == 4, lambda: f"{name} must be [num_pages, page_size, h_kv, d], got {tuple(t.shape)}")
    torch._check(v_cache.shape == k_cache.shape,
                 lambda: f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    s_q, h_q, h_kv = q.shape[0], q.shape[1], k_cache.shape[2]
    torch._check(k_cache.shape[3] == q.shape[2],
                 lambda: f"k_cache's head dim must be q's {q.shape[2]}, got {k_cache.shape[3]}")
    torch._check(h_kv >= 1 and h_q % h_kv == 0,
                 lambda: f"q's {h_q} heads must be a multiple of the cache's {h_kv} KV heads")
    _block_table(block_table)
    _vec(req, s_q, "req")
    _vec(pos, s_q, "pos")
    _dtype(blocks, torch.int32, "blocks")
    torch._check(blocks.dim() == 3 and blocks.shape[0] == s_q and blocks.shape[1] == h_kv,
                 lambda: f"blocks must be [s_q, h_kv, topk] = [{s_q}, {h_kv}, topk], got {tuple(blocks.shape)}")
    _dtype(out, q.dtype, "out")
    torch._check(out.shape == q.shape, lambda: f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    _dtype(lse, torch.float32, "lse")
    torch._check(tuple(lse.shape) == (s_q, h_q),
                 lambda: f"lse must be [s_q, h_q] = [{s_q}, {h_q}], got {tuple(lse.shape)}")
    torch._check(block_size >= 1, lambda: f"block_size must be >= 1, got {block_size}")


@torch.library.register_fake("indexcache::delta_rule")
def _delta_rule(q, k, v, g, beta, state, cu_seqlens, state_indices, scale, out):
    _dtype(q, FLOATS, "q")
    _dtype(k, q.dtype, "k")
    _dtype(v, q.dtype, "v")
    _dtype(out, q.dtype, "out")
    for t, name in ((g, "g"), (beta, "beta"), (state, "state")):
        _dtype(t, torch.float32, name)
    _dtype(cu_seqlens, torch.int32, "cu_seqlens")
    _dtype(state_indices, torch.int32, "state_indices")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _dim(t, 3, name)
    T, h_k, d_k = q.shape
    h_v, d_v = v.shape[1], v.shape[2]
    torch._check(k.shape == q.shape,
                 lambda: f"k must have q's shape [T, h_k, d_k] = {tuple(q.shape)}, got {tuple(k.shape)}")
    torch._check(v.shape[0] == T, lambda: f"v must have q's {T} tokens, got shape {tuple(v.shape)}")
    torch._check(h_k >= 1 and h_v >= 1 and d_k >= 1 and d_v >= 1,
                 lambda: f"q, k and v need at least one head and one channel, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    torch._check(h_v % h_k == 0, lambda: f"v's {h_v} heads (h_v) must be a multiple of q and k's {h_k} (h_k)")
    torch._check(tuple(g.shape) in ((T, h_v), (T, h_v, d_k)),
                 lambda: f"g must be [T, h_v] = [{T}, {h_v}] or [T, h_v, d_k] = [{T}, {h_v}, {d_k}], got {tuple(g.shape)}")
    torch._check(tuple(beta.shape) == (T, h_v), lambda: f"beta must be [T, h_v] = [{T}, {h_v}], got {tuple(beta.shape)}")
    torch._check(state.dim() == 4 and tuple(state.shape[1:]) == (h_v, d_k, d_v),
                 lambda: f"state must be [n_slots, h_v, d_k, d_v] = [n_slots, {h_v}, {d_k}, {d_v}], got {tuple(state.shape)}")
    torch._check(out.shape == v.shape,
                 lambda: f"out must have v's shape [T, h_v, d_v] = {tuple(v.shape)}, got {tuple(out.shape)}")
    torch._check(cu_seqlens.dim() == 1 and cu_seqlens.shape[0] >= 1,
                 lambda: f"cu_seqlens must be a contiguous 1-d tensor of batch + 1 entries, got shape {tuple(cu_seqlens.shape)}")
    torch._check(state_indices.dim() == 1 and state_indices.shape[0] == cu_seqlens.shape[0] - 1,
                 lambda: f"state_indices must be a contiguous 1-d tensor of batch = {cu_seqlens.shape[0] - 1} entries "
                         f"(cu_seqlens has batch + 1), got shape {tuple(state_indices.shape)}")


@torch.library.register_fake("indexcache::cuda_error_word")
def _cuda_error_word(like):
    return like.new_empty((1,), dtype=torch.int32)


@torch.library.register_fake("indexcache::swiglu_rows")
def _swiglu_rows(x, gate_w, up_w, down_w, coef, out):
    _dtype(x, FLOATS, "x")
    torch._check(out.dtype == torch.float32, lambda: f"out must be float32 (the fp32 sum), got {out.dtype}")
    torch._check(x.dim() == 2, lambda: f"x must be [M, D], got shape {tuple(x.shape)}")
    torch._check(tuple(out.shape) == tuple(x.shape), lambda: f"out must be {list(x.shape)} like x, got {tuple(out.shape)}")
    torch._check(len(up_w) == len(gate_w) == len(down_w) == len(coef),
                 lambda: "gate_w, up_w, down_w and coef need one entry per expert")
    _check_experts(x, gate_w, up_w, down_w)


def _check_experts(x, gate_w, up_w, down_w):
    torch._check(len(up_w) == len(gate_w) == len(down_w), lambda: "gate_w, up_w and down_w need one entry per expert")
    for e, (g, u, d) in enumerate(zip(gate_w, up_w, down_w)):
        for t, name in ((g, "gate_w"), (u, "up_w"), (d, "down_w")):
            _dtype(t, FLOATS, f"{name}[{e}]")
        torch._check(g.dim() == 2 and g.shape[1] == x.shape[1] and tuple(u.shape) == tuple(g.shape),
                     lambda: f"gate_w[{e}] and up_w[{e}] must be [I, {x.shape[1]}]")
        torch._check(tuple(d.shape) == (x.shape[1], g.shape[0]), lambda: f"down_w[{e}] must be [D, I]")


@torch.library.register_fake("indexcache::moe_rows")
def _moe_rows(x, gate_w, up_w, down_w, topk_ids, topk_weights, first_expert, num_experts, num_shared, out):
    _dtype(x, FLOATS, "x")
    torch._check(out.dtype == torch.float32, lambda: f"out must be float32 (the fp32 sum), got {out.dtype}")
    torch._check(x.dim() == 2, lambda: f"x must be [M, D], got shape {tuple(x.shape)}")
    torch._check(tuple(out.shape) == tuple(x.shape), lambda: f"out must be {list(x.shape)} like x, got {tuple(out.shape)}")
    _check_experts(x, gate_w, up_w, down_w)
    torch._check(0 <= num_shared <= len(gate_w), lambda: f"num_shared must lie in [0, {len(gate_w)}]")
    torch._check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], lambda: f"topk_ids must be [{x.shape[0]}, k]")
    torch._check(tuple(topk_weights.shape) == tuple(topk_ids.shape), lambda: "topk_weights must be shaped like topk_ids")
    _dtype(topk_ids, (torch.int64, torch.int32), "topk_ids")
    _dtype(topk_weights, (torch.float32, torch.bfloat16), "topk_weights")


@torch.library.register_fake("indexcache::rows_matmul")
def _rows_matmul(x, w, w_nk, out):
    for t, name in ((x, "x"), (w, "w"), (out, "out")):
        _dtype(t, FLOATS, name)
    torch._check(x.dim() in (2, 3), lambda: f"x must be [M, K] or [G, M, K], got shape {tuple(x.shape)}")
    torch._check(w.dim() == x.dim() and out.dim() == x.dim(),
                 lambda: f"x, w and out must have the same number of dims, got {tuple(x.shape)}, {tuple(w.shape)} "
                         f"and {tuple(out.shape)}")
    k, n = (w.shape[-1], w.shape[-2]) if w_nk else (w.shape[-2], w.shape[-1])
    torch._check(k == x.shape[-1], lambda: f"w {tuple(w.shape)} does not take x's K = {x.shape[-1]}")
    torch._check(tuple(out.shape[-2:]) == (x.shape[-2], n),
                 lambda: f"out must be [.., {x.shape[-2]}, {n}], got {tuple(out.shape)}")


@torch.library.register_fake("indexcache::rms_norm")
def _rms_norm(x, w, eps, out):
    for t, name in ((x, "x"), (w, "w"), (out, "out")):
        _dtype(t, FLOATS, name)
    _dim(x, 2, "x")
    _dim(w, 1, "w")
    torch._check(w.shape[0] == x.shape[1], lambda: f"w must have x's last dim {x.shape[1]} values, got {tuple(w.shape)}")
    torch._check(out.shape == x.shape, lambda: f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")


@torch.library.register_fake("indexcache::rope")
def _rope(x, cos, sin, interleaved, out):
    for t, name in ((x, "x"), (out, "out")):
        _dtype(t, FLOATS, name)
    for t, name in ((cos, "cos"), (sin, "sin")):
        _dtype(t, (torch.float32,), name)
        _dim(t, 2, name)
    _dim(x, 3, "x")
    torch._check(x.shape[2] % 2 == 0, lambda: f"x's last dim (the rotated width) must be even, got {x.shape[2]}")
    torch._check(tuple(cos.shape) == (x.shape[0], x.shape[2] // 2) and sin.shape == cos.shape,
                 lambda: f"cos and sin must be [N, R / 2] for x {tuple(x.shape)}, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    torch._check(out.shape == x.shape, lambda: f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")


@torch.library.register_fake("indexcache::kpool_pool_paged")
def _kpool_pool_paged(index_raw, index_pool, ape, block_table, ctx_lens, q_lens):
    for t, name in ((index_raw, "index_raw"), (index_pool, "index_pool"), (ape, "ape")):
        _dtype(t, FLOATS, name)
    for t, name in ((block_table, "block_table"), (ctx_lens, "ctx_lens"), (q_lens, "q_lens")):
        _dtype(t, (torch.int32,), name)
    _dim(ape, 2, "ape")
    _dim(index_raw, 3, "index_raw")
    p, d = ape.shape
    nb, bs = index_raw.shape[:2]
    torch._check(index_raw.shape[2] == 2 * d, lambda: f"index_raw must be [num_blocks, block_size, 2 d = {2 * d}], "
                                                      f"got {tuple(index_raw.shape)}")
    torch._check(p >= 1 and bs % p == 0, lambda: f"the pool size P = {p} must divide the block size {bs}")
    torch._check(tuple(index_pool.shape) == (nb, bs // max(p, 1), d),
                 lambda: f"index_pool must be [{nb}, {bs // max(p, 1)}, {d}], got {tuple(index_pool.shape)}")
    _dim(block_table, 2, "block_table")
    torch._check(tuple(ctx_lens.shape) == (block_table.shape[0],) and q_lens.shape == ctx_lens.shape,
                 lambda: f"ctx_lens and q_lens must be [B = {block_table.shape[0]}], got {tuple(ctx_lens.shape)} "
                         f"and {tuple(q_lens.shape)}")
