"""Device-side validation of the CUDA ops (no host copy, no sync), run through the emulator.

By default the CUDA ops do not copy index inputs to the host: an out-of-range index,
slot, position, block id, window or sequence length is treated as invalid (-1, an empty
window, an empty request) and counted in the device's int32 error word (DeviceEnv::err,
``indexcache.ops.cuda_error_count``). Each test checks both halves: an input with bad
entries gives bit for bit what the same input with those entries made invalid gives, the
word counts exactly the bad entries, and in-range inputs leave the word at 0.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_validation.py
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from test_emu import (BF16, POISON_I, I, P, call, causal_windows, dt_code, indexer_inputs, lib, make_mla,
                      paged_inputs, ref, run_fused, run_logits, run_topk)


def errors() -> int:
    return int(lib().emu_error_count())


@pytest.fixture(autouse=True)
def _reset_word():
    lib().emu_reset_error_count()
    yield


# ------------------------------------------------------------------ cache inserts, slots

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_k_insert_out_of_range_slots(dtype):
    torch.manual_seed(21)
    n, blocks, bs = 40, 3, 16
    k = torch.randn(n, 128).to(dtype)
    slots = torch.randperm(blocks * bs)[:n]
    bad = torch.tensor([1, 5, 9, 30])
    slots[bad] = torch.tensor([blocks * bs, -2, 10**9, -(10**9)])
    slots[3] = -1
    cache = torch.randint(0, 255, (blocks, bs * 132), dtype=torch.uint8)
    expect = cache.clone()
    call("emu_index_k_insert", P(k), P(slots), P(cache), I(n), I(128), I(bs), I(blocks), ctypes.c_int(0),
         ctypes.c_int(dt_code(k)))
    clean = slots.clone()
    clean[bad] = -1
    ref.index_k_cache_insert(k, clean, expect)
    assert torch.equal(cache, expect)
    assert errors() == len(bad)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.uint8])
def test_mla_insert_out_of_range_slots(cache_dtype):
    torch.manual_seed(22)
    n, blocks, bs = 20, 2, 16
    kv_c, k_pe = torch.randn(n, 512), torch.randn(n, 64)
    slots = torch.randperm(blocks * bs)[:n]
    slots[[0, 7]] = torch.tensor([blocks * bs + 3, -5])
    width = 656 if cache_dtype == torch.uint8 else 576
    cache = torch.full((blocks, bs, width), 3, dtype=cache_dtype)
    expect = cache.clone()
    call("emu_mla_insert", P(kv_c), P(k_pe), P(slots), P(cache), I(n), I(blocks * bs), ctypes.c_int(dt_code(kv_c)),
         ctypes.c_int(dt_code(cache)))
    clean = slots.clone()
    clean[[0, 7]] = -1
    ref.mla_kv_cache_insert(kv_c, k_pe, clean, expect)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))
    assert errors() == 2


def test_positions_to_slots_invalid_entries():
    torch.manual_seed(23)
    n, k, batch, bs, max_blocks, num_blocks = 6, 20, 3, 16, 4, 12
    table = torch.randperm(num_blocks, dtype=torch.int32).reshape(batch, max_blocks).contiguous()
    pos = torch.randint(0, bs * max_blocks, (n, k), dtype=torch.int32)
    pos[:, ::4] = -1
    req = torch.tensor([0, 1, 2, 1, 7, -1], dtype=torch.int32)  # rows 4, 5: no such request
    table[2, 3] = num_blocks  # a block id outside the cache
    table[1, 0] = -3
    pos[0, 1] = -2                      # below -1
    pos[0, 2] = bs * max_blocks + 5     # past the block table's columns
    out = torch.full_like(pos, POISON_I)
    call("emu_positions_to_slots", P(pos), P(req), P(table), P(out), I(n), I(k), I(batch), I(max_blocks), I(bs),
         I(num_blocks))
    # The same map with every rejected entry made -1.
    expect = torch.full_like(pos, -1)
    bad = 0
    for r in range(n):
        for j in range(k):
            p = int(pos[r, j])
            if p == -1:
                continue
            b = int(req[r])
            if p < -1 or not (0 <= b < batch) or p // bs >= max_blocks or not (0 <= int(table[b, p // bs]) < num_blocks):
                bad += 1
                continue
            expect[r, j] = int(table[b, p // bs]) * bs + p % bs
    assert bad >= 2 * (k - k // 4) + 2
    assert torch.equal(out, expect)
    assert errors() == bad


def test_valid_inputs_count_nothing():
    torch.manual_seed(24)
    n, k, batch, bs = 5, 12, 2, 16
    table = torch.randperm(8, dtype=torch.int32).reshape(batch, 4).contiguous()
    pos = torch.randint(-1, 64, (n, k), dtype=torch.int32)
    req = torch.randint(0, batch, (n,), dtype=torch.int32)
    out = torch.full_like(pos, POISON_I)
    call("emu_positions_to_slots", P(pos), P(req), P(table), P(out), I(n), I(k), I(batch), I(4), I(bs), I(8))
    assert torch.equal(out, ref.positions_to_slots(pos, req, table, bs))
    logits = torch.randn(3, 300)
    ks = torch.tensor([0, 10, 299], dtype=torch.int32)
    ke = torch.tensor([300, 10, 300], dtype=torch.int32)
    assert torch.equal(run_topk(logits, ks, ke, 20), ref.topk_indices(logits, ks, ke, 20))
    assert errors() == 0


# ------------------------------------------------------------------ top-k and indexer windows

def bad_windows(rows, n):
    ks, ke = causal_windows(rows, n)
    bad = [1, 3, 4, 6][: max(0, rows - 1)]
    vals = [(-1, 5), (7, 6), (0, n + 1), (n + 2, n + 3)]
    for r, (a, b) in zip(bad, vals):
        ks[r], ke[r] = a, b
    clean_ks, clean_ke = ks.clone(), ke.clone()
    clean_ks[bad], clean_ke[bad] = 0, 0
    return ks, ke, clean_ks, clean_ke, len(bad)


@pytest.mark.parametrize("rows,n,topk,sms", [(8, 500, 32, 132), (2, 40000, 512, 132)])  # 2 rows: split + merge
def test_topk_invalid_windows(rows, n, topk, sms):
    torch.manual_seed(25)
    logits = torch.randn(rows, n)
    ks, ke, cks, cke, nbad = bad_windows(rows, n)
    got = run_topk(logits, ks, ke, topk, sms=sms)
    assert errors() == nbad
    assert torch.equal(got, run_topk(logits, cks, cke, topk, sms=sms))
    assert errors() == nbad  # the clean run counts nothing
    assert torch.equal(got, ref.topk_indices(logits, cks, cke, topk))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_indexer_invalid_windows(dtype):
    s_q, s_kv, h = 7, 300, 16
    q, k, ksc, w = indexer_inputs(s_q, s_kv, h, dtype, seed=26)
    ks, ke, cks, cke, nbad = bad_windows(s_q, s_kv)
    got = run_logits(q, k, ksc, w, ks, ke)
    assert errors() == nbad
    assert torch.equal(got, run_logits(q, k, ksc, w, cks, cke))
    assert torch.isneginf(got[1]).all()
    lib().emu_reset_error_count()
    for topk in (16, 2100):  # fused, and the k > 2048 fallback (logits + top-k kernels)
        out = run_fused(q, k, ksc, w, ks, ke, topk)
        assert errors() == nbad
        assert torch.equal(out, run_fused(q, k, ksc, w, cks, cke, topk))
        assert (out[1] == -1).all()
        lib().emu_reset_error_count()


# ------------------------------------------------------------------ paged indexer

def paged_call(name, qv, w, cache, table, lens, batch, next_n, h, bs, max_blocks, blocks, max_len, out):
    args = [P(qv), P(w), P(cache), P(table), P(lens), I(batch), I(next_n), I(h), I(bs), I(max_blocks), I(blocks),
            I(max_len), P(out), I(out.stride(0)), I(out.shape[1])]
    if name == "emu_indexer_topk_paged":
        args.append(I(out.shape[1]))
    call(name, *args)
    return out


def test_paged_invalid_seq_lens_and_blocks():
    batch, next_n, h, bs = 5, 2, 16, 16
    max_blocks = 6
    blocks = batch * max_blocks + 1
    good = torch.tensor([40, 70, 33, 90, 17], dtype=torch.int32)
    qv, w, cache, table = paged_inputs(batch, next_n, h, bs, blocks, good, max_blocks, seed=27)
    lens = good.clone()
    lens[1] = -4                          # negative
    lens[2] = max_blocks * bs + 1         # more blocks than the table has
    table = table.clone()
    table[3, 90 // bs] = blocks           # a block it reads is outside the cache
    table[4, 5] = -7                      # past its seq_len: never read, not an error
    clean = lens.clone()
    clean[[1, 2, 3]] = 0
    bound = max_blocks * bs
    for name, make in (("emu_indexer_logits_paged", lambda: torch.full((batch * next_n, bound), float("nan"))),
                       ("emu_indexer_topk_paged", lambda: torch.full((batch * next_n, 24), POISON_I, dtype=torch.int32))):
        lib().emu_reset_error_count()
        got = paged_call(name, qv, w, cache, table, lens, batch, next_n, h, bs, max_blocks, blocks, bound, make())
        assert errors() == 3, name
        expect = paged_call(name, qv, w, cache, table, clean, batch, next_n, h, bs, max_blocks, blocks, bound, make())
        assert errors() == 3, name
        assert torch.equal(got, expect), name
        rows = slice(2, 8)  # requests 1, 2, 3: empty
        if name == "emu_indexer_logits_paged":
            assert torch.isneginf(got[rows]).all()
            ref_out = ref.indexer_logits_paged(qv, w, cache, table, clean, next_n, bound)
            assert torch.equal(torch.isinf(got), torch.isinf(ref_out))
        else:
            assert (got[rows] == -1).all()
            assert (got[0] >= 0).sum() == 24 and (got[8] >= 0).sum() == 16


def test_paged_logits_width_bound():
    """A request longer than the logits width is empty (counted), not written past the row."""
    batch, next_n, h, bs, max_blocks = 2, 1, 8, 16, 4
    good = torch.tensor([20, 60], dtype=torch.int32)
    qv, w, cache, table = paged_inputs(batch, next_n, h, bs, batch * max_blocks, good, max_blocks, seed=28)
    width = 32
    out = torch.full((batch, width + 8), float("nan"))
    view = out[:, :width]
    paged_call("emu_indexer_logits_paged", qv, w, cache, table, good, batch, next_n, h, bs, max_blocks,
               batch * max_blocks, width, view)
    assert errors() == 1
    assert out[:, width:].isnan().all()  # nothing written past the width
    assert torch.isneginf(view[1]).all()
    assert torch.isfinite(view[0, :20]).all() and torch.isneginf(view[0, 20:]).all()


# ------------------------------------------------------------------ sparse MLA

@pytest.mark.parametrize("cache_kind,q_dtype", [("fp8", torch.bfloat16), ("bf16", torch.bfloat16),
                                                ("fp8", torch.float32)])
def test_sparse_mla_out_of_range_indices(cache_kind, q_dtype):
    s_q, h, topk = 3, 40, 70  # 3 head groups per row: each bad entry still counts once
    cache, idx = make_mla(cache_kind, s_q, topk, seed=29)
    num_slots = cache.shape[0] * cache.shape[1]
    bad = [(0, 1), (0, 2), (1, 69), (2, 0), (2, 64)]
    vals = [num_slots, -2, 10**9, -(2**31), num_slots + 64]
    dirty = idx.clone()
    for (r, j), v in zip(bad, vals):
        dirty[r, j] = v
    clean = dirty.clone()
    for r, j in bad:
        clean[r, j] = -1
    q = torch.randn(s_q, h, 576, generator=torch.Generator().manual_seed(30)).to(q_dtype)
    outs = []
    for indices in (dirty, clean):
        out = torch.full((s_q, h, 512), float("nan"), dtype=q_dtype)
        lse = torch.full((s_q, h), float("nan"))
        call("emu_sparse_mla", P(q), P(cache), P(indices), P(out), P(lse), I(s_q), I(h), I(topk), I(num_slots), I(512),
             ctypes.c_float(0.1), ctypes.c_int(dt_code(q)), ctypes.c_int(dt_code(cache)))
        outs.append((out, lse))
        assert errors() == len(bad)  # the clean run adds nothing
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ro, rl = ref.sparse_mla(q, cache, clean, 0.1, 512)
    assert torch.isfinite(outs[0][0].float()).all()
    assert ((outs[0][0].float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2


def test_sparse_mla_fp8_rope_staging_vector_and_scalar():
    """The fp8 RoPE part staged by 16-byte copies (aligned cache) equals the byte path."""
    from test_emu import misaligned
    cache, idx = make_mla("fp8", 2, 96, seed=31)
    # Distinctive RoPE bits: every bf16 value differs, so a wrong byte order or offset shows.
    rope = cache[..., 528:].view(torch.bfloat16)
    rope.copy_(torch.randn(rope.shape) * 3)
    q = torch.randn(2, 16, 576).bfloat16()
    outs = []
    for cc in (cache, misaligned(cache)):
        out = torch.empty(2, 16, 512, dtype=torch.bfloat16)
        lse = torch.empty(2, 16)
        call("emu_sparse_mla", P(q), P(cc), P(idx), P(out), P(lse), I(2), I(16), I(96), I(cache.shape[0] * cache.shape[1]),
             I(512), ctypes.c_float(0.2), ctypes.c_int(BF16), ctypes.c_int(dt_code(cache)))
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ro, rl = ref.sparse_mla(q, cache, idx, 0.2, 512)
    fin = torch.isfinite(rl)
    # The kernel rounds each dequantized latent value to bf16 (relative error <= 2^-9); the
    # reference keeps fp32. lse is a smooth max of the scores, so it moves by at most the largest
    # score change: 0.2 * 2^-9 * sum_c |q_c| |k_c| over the latent dims of a selected key, plus
    # fp32 summation of 576 terms (<= 2^-14 of sum_c |q_c| |k_c| over all dims) on both sides.
    k = ref.mla_kv_cache_dequant(cache).reshape(-1, 576).abs()[idx.long().clamp(min=0)]
    qa = q.float().abs()
    latent = torch.einsum("thc,tjc->thj", qa[..., :512], k[..., :512])
    full = torch.einsum("thc,tjc->thj", qa, k)
    per_key = (2.0 ** -9 * latent + 2.0 ** -13 * full).masked_fill((idx < 0).unsqueeze(1), 0.0)
    bound = 0.2 * per_key.amax(dim=-1)
    assert ((outs[0][1] - rl).abs() <= bound)[fin].all()
    assert errors() == 0
