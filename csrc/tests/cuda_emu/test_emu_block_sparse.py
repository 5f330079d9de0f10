"""MiniMax-M3's block-sparse CUDA kernels (csrc/cuda/block_sparse_impl.cuh), run on the CPU through
the cuda_emu.h emulator, against reference_block_sparse.py: block_topk (prefill), block_topk_paged
(decode, next_n 1-3), block_sparse_attention; bf16 and fp32; -1 padding, rows shorter than
topk, exact ties, the global-scratch path of the block maxima, invalid index values (counted,
not faulting) and the non-finite table of docs/ops.md. Outputs are poisoned before each call.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_block_sparse.py

Builds its own libicemu_block_sparse.so (beside INDEXCACHE_EMU_LIB's) with g++ on first use.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from emu_build import load_emu_lib, load_reference
from hypothesis import given, settings
from hypothesis import strategies as st

ref = load_reference("reference_block_sparse.py", "indexcache_reference_block_sparse")
F32, BF16 = 0, 1
POISON_I = -7777
POISON_F32 = 0x7F8DEAD1  # a NaN payload no kernel makes
POISON_BF16 = 0x7F81
SELECT_SHARED = (2048 + 3 * 32 + 2) * 4  # sizeof(SelectShared), common.cuh


def lib() -> ctypes.CDLL:
    return load_emu_lib("emu_block_sparse.cpp", "libicemu_block_sparse.so", "emu_bs_last_error")


def P(t):
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def I(x):
    return ctypes.c_int64(int(x))


def call(name, *args, smem=227 * 1024, sms=132):
    L = lib()
    L.emu_bs_set_device(ctypes.c_int(sms), ctypes.c_int(smem))
    if getattr(L, name)(*args) != 0:
        raise RuntimeError(L.emu_bs_last_error().decode())


def errors(fn):
    """fn() run with the device error word reset; returns how many invalid entries it counted."""
    L = lib()
    L.emu_bs_reset_error_count()
    fn()
    return L.emu_bs_error_count()


def dt(t):
    return {torch.float32: F32, torch.bfloat16: BF16}[t.dtype]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


# ------------------------------------------------------------------ launch wrappers

def emu_block_topk(q, k, ks, ke, block_size, topk, local, smem=227 * 1024, sms=132):
    out = torch.full((q.shape[0], q.shape[1], topk), POISON_I, dtype=torch.int32)
    call("emu_block_topk", P(q), P(k), P(ks), P(ke), P(None), P(None), P(out), I(q.shape[0]), I(q.shape[1]),
         I(q.shape[2]), I(k.shape[0]), I(0), I(1), I(0), I(0), I(1), I(block_size), I(topk), I(local),
         ctypes.c_int(dt(q)), smem=smem, sms=sms)
    assert not (out == POISON_I).any(), "an output element was not written"
    return out


def emu_block_topk_paged(q, cache, table, seq_lens, next_n, block_size, topk, local, smem=227 * 1024, sms=132):
    out = torch.full((q.shape[0], q.shape[1], topk), POISON_I, dtype=torch.int32)
    call("emu_block_topk", P(q), P(cache), P(None), P(None), P(table), P(seq_lens), P(out), I(q.shape[0]),
         I(q.shape[1]), I(q.shape[2]), I(0), I(cache.shape[0]), I(cache.shape[1]), I(table.shape[0]),
         I(table.shape[1]), I(next_n), I(block_size), I(topk), I(local), ctypes.c_int(dt(q)), smem=smem, sms=sms)
    assert not (out == POISON_I).any(), "an output element was not written"
    return out


def emu_attention(q, kc, vc, table, req, pos, blocks, block_size, scale, sms=132):
    s_q, h_q, d = q.shape
    if q.dtype == torch.float32:
        out = torch.full(q.shape, POISON_F32, dtype=torch.int32).view(torch.float32)
    else:
        out = torch.full(q.shape, POISON_BF16, dtype=torch.int16).view(torch.bfloat16)
    lse = torch.full((s_q, h_q), POISON_F32, dtype=torch.int32).view(torch.float32)
    call("emu_block_sparse_attention", P(q), P(kc), P(vc), P(table), P(req), P(pos), P(blocks), P(out), P(lse),
         I(s_q), I(h_q), I(kc.shape[2]), I(d), I(blocks.shape[2]), I(kc.shape[0]), I(kc.shape[1]),
         I(table.shape[0]), I(table.shape[1]), I(block_size), ctypes.c_float(scale), ctypes.c_int(dt(q)), sms=sms)
    bits = out.view(torch.int32 if q.dtype == torch.float32 else torch.int16)
    poison = POISON_F32 if q.dtype == torch.float32 else POISON_BF16
    assert not (bits == poison).any() and not (lse.view(torch.int32) == POISON_F32).any(), "an element was not written"
    return out, lse


# ------------------------------------------------------------------ inputs

def windows(lens, s_q_per):
    """Flattened requests of the given lengths; the last s_q_per tokens of each are queries."""
    ks, ke, start = [], [], 0
    for n in lens:
        for j in range(min(s_q_per, n)):
            ks.append(start)
            ke.append(start + n - min(s_q_per, n) + j + 1)
        start += n
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32), start


def make_paged(rows_per_req, page_size, g, extra_pages=2):
    """Each request's rows [n, ...] scattered over shuffled, non-contiguous pages of a cache."""
    pages_per = [(r.shape[0] + page_size - 1) // page_size for r in rows_per_req]
    total = sum(pages_per) + extra_pages
    perm = torch.randperm(total, generator=g)
    cache = torch.randn(total, page_size, *rows_per_req[0].shape[1:], generator=g).to(rows_per_req[0].dtype)
    table = torch.zeros((len(rows_per_req), max(pages_per + [1])), dtype=torch.int32)
    used = 0
    for b, r in enumerate(rows_per_req):
        for j in range(pages_per[b]):
            pg = int(perm[used])
            used += 1
            table[b, j] = pg
            part = r[j * page_size:(j + 1) * page_size]
            cache[pg, :part.shape[0]] = part
    return cache, table


def selection_scores(q, keys, pos, sel, block_size, local):
    sc = ref.block_scores(q.unsqueeze(0), keys, torch.tensor([pos]), block_size)[0]
    qb = pos // block_size
    for j in range(local):
        sc[:, max(qb - j, 0)] = math.inf
    return [torch.sort(sc[h, sel[h][sel[h] >= 0].long()]).values for h in range(sel.shape[0])]


def assert_blocks_equal(got, expect, row_inputs, block_size, local):
    """Equal ids, or (a near-tie reordered by fp32 summation order) equal reference scores."""
    assert got.shape == expect.shape and got.dtype == torch.int32
    diff = (got != expect).any(dim=-1).any(dim=-1).nonzero().flatten().tolist()
    assert len(diff) <= max(1, got.shape[0] // 20), f"{len(diff)} of {got.shape[0]} rows differ"
    for t in diff:
        q, keys, pos = row_inputs(t)
        a = selection_scores(q, keys, pos, got[t], block_size, local)
        b = selection_scores(q, keys, pos, expect[t], block_size, local)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, equal_nan=True)


# ------------------------------------------------------------------ block_topk

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,d,block_size,topk,local,lens,per", [
    (4, 128, 16, 4, 1, [200, 97], 6),
    (2, 64, 8, 16, 2, [70, 1, 33], 5),      # rows with fewer blocks than topk: -1 padding
    (1, 24, 5, 3, 0, [40, 12], 6),          # no forced block; d not a multiple of anything
    (3, 128, 128, 16, 1, [700], 3),         # MiniMax-M3's block size
    (2, 32, 4, 3, 4, [45], 4),              # more local blocks than topk
])
def test_block_topk_prefill(dtype, h, d, block_size, topk, local, lens, per):
    g = torch.Generator().manual_seed(h * 1000 + d + topk)
    ks, ke, s_kv = windows(lens, per)
    q = torch.randn(ks.shape[0], h, d, generator=g).to(dtype)
    k = (torch.randn(s_kv, d, generator=g) + 0.1).to(dtype)
    expect = ref.block_topk(q, k, ks, ke, block_size, topk, local)
    out = emu_block_topk(q, k, ks, ke, block_size, topk, local)
    assert_blocks_equal(out, expect, lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)),
                        block_size, local)
    assert torch.equal(emu_block_topk(q, k, ks, ke, block_size, topk, local), out)  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("next_n,page_size,block_size,topk", [(1, 16, 16, 4), (2, 8, 16, 5), (3, 32, 8, 6)])
def test_block_topk_paged(dtype, next_n, page_size, block_size, topk):
    g = torch.Generator().manual_seed(next_n * 100 + page_size)
    h, d, local = 3, 64, 1
    seq_lens = [150, 3, 64, 1]
    keys = [(torch.randn(n, d, generator=g) + 0.1).to(dtype) for n in seq_lens]
    cache, table = make_paged(keys, page_size, g)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens) * next_n, h, d, generator=g).to(dtype)
    expect = ref.block_topk_paged(q, cache, table, sl, next_n, block_size, topk, local)
    out = emu_block_topk_paged(q, cache, table, sl, next_n, block_size, topk, local)

    def row(t):
        w = seq_lens[t // next_n] - next_n + t % next_n + 1
        return q[t], keys[t // next_n][:w], w - 1

    assert_blocks_equal(out, expect, row, block_size, local)
    for t in range(q.shape[0]):  # an empty window (seq_len 1, next_n > 1) gives all -1
        if seq_lens[t // next_n] - next_n + t % next_n + 1 <= 0:
            assert (out[t] == -1).all()


@pytest.mark.parametrize("paged", [False, True])
def test_block_topk_exact_ties(paged):
    """Small integers: every score is exact, many block maxima tie; ids must equal the reference's
    (lower id first on ties), with no tolerance."""
    g = torch.Generator().manual_seed(7)
    h, d, bsz, topk, local = 4, 16, 4, 5, 1
    if not paged:
        ks, ke, s_kv = windows([60, 23], 5)
        q = torch.randint(-1, 2, (ks.shape[0], h, d), generator=g).float()
        k = torch.randint(-1, 2, (s_kv, d), generator=g).float()
        assert torch.equal(emu_block_topk(q, k, ks, ke, bsz, topk, local), ref.block_topk(q, k, ks, ke, bsz, topk, local))
        return
    keys = [torch.randint(-1, 2, (n, d), generator=g).float() for n in (61, 9)]
    cache, table = make_paged(keys, 8, g)
    sl = torch.tensor([61, 9], dtype=torch.int32)
    q = torch.randint(-1, 2, (4, h, d), generator=g).float()
    got = emu_block_topk_paged(q, cache, table, sl, 2, bsz, topk, local)
    assert torch.equal(got, ref.block_topk_paged(q, cache, table, sl, 2, bsz, topk, local))


def test_block_topk_global_scratch():
    """Block maxima that do not fit in shared memory go to global scratch: same result."""
    g = torch.Generator().manual_seed(3)
    h, d, bsz, topk = 2, 32, 1, 7
    ks, ke, s_kv = windows([300], 4)
    q = torch.randn(ks.shape[0], h, d, generator=g)
    k = torch.randn(s_kv, d, generator=g)
    base = 4 * (h * d + 64 * (d + 4) + h * 64)  # key rows d + 4 apart (d % 4 == 0)
    tight = base + SELECT_SHARED + 16 + 64 + 256  # too small for 2 x 300 maxima
    a = emu_block_topk(q, k, ks, ke, bsz, topk, 1, smem=tight)
    b = emu_block_topk(q, k, ks, ke, bsz, topk, 1)
    assert torch.equal(a, b)
    assert_blocks_equal(a, ref.block_topk(q, k, ks, ke, bsz, topk, 1),
                        lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)), bsz, 1)
    with pytest.raises(RuntimeError, match="shared memory"):
        emu_block_topk(q, k, ks, ke, bsz, topk, 1, smem=base)


def test_block_topk_long_row():
    """One decode row over 40000 keys (313 blocks of 128), next to a prefill row of the same
    request: the radix select over hundreds of block maxima, against the reference."""
    g = torch.Generator().manual_seed(8)
    h, d, bsz, topk = 2, 16, 128, 16
    keys = [torch.randn(40000, d, generator=g)]
    cache, table = make_paged(keys, 64, g)
    sl = torch.tensor([40000], dtype=torch.int32)
    q = torch.randn(2, h, d, generator=g)
    got = emu_block_topk_paged(q, cache, table, sl, 2, bsz, topk, 1)
    assert_blocks_equal(got, ref.block_topk_paged(q, cache, table, sl, 2, bsz, topk, 1),
                        lambda t: (q[t], keys[0][:39999 + t], 39998 + t), bsz, 1)


@pytest.mark.parametrize("paged", [False, True])
def test_block_topk_split_rows(paged):
    """Few rows over long windows split their blocks over scoring CTAs, then select from the global
    maxima: the same ids, bit for bit, as one CTA per row (a device with one SM never splits),
    and the reference's. Invalid windows still count once."""
    g = torch.Generator().manual_seed(9)
    h, d, bsz, topk, local = 3, 16, 16, 6, 2
    lens = [5000, 2100, 700]
    if paged:
        keys = [torch.randn(n, d, generator=g).bfloat16() for n in lens]
        cache, table = make_paged(keys, 32, g)
        sl = torch.tensor(lens + [10**6], dtype=torch.int32)  # the last request is invalid: empty, counted
        table = torch.cat([table, table[:1]])
        q = torch.randn(8, h, d, generator=g).bfloat16()
        box = {}
        n = errors(lambda: box.setdefault("s", emu_block_topk_paged(q, cache, table, sl, 2, bsz, topk, local)))
        one = emu_block_topk_paged(q, cache, table, sl, 2, bsz, topk, local, sms=1)
        assert n == 1 and torch.equal(box["s"], one) and (one[6:] == -1).all()
        sl3 = sl[:3].clone()
        assert_blocks_equal(one[:6], ref.block_topk_paged(q[:6], cache, table[:3], sl3, 2, bsz, topk, local),
                            lambda t: (q[t], keys[t // 2][:lens[t // 2] - 1 + t % 2], lens[t // 2] - 2 + t % 2),
                            bsz, local)
        return
    ks, ke, s_kv = windows(lens, 2)
    q = torch.randn(ks.shape[0], h, d, generator=g)
    k = torch.randn(s_kv, d, generator=g)
    split = emu_block_topk(q, k, ks, ke, bsz, topk, local)
    assert torch.equal(split, emu_block_topk(q, k, ks, ke, bsz, topk, local, sms=1))
    assert_blocks_equal(split, ref.block_topk(q, k, ks, ke, bsz, topk, local),
                        lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)), bsz, local)


def test_positions_must_fit_32_bits():
    """The kernels divide positions in 32 bits: longer rows are a clear error, not a wrap."""
    q = torch.randn(1, 1, 8)
    ks, ke = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="keys per row is too many"):
        call("emu_block_topk", P(q), P(q), P(ks), P(ke), P(None), P(None), P(torch.empty(1, 1, 2, dtype=torch.int32)),
             I(1), I(1), I(8), I(2**31), I(0), I(1), I(0), I(0), I(1), I(4), I(2), I(1), ctypes.c_int(F32))
    kc = torch.randn(1, 4, 1, 8)
    table = torch.zeros(1, 1, dtype=torch.int32)  # max_pages is passed as 2^30: the launcher stops first
    with pytest.raises(RuntimeError, match="positions per request is too many"):
        call("emu_block_sparse_attention", P(q), P(kc), P(kc), P(table), P(ks), P(ks), P(ks.view(1, 1, 1)), P(q),
             P(torch.empty(1, 1)), I(1), I(1), I(1), I(8), I(1), I(1), I(4), I(1), I(2**30), I(4), ctypes.c_float(0.3),
             ctypes.c_int(F32))


def test_block_topk_invalid_values_are_counted():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 16, generator=g)
    k = torch.randn(20, 16, generator=g)
    ks = torch.tensor([0, 5, -1], dtype=torch.int32)
    ke = torch.tensor([10, 30, 4], dtype=torch.int32)  # row 1 past the keys, row 2 starts below 0
    box = {}
    assert errors(lambda: box.setdefault("o", emu_block_topk(q, k, ks, ke, 4, 3, 1))) == 2
    assert (box["o"][1:] == -1).all()
    assert torch.equal(box["o"][0], ref.block_topk(q[:1], k, ks[:1], ke[:1], 4, 3, 1)[0])
    keys = [torch.randn(n, 16, generator=g) for n in (20, 12)]
    cache, table = make_paged(keys, 8, g)
    for sl, tab in ((torch.tensor([20, 99], dtype=torch.int32), table),           # past the table
                    (torch.tensor([20, 12], dtype=torch.int32), table.clone().index_fill_(0, torch.tensor([1]), 77))):
        qq = torch.randn(4, 2, 16, generator=g)
        n = errors(lambda: box.__setitem__("o", emu_block_topk_paged(qq, cache, tab, sl, 2, 4, 3, 1)))
        assert n == 1 and (box["o"][2:] == -1).all()  # once per request, its rows empty


# ------------------------------------------------------------------ attention

def make_attention(dtype, lens, h_q, h_kv, d, page_size, bsz, topk, rows_per, seed, dup=True):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, h_kv, d, generator=g).to(dtype) for n in lens]
    vals = [torch.randn(n, h_kv, d, generator=g).to(dtype) for n in lens]
    kc, table = make_paged(keys, page_size, g)
    vc = torch.randn(kc.shape, generator=g).to(dtype)
    for b, v in enumerate(vals):
        for i in range(v.shape[0]):
            vc[table[b, i // page_size], i % page_size] = v[i]
    req, pos = [], []
    for b, n in enumerate(lens):
        for j in range(min(rows_per, n)):
            req.append(b)
            pos.append(n - min(rows_per, n) + j)
    req, pos = torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)
    q = torch.randn(req.shape[0], h_q, d, generator=g).to(dtype)
    blocks = torch.randint(-1, max(lens) // bsz + 2, (req.shape[0], h_kv, topk), generator=g, dtype=torch.int32)
    if dup and topk > 1:
        blocks[::3, :, 1] = blocks[::3, :, 0]  # duplicates count once
    blocks[1::7] = -1  # rows with no block: out 0, lse -inf
    return q, kc, vc, table, req, pos, blocks


@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("h_q,h_kv,d,page_size,bsz,topk,rows_per,lens", [
    (8, 2, 128, 16, 16, 4, 6, [150, 17, 40]),   # prefill-like rows
    (4, 4, 64, 8, 32, 3, 1, [90, 5, 33]),       # decode: one row per request, MHA
    (6, 1, 48, 32, 8, 9, 3, [60, 30]),          # 6 query heads on one KV head
    (16, 2, 128, 64, 128, 4, 2, [400, 130]),    # MiniMax-M3's block size
])
def test_block_sparse_attention(dtype, bar, h_q, h_kv, d, page_size, bsz, topk, rows_per, lens):
    q, kc, vc, table, req, pos, blocks = make_attention(dtype, lens, h_q, h_kv, d, page_size, bsz, topk, rows_per,
                                                       seed=h_q * d + topk)
    scale = d ** -0.5
    out, lse = emu_attention(q, kc, vc, table, req, pos, blocks, bsz, scale)
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, bsz, scale)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out.float(), e_out.float()) < bar
    finite = torch.isfinite(e_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and not finite.all()
    assert (lse[~finite] == -math.inf).all() and (out[~finite] == 0).all()
    torch.testing.assert_close(lse[finite], e_lse[finite], rtol=1e-5, atol=1e-5)
    out2, lse2 = emu_attention(q, kc, vc, table, req, pos, blocks, bsz, scale)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)  # deterministic


@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("case", ["plain", "q_nan", "k_inf", "v_nan"])
def test_attention_split_blocks(dtype, bar, case):
    """Few (row, KV head) pairs: each pair's selected blocks are split over CTAs (16 blocks of 16
    keys per split here) and merged by log-sum-exp; against the reference and the unsplit kernel
    (a one-SM device), NaN patterns included, an id < -1 counted once."""
    h_q, h_kv, d, page, bsz, topk = 4, 2, 32, 16, 16, 40
    q, kc, vc, table, req, pos, blocks = make_attention(torch.float32, [700, 300], h_q, h_kv, d, page, bsz, topk, 2,
                                                       seed=31, dup=True)
    blocks[0, 0] = torch.arange(topk, dtype=torch.int32) % 3  # keys only in the first split's entries
    blocks[1, 1, -1] = -5
    pg = int(table[0, 0])
    if case == "q_nan":
        q[2, 1, 3] = math.nan
    elif case == "k_inf":
        kc[pg, 3, 0, 2] = math.inf  # request 0, key 3, read by rows of request 0 selecting block 0
    elif case == "v_nan":
        vc[pg, 4, 1, 7] = math.nan
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    args = (q, kc, vc, table, req, pos, blocks)
    box = {}
    assert errors(lambda: box.setdefault("s", emu_attention(*args, bsz, 0.3))) == 1
    out, lse = box["s"]
    one_out, one_lse = emu_attention(*args, bsz, 0.3, sms=1)
    fixed = blocks.clone()
    fixed[1, 1, -1] = -1
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, fixed, bsz, 0.3)
    for o, l in ((out, lse), (one_out, one_lse)):
        o = o.float()
        assert torch.equal(torch.isnan(l), torch.isnan(e_lse)) and torch.equal(torch.isnan(o), torch.isnan(e_out.float()))
        assert bool(torch.isnan(e_lse).any()) == (case in ("q_nan", "k_inf"))
        fin = torch.isfinite(e_out.float())
        assert rel_err(o[fin], e_out.float()[fin]) < bar
        ok = torch.isfinite(e_lse)
        torch.testing.assert_close(l[ok], e_lse[ok], rtol=1e-5, atol=1e-5)


def test_attention_invalid_values_are_counted():
    q, kc, vc, table, req, pos, blocks = make_attention(torch.float32, [50, 20], 4, 2, 32, 8, 8, 3, 3, seed=11,
                                                       dup=False)
    blocks[blocks == -1] = 0
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, 8, 0.2)
    bad_req, bad_blocks = req.clone(), blocks.clone()
    bad_req[0] = 5                       # no such request: the row reads nothing (counted once)
    bad_blocks[2, 1, 0] = -3             # an id < -1: dropped like -1, counted
    box = {}
    n = errors(lambda: box.setdefault("r", emu_attention(q, kc, vc, table, bad_req, pos, bad_blocks, 8, 0.2)))
    out, lse = box["r"]
    assert n == 2
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    fixed = blocks.clone()
    fixed[2, 1, 0] = -1
    f_out, f_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, fixed, 8, 0.2)
    assert rel_err(out[1:], f_out[1:]) < 1e-5 and torch.allclose(lse[1:], f_lse[1:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(f_out[2], e_out[2])  # the dropped id mattered


# ------------------------------------------------------------------ non-finite inputs (docs/ops.md)

def same_nan(a, b):
    a, b = a.float(), b.float()
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b)) and \
        torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["q_nan", "k_nan", "k_inf", "k_ninf", "q_inf"])
def test_block_topk_non_finite(dtype, case):
    g = torch.Generator().manual_seed(5)
    h, d, bsz, topk, local = 3, 32, 4, 3, 1
    ks, ke, s_kv = windows([37, 22], 4)
    q = torch.randn(ks.shape[0], h, d, generator=g)
    k = torch.randn(s_kv, d, generator=g)
    if case == "q_nan":
        q[1, 2, 5] = math.nan
    elif case == "q_inf":
        q[2, 0, 3] = math.inf
    else:
        k[[6, 13, 40], 7] = {"k_nan": math.nan, "k_inf": math.inf, "k_ninf": -math.inf}[case]
    q, k = q.to(dtype), k.to(dtype)
    expect = ref.block_topk(q, k, ks, ke, bsz, topk, local)
    assert_blocks_equal(emu_block_topk(q, k, ks, ke, bsz, topk, local), expect,
                        lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)), bsz, local)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["q_nan", "q_inf", "k_nan", "k_inf", "k_unread_nan", "v_nan", "v_inf"])
def test_attention_non_finite(dtype, case):
    h_q, h_kv, d, page, bsz = 4, 2, 32, 8, 8
    q, kc, vc, table, req, pos, blocks = make_attention(torch.float32, [40, 25], h_q, h_kv, d, page, bsz, 3, 3,
                                                       seed=21, dup=False)
    blocks[:, :, 0] = 0  # every row reads block 0 of its request
    pg0 = int(table[0, 0])  # request 0's first page: block 0's keys 0..7
    if case == "q_nan":
        q[1, 3, 4] = math.nan
    elif case == "q_inf":
        q[0, 0, 1] = math.inf
    elif case in ("k_nan", "k_inf"):
        kc[pg0, 2, 1, 9] = math.nan if case == "k_nan" else math.inf
    elif case == "k_unread_nan":
        kc[:, :, 0, 0] = math.nan  # KV head 0 ...
        blocks[:, 0] = -1          # ... which no row reads
    else:
        vc[pg0, 5, 0, 3] = math.nan if case == "v_nan" else math.inf
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, bsz, 0.2)
    out, lse = emu_attention(q, kc, vc, table, req, pos, blocks, bsz, 0.2)
    assert torch.isnan(e_lse).any() == (case in ("q_nan", "q_inf", "k_nan", "k_inf"))
    assert same_nan(lse, e_lse)
    fin = torch.isfinite(e_out.float())
    assert torch.equal(fin, torch.isfinite(out.float()))
    if case.startswith("v_"):
        assert torch.equal(torch.isnan(out.float()), torch.isnan(e_out.float())) or case == "v_inf"
    assert rel_err(out.float()[fin], e_out.float()[fin]) < (1e-5 if dtype == torch.float32 else 1e-2)


# ------------------------------------------------------------------ property-based fuzz

NONFINITE = [math.nan, -math.nan, math.inf, -math.inf]


def sprinkle(draw, x):
    """x with up to 3 entries set to NaN / ±inf, on half the draws."""
    if x.numel() == 0 or not draw(st.booleans()):
        return x
    flat = x.view(-1)
    for _ in range(draw(st.integers(1, 3))):
        flat[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(NONFINITE))
    return x


@settings(deadline=None, max_examples=max(5, settings.default.max_examples // 15))
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_emu_fuzz_block_sparse(data, seed):
    draw = data.draw
    g = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    h_kv, grp = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    local = draw(st.integers(0, 3))
    if draw(st.booleans()):  # long rows, many blocks: the split top-k scoring and split attention
        d, bsz, topk = draw(st.sampled_from([8, 16])), draw(st.sampled_from([16, 32])), draw(st.integers(1, 40))
        lens = draw(st.lists(st.integers(1, 5000), min_size=1, max_size=2))
        page = draw(st.sampled_from([16, 64]))
    else:
        d, bsz, topk = draw(st.sampled_from([1, 8, 17, 64])), draw(st.integers(1, 24)), draw(st.integers(1, 6))
        lens = draw(st.lists(st.integers(1, 90), min_size=1, max_size=2))
        page = draw(st.sampled_from([1, 4, 16]))
    # block top-k, prefill or paged decode, with NaN / inf sprinkled over q and the keys
    if draw(st.booleans()):
        ks, ke, s_kv = windows(lens, draw(st.integers(1, 3)))
        q = sprinkle(draw, torch.randn(ks.shape[0], h_kv, d, generator=g)).to(dtype)
        k = sprinkle(draw, torch.randn(s_kv, d, generator=g)).to(dtype)
        got = emu_block_topk(q, k, ks, ke, bsz, topk, local)
        assert_blocks_equal(got, ref.block_topk(q, k, ks, ke, bsz, topk, local),
                            lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)), bsz, local)
    else:
        next_n = draw(st.integers(1, 3))
        keys = [sprinkle(draw, torch.randn(n, d, generator=g)).to(dtype) for n in lens]
        cache, table = make_paged(keys, page, g)
        sl = torch.tensor(lens, dtype=torch.int32)
        q = sprinkle(draw, torch.randn(len(lens) * next_n, h_kv, d, generator=g)).to(dtype)
        got = emu_block_topk_paged(q, cache, table, sl, next_n, bsz, topk, local)

        def row(t):
            w = lens[t // next_n] - next_n + t % next_n + 1
            return q[t], keys[t // next_n][:max(w, 0)], w - 1

        assert_blocks_equal(got, ref.block_topk_paged(q, cache, table, sl, next_n, bsz, topk, local), row, bsz, local)
    # attention over random block ids (duplicates, -1, ids past the position), NaN / inf anywhere
    args = list(make_attention(dtype, lens, h_kv * grp, h_kv, d, page, bsz, topk, draw(st.integers(1, 3)), seed=seed))
    for i in range(3):
        args[i] = sprinkle(draw, args[i].float()).to(dtype)
    scale = d ** -0.5
    out, lse = emu_attention(*args, bsz, scale)
    e_out, e_lse = ref.block_sparse_attention(*args, bsz, scale)
    out, e_out = out.float(), e_out.float()
    assert torch.equal(torch.isnan(lse), torch.isnan(e_lse))
    assert torch.equal(lse[torch.isinf(lse)], e_lse[torch.isinf(e_lse)])
    assert torch.equal(torch.isfinite(out), torch.isfinite(e_out))
    fin = torch.isfinite(e_out)
    if fin.any():
        assert rel_err(out[fin], e_out[fin]) < (1e-5 if dtype == torch.float32 else 1e-2)
    ok = torch.isfinite(e_lse)
    torch.testing.assert_close(lse[ok], e_lse[ok], rtol=1e-5, atol=1e-5)
