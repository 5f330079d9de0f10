"""The CUDA kernels and launch code (csrc/cuda/*_impl.cuh), run on the CPU through the
cuda_emu.h emulator, against reference.py — the same bars as tests/test_ops.py, plus the
paths only the CUDA code has (split top-k, candidate compaction, key-range splits, the
k > 2048 fallback, the fp32 and tensor-core sparse MLA).

    python -m pytest -q csrc/tests/cuda_emu/test_emu.py

Builds libicemu.so with g++ (C++20) on first use. Slow by design (one OS thread per CUDA
thread); shapes are small. Says nothing about speed or about the real hardware's mma.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from emu_build import load_emu_lib, load_reference

# reference.py is pure torch: load it directly, so no build of indexcache._C is needed. The format
# numbers it imports (indexcache/formats.py, which imports nothing) are loaded the same way.
ref = load_reference("reference.py", "indexcache_reference")
F32, BF16, FP8 = 0, 1, 2
POISON_I = -7777


def lib() -> ctypes.CDLL:
    return load_emu_lib("emu_ops.cpp", None, "emu_last_error")


def P(t):
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def I(x):
    return ctypes.c_int64(int(x))


def call(name, *args, sms=132, smem=227 * 1024):
    L = lib()
    L.emu_set_device(ctypes.c_int(sms), ctypes.c_int(smem))
    rc = getattr(L, name)(*args)
    if rc != 0:
        raise RuntimeError(L.emu_last_error().decode())


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def dt_code(t):
    return {torch.float32: F32, torch.bfloat16: BF16, torch.float8_e4m3fn: FP8, torch.uint8: FP8}[t.dtype]


# ------------------------------------------------------------------ element-wise ops

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("shape", [(9, 4, 128), (3, 256)])
def test_quantize(dtype, hadamard, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 100).to(dtype).contiguous()
    v = torch.full(shape, 0x55, dtype=torch.uint8)
    s = torch.full(shape[:-1] + (shape[-1] // 128,), float("nan"))
    rows = x.numel() // shape[-1]
    call("emu_quantize", P(x), ctypes.c_int(dt_code(x)), P(v), P(s), I(rows), I(shape[-1]), ctypes.c_float(1e-10),
         ctypes.c_int(int(hadamard)))
    rv, rs = ref.quantize_fp8(x, 1e-10, hadamard)
    assert torch.equal(v, rv.view(torch.uint8))
    assert torch.equal(s, rs)


def test_quantize_rounding_ties():
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2
    vals = torch.cat([codes, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1)])
    vals = torch.cat([vals, -vals])
    vals = torch.cat([vals, torch.full(((-vals.numel()) % 128,), 448.0)]).reshape(-1, 128).contiguous()
    vals[:, 0] = 448.0
    v = torch.empty(vals.shape, dtype=torch.uint8)
    s = torch.empty(vals.shape[0], 1)
    call("emu_quantize", P(vals), ctypes.c_int(F32), P(v), P(s), I(vals.shape[0]), I(128), ctypes.c_float(1e-4),
         ctypes.c_int(0))
    assert (s == 1).all()
    assert torch.equal(v, vals.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_k_insert(dtype):
    torch.manual_seed(1)
    n, blocks, bs = 150, 5, 64
    k = torch.randn(n, 128).to(dtype)
    slots = torch.randperm(blocks * bs)[:n]
    slots[::7] = -1
    cache = torch.randint(0, 255, (blocks, bs * 132), dtype=torch.uint8)
    expect = cache.clone()
    call("emu_index_k_insert", P(k), P(slots), P(cache), I(n), I(128), I(bs), I(blocks), ctypes.c_int(0),
         ctypes.c_int(dt_code(k)))
    ref.index_k_cache_insert(k, slots, expect)
    assert torch.equal(cache, expect)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_mla_insert(cache_dtype, src):
    torch.manual_seed(2)
    n, blocks, bs = 70, 3, 32
    kv_c, k_pe = torch.randn(n, 512).to(src), torch.randn(n, 64).to(src)
    slots = torch.randperm(blocks * bs)[:n]
    slots[3] = -1
    width = 656 if cache_dtype == torch.uint8 else 576
    cache = torch.full((blocks, bs, width), 3, dtype=cache_dtype)
    expect = cache.clone()
    call("emu_mla_insert", P(kv_c), P(k_pe), P(slots), P(cache), I(n), I(blocks * bs), ctypes.c_int(dt_code(kv_c)),
         ctypes.c_int(dt_code(cache)))
    ref.mla_kv_cache_insert(kv_c, k_pe, slots, expect)
    assert torch.equal(cache.view(torch.uint8), expect.view(torch.uint8))


def test_positions_to_slots():
    torch.manual_seed(3)
    n, k, batch, bs = 12, 40, 3, 16
    table = torch.randperm(30, dtype=torch.int32).reshape(batch, 10)
    pos = torch.randint(0, 160, (n, k), dtype=torch.int32)
    pos[:, ::5] = -1
    req = torch.randint(0, batch, (n,), dtype=torch.int32)
    out = torch.full_like(pos, POISON_I)
    call("emu_positions_to_slots", P(pos), P(req), P(table), P(out), I(n), I(k), I(batch), I(10), I(bs), I(30))
    assert torch.equal(out, ref.positions_to_slots(pos, req, table, bs))


# ------------------------------------------------------------------ top-k

def run_topk(logits, ks, ke, topk, width=None, rows_buf=None, sms=132):
    rows = logits.shape[0]
    width = topk if width is None else width
    out = torch.full((rows if rows_buf is None else rows_buf, width), POISON_I, dtype=torch.int32)
    call("emu_topk", P(logits), P(ks), P(ke), I(rows), I(logits.stride(0)), P(out), I(width), I(width), I(topk),
         I(logits.shape[1]), sms=sms)
    return out


@pytest.mark.parametrize("rows,n,topk", [(4, 10, 16), (3, 64, 64), (5, 1000, 64), (2, 5000, 2048), (6, 300, 1)])
def test_topk_tie_free(rows, n, topk):
    torch.manual_seed(4)
    logits = torch.stack([torch.randperm(n).float() * 0.5 - n / 7 for _ in range(rows)])
    ks = torch.zeros(rows, dtype=torch.int32)
    ke = torch.full((rows,), n, dtype=torch.int32)
    out = run_topk(logits, ks, ke, topk, topk + 5, rows + 3)
    got = out[:rows]
    assert (out[rows:] == POISON_I).all()
    assert torch.equal(got, ref.topk_indices(logits, ks, ke, topk, topk + 5))


def test_topk_windows_and_ties():
    torch.manual_seed(5)
    rows, n, topk = 40, 700, 50
    logits = torch.randint(-5, 5, (rows, n)).float()
    logits[3] = -math.inf
    ks = torch.randint(0, n, (rows,), dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(0, 300, (rows,), dtype=torch.int32), torch.tensor(n, dtype=torch.int32))
    ks[3], ke[3] = 0, n
    ks[4], ke[4] = 10, 10
    ks[5], ke[5] = 100, 100 + topk
    assert torch.equal(run_topk(logits, ks, ke, topk), ref.topk_indices(logits, ks, ke, topk))


@pytest.mark.parametrize("kind", ["randn", "ties", "nan_inf"])
# Few long rows: 8 SMs take the persistent kernel (4 co-resident CTAs per row), 3 SMs the
# split + merge path (fewer than 2 CTAs per row fit), 1 SM one CTA per row.
@pytest.mark.parametrize("sms", [8, 3, 1])
def test_topk_long_rows(kind, sms):
    torch.manual_seed(6)
    rows, n, topk = 2, 40000, 1024
    if kind == "randn":
        logits = torch.randn(rows, n)
    elif kind == "ties":
        logits = torch.randint(-3, 4, (rows, n)).float()
    else:
        logits = torch.randn(rows, n)
        logits[:, ::97] = math.inf
        logits[:, 5::89] = -math.inf
        logits[0, 7::1001] = float("nan")
    ks = torch.tensor([0, 17], dtype=torch.int32)
    ke = torch.tensor([n, n - 1234], dtype=torch.int32)
    got = run_topk(logits, ks, ke, topk, sms=sms)
    assert torch.equal(got, ref.topk_indices(logits, ks, ke, topk))


def test_topk_persistent_mixed_rows():
    """The persistent kernel with a short row (window <= k: no handshake), a row whose window
    leaves the last pieces empty-ish, heavy ties across piece borders, and an output wider than k."""
    torch.manual_seed(7)
    rows, n, topk = 3, 36000, 700
    logits = torch.randint(-2, 3, (rows, n)).float()
    logits[2, 20000:] = 5.0  # ties at the top, all in the later pieces
    ks = torch.tensor([0, 100, 3], dtype=torch.int32)
    ke = torch.tensor([n, 100 + topk - 1, 33000], dtype=torch.int32)
    got = run_topk(logits, ks, ke, topk, topk + 9, sms=7)  # 2 CTAs per row
    expect = ref.topk_indices(logits, ks, ke, topk, topk + 9)
    assert torch.equal(got, expect)
    assert torch.equal(run_topk(logits, ks, ke, topk, topk + 9, sms=1), expect)


# ------------------------------------------------------------------ indexer

def indexer_inputs(s_q, s_kv, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, 128, generator=g) * 2 + 0.1
    k = torch.randn(s_kv, 128, generator=g) + 0.05
    w = torch.randn(s_q, h, generator=g)
    if dtype == "fp8":
        qv, qs = ref.quantize_fp8(q, ref.INDEX_Q_EPS)
        kv, ksc = ref.quantize_fp8(k, ref.INDEX_K_EPS)
        return qv, kv, ksc[:, 0].contiguous(), ref.indexer_weights(w, qs[..., 0]).contiguous()
    t = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return q.to(t), k.to(t), None, ref.indexer_weights(w).contiguous()


def causal_windows(s_q, s_kv):
    a = s_kv // 2
    ks, ke = [], []
    for t in range(s_q):
        if t % 2 == 0:
            ks.append(0)
            ke.append(max(1, a - (s_q - t)))
        else:
            ks.append(a)
            ke.append(max(a + 1, s_kv - (s_q - t)))
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


def run_logits(q, k, ksc, w, ks, ke, cols=None, sms=132):
    s_q, h = q.shape[0], q.shape[1]
    s_kv = k.shape[0]
    cols = s_kv if cols is None else cols
    out = torch.full((s_q, cols), float("nan"))
    call("emu_indexer_logits", P(q), P(k), P(ksc), P(w), P(ks), P(ke), I(s_q), I(s_kv), I(h),
         ctypes.c_int(dt_code(q)), P(out), I(cols), I(cols), sms=sms)
    return out


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_indexer_logits_long_cta_walk(dtype):
    # sms=1: each CTA stages q once and walks all 40 key tiles (sms=132: 8 tiles per CTA).
    q, k, ksc, w = indexer_inputs(3, 2560, 16, dtype, seed=5)
    ks, ke = causal_windows(3, 2560)
    got = run_logits(q, k, ksc, w, ks, ke, sms=1)
    assert torch.equal(got, run_logits(q, k, ksc, w, ks, ke))
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    fin = torch.isfinite(expect)
    assert rel_err(got[fin], expect[fin]) < 1e-5


def run_fused(q, k, ksc, w, ks, ke, topk, rows_buf=None, sms=132):
    s_q, h = q.shape[0], q.shape[1]
    out = torch.full((s_q if rows_buf is None else rows_buf, topk), POISON_I, dtype=torch.int32)
    call("emu_indexer_topk", P(q), P(k), P(ksc), P(w), P(ks), P(ke), I(s_q), I(k.shape[0]), I(h),
         ctypes.c_int(dt_code(q)), P(out), I(topk), I(topk), I(topk), sms=sms)
    return out


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("s_q,s_kv,h", [(1, 1, 64), (7, 300, 64), (3, 33, 5), (10, 700, 12)])
def test_indexer_logits(dtype, s_q, s_kv, h):
    q, k, ksc, w = indexer_inputs(s_q, s_kv, h, dtype)
    ks, ke = causal_windows(s_q, s_kv)
    got = run_logits(q, k, ksc, w, ks, ke, cols=s_kv + 3)
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    assert not got.isnan().any()
    assert torch.isinf(got[:, s_kv:]).all()
    got = got[:, :s_kv]
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    fin = torch.isfinite(expect)
    assert rel_err(got[fin], expect[fin]) < 1e-5


@pytest.mark.parametrize("dtype,s_q,s_kv,h,topk,sms", [
    ("fp8", 6, 200, 64, 16, 132),      # compactions (cap 96 over ~100 keys per row)
    ("bf16", 9, 3000, 16, 256, 132),
    ("fp32", 4, 50, 8, 64, 132),       # windows <= k: no scoring at all
    ("fp8", 2, 9000, 4, 64, 132),      # two key-range splits
    ("fp8", 5, 1200, 8, 8, 1),         # many compactions, one split
    ("fp8", 2, 9000, 4, 2048, 132),    # k = 2048: the largest candidate lists
    ("bf16", 3, 5000, 4, 2100, 132),   # k > 2048: chunked logits + top-k fallback
])
def test_indexer_topk(dtype, s_q, s_kv, h, topk, sms):
    q, k, ksc, w = indexer_inputs(s_q, s_kv, h, dtype, seed=s_kv)
    ks, ke = causal_windows(s_q, s_kv)
    out = run_fused(q, k, ksc, w, ks, ke, topk, rows_buf=s_q + 2, sms=sms)
    assert (out[s_q:] == POISON_I).all()
    got = out[:s_q]
    logits = run_logits(q, k, ksc, w, ks, ke)
    # Same scores as the plain op, so exactly its selection (and the reference's on them).
    assert torch.equal(got, ref.topk_indices(logits, ks, ke, topk))
    expect = ref.indexer_topk(q, k, ksc, w, ks, ke, topk)
    assert torch.equal((got >= 0).sum(1), (expect >= 0).sum(1))


def test_cvt_e4m3x2_to_f16x2():
    L = lib()
    L.emu_cvt_f16x2_e4m3x2.restype = ctypes.c_uint32
    codes = torch.arange(256, dtype=torch.int32)
    expect = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).int() & 0xffff
    for b in range(256):
        hi = 255 - b
        r = L.emu_cvt_f16x2_e4m3x2(ctypes.c_uint32(b | (hi << 8)))
        for code, half in ((b, r & 0xffff), (hi, r >> 16)):
            if code & 0x7f == 0x7f:
                assert half & 0x7c00 == 0x7c00 and half & 0x3ff, (code, hex(half))  # NaN
            else:
                assert half == int(expect[code]), (code, hex(half), hex(int(expect[code])))


@pytest.mark.parametrize("variant", [1, 2, 4, 5])  # .x1, .x2, .x4, .x4.trans
def test_ldmatrix_layout(variant):
    """ldmatrix per the PTX ISA: lane t receives elements (t / 4, 2 (t % 4) .. +1) of matrix j in
    register j (.trans: (2 (t % 4), t / 4) and (2 (t % 4) + 1, t / 4)), the lower one in the low half."""
    src = torch.randint(0, 1 << 16, (4, 8, 8), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    src16 = src.to(torch.int16).contiguous()
    out32 = torch.zeros(32, 4, dtype=torch.int32)
    rc = lib().emu_ldmatrix(ctypes.c_int(variant), P(src16), P(out32))
    assert rc == 0, lib().emu_last_error()
    out = out32.long() & 0xFFFFFFFF
    n = 4 if variant == 5 else variant
    for t in range(32):
        for j in range(4):
            if j >= n:
                assert out[t, j] == 0
                continue
            m = src[j] & 0xFFFF
            lo, hi = (m[2 * (t % 4), t // 4], m[2 * (t % 4) + 1, t // 4]) if variant == 5 else \
                     (m[t // 4, 2 * (t % 4)], m[t // 4, 2 * (t % 4) + 1])
            assert int(out[t, j]) == int(lo) | (int(hi) << 16), (variant, t, j)


@pytest.mark.parametrize("threads", [64, 256])
def test_emulator_barriers(threads):
    """The emulator's threads take turns between barriers in a shuffled order: with __syncthreads each
    thread reads its neighbour's write; without it some read the block's initial garbage (a missing
    barrier is a wrong result, not luck); a warp collective half a warp never joins is an error."""
    expect = (torch.arange(threads) + 1) % threads + 1
    for mode in (0, 1):
        out = torch.full((threads,), POISON_I, dtype=torch.int32)
        assert lib().emu_barrier_probe(ctypes.c_int(mode), ctypes.c_int(threads), P(out)) == 0, lib().emu_last_error()
        stale = int((out != expect).sum())
        assert (stale == 0) if mode == 0 else (0 < stale < threads), (mode, stale)
        if mode == 1:
            assert bool((out[out != expect] == 0xA5A5A5A5 - (1 << 32)).all())
    out = torch.full((threads,), POISON_I, dtype=torch.int32)
    assert lib().emu_barrier_probe(ctypes.c_int(2), ctypes.c_int(threads), P(out)) == 1
    assert b"deadlock" in lib().emu_last_error()


def fp8_path(on):
    return lib().emu_set_fp8_f16(ctypes.c_int(1 if on else 0))


@pytest.mark.parametrize("s_q,s_kv,h,topk", [(5, 700, 64, 32), (3, 300, 12, 40)])
def test_indexer_fp8_paths_identical(s_q, s_kv, h, topk):
    """The sm_89+ path (hardware e4m3x2 -> f16x2, f16 mma) and the software e4m3 -> bf16 path
    give the same bits; every e4m3 code (NaN too) appears in q and keys."""
    g = torch.Generator().manual_seed(21)
    q = torch.randint(0, 256, (s_q, h, 128), dtype=torch.uint8, generator=g)
    k = torch.randint(0, 256, (s_kv, 128), dtype=torch.uint8, generator=g)
    k[:256, 0] = torch.arange(256, dtype=torch.uint8)
    k[:, 1:][(k[:, 1:] & 0x7f) == 0x7f] = 0x38  # NaN only in column 0 of a few keys
    q[0, 0, :] = torch.arange(128, dtype=torch.uint8) + 128 * (torch.arange(128) % 2 == 0).to(torch.uint8)
    q[(q & 0x7f) == 0x7f] = 0x30
    q, k = q.view(torch.float8_e4m3fn), k.view(torch.float8_e4m3fn)
    ksc = torch.rand(s_kv, generator=g) + 0.5
    w = torch.randn(s_q, h, generator=g)
    ks, ke = causal_windows(s_q, s_kv)
    outs = []
    was = fp8_path(True)
    try:
        for on in (True, False):
            fp8_path(on)
            outs.append((run_logits(q, k, ksc, w, ks, ke), run_fused(q, k, ksc, w, ks, ke, topk)))
    finally:
        fp8_path(was)
    (l16, f16), (lbf, fbf) = outs
    assert torch.equal(l16.isnan(), lbf.isnan()) and l16.isnan().any()
    fin = ~l16.isnan()
    assert torch.equal(l16[fin], lbf[fin]) and torch.equal(f16, fbf)
    assert torch.isfinite(l16[fin]).sum() > 0


def paged_inputs(batch, next_n, h, bs, blocks, seq_lens, max_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(blocks, generator=g, dtype=torch.int32)[: batch * max_blocks].reshape(batch, max_blocks)
    cache = torch.zeros(blocks, bs * 132, dtype=torch.uint8)
    for b in range(batch):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        ref.index_k_cache_insert(torch.randn(n, 128, generator=g), table[b, pos // bs].long() * bs + pos % bs, cache)
    qv, qs = ref.quantize_fp8(torch.randn(batch * next_n, h, 128, generator=g), ref.INDEX_Q_EPS)
    w = ref.indexer_weights(torch.randn(batch * next_n, h, generator=g), qs[..., 0]).contiguous()
    return qv, w, cache, table.contiguous()


@pytest.mark.parametrize("bs", [64, 16, 5])  # 5: block rows not 16-byte aligned (scalar loads)
def test_indexer_paged(bs):
    batch, next_n, h = 3, 2, 64
    seq_lens = torch.tensor([5, 130, 64], dtype=torch.int32)
    max_blocks = (140 + bs - 1) // bs
    blocks = batch * max_blocks + 2
    qv, w, cache, table = paged_inputs(batch, next_n, h, bs, blocks, seq_lens, max_blocks)
    max_len = 140
    out = torch.full((batch * next_n, max_len), float("nan"))
    args = [P(qv), P(w), P(cache), P(table), P(seq_lens), I(batch), I(next_n), I(h), I(bs), I(max_blocks), I(blocks)]
    call("emu_indexer_logits_paged", *args, I(130), P(out), I(max_len), I(max_len))
    expect = ref.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, max_len)
    assert torch.equal(torch.isinf(out), torch.isinf(expect)) and not out.isnan().any()
    fin = torch.isfinite(expect)
    assert rel_err(out[fin], expect[fin]) < 1e-5
    topk = 40
    buf = torch.full((batch * next_n + 1, topk), POISON_I, dtype=torch.int32)
    call("emu_indexer_topk_paged", *args, I(130), P(buf), I(topk), I(topk), I(topk))
    windows = ref.decode_windows(seq_lens, next_n).int()
    assert torch.equal(buf[:-1], ref.topk_indices(out, torch.zeros_like(windows), windows, topk))
    assert (buf[-1] == POISON_I).all()


def test_indexer_paged_long_splits_and_fallback():
    batch, next_n, h, bs = 2, 3, 8, 64
    seq_lens = torch.tensor([9000, 300], dtype=torch.int32)
    max_blocks = 9000 // bs + 1
    blocks = batch * max_blocks
    qv, w, cache, table = paged_inputs(batch, next_n, h, bs, blocks, seq_lens, max_blocks, seed=3)
    args = [P(qv), P(w), P(cache), P(table), P(seq_lens), I(batch), I(next_n), I(h), I(bs), I(max_blocks), I(blocks)]
    out = torch.full((batch * next_n, 9000), float("nan"))
    call("emu_indexer_logits_paged", *args, I(9000), P(out), I(9000), I(9000))
    windows = ref.decode_windows(seq_lens, next_n).int()
    for topk in (100, 2100):
        buf = torch.full((batch * next_n, topk), POISON_I, dtype=torch.int32)
        call("emu_indexer_topk_paged", *args, I(9000), P(buf), I(topk), I(topk), I(topk))
        assert torch.equal(buf, ref.topk_indices(out, torch.zeros_like(windows), windows, topk))


def test_indexer_topk_few_long_rows_route():
    """Few long rows (decode) that the fused grid cannot spread over the SMs (one row block, 8
    splits, 132 SMs) go to the logits kernel (keys split over the GPU) and the few-long-rows
    top-k (persistent, 8 CTAs per row). Exact inputs (exact_indexer_inputs, below), so the
    selection must be reference.py's bit for bit: top k over its logits, ties to the lower
    position. (The fused kernel that runs where the route does not apply, two key-range splits at
    k = 2048, is test_indexer_topk's fp8-2-9000-4-2048 case.)"""
    s_kv, h, topk = 33000, 4, 2048
    q, k, ksc, w = exact_indexer_inputs(2, s_kv, h, "fp8", seed=7)
    ks = torch.tensor([0, 5], dtype=torch.int32)
    ke = torch.tensor([s_kv, s_kv - 7], dtype=torch.int32)
    routed = run_fused(q, k, ksc, w, ks, ke, topk, sms=132)
    assert (routed >= 0).all()
    assert torch.equal(routed, ref.indexer_topk(q, k, ksc, w, ks, ke, topk))


# ------------------------------------------------------------------ sparse MLA

def make_mla(cache_kind, s_q, topk, blocks=3, bs=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = blocks * bs
    width = 656 if cache_kind == "fp8" else 576
    dt = {"fp8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}[cache_kind]
    cache = torch.zeros(blocks, bs, width, dtype=dt)
    ref.mla_kv_cache_insert(torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g), torch.arange(n), cache)
    idx = torch.randint(0, n, (s_q, topk), dtype=torch.int32, generator=g)
    idx[:, ::3] = -1
    return cache, idx


@pytest.mark.parametrize("cache_kind,q_dtype,bar", [("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2),
                                                     ("fp8", torch.bfloat16, 1e-2), ("bf16", torch.float32, 1e-5),
                                                     ("fp8", torch.float32, 1e-5)])
@pytest.mark.parametrize("s_q,h,topk,d_v", [(3, 16, 64, 512), (2, 20, 200, 512), (3, 5, 7, 512), (2, 16, 40, 128)])
def test_sparse_mla(cache_kind, q_dtype, bar, s_q, h, topk, d_v):
    cache, idx = make_mla(cache_kind, s_q, topk)
    idx[1 % s_q] = -1
    q = torch.randn(s_q, h, 576, generator=torch.Generator().manual_seed(9)).to(q_dtype)
    out = torch.full((s_q, h, d_v), float("nan"), dtype=q_dtype)
    lse = torch.full((s_q, h), float("nan"))
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    call("emu_sparse_mla", P(q), P(cache), P(idx), P(out), P(lse), I(s_q), I(h), I(topk), I(cache.shape[0] * cache.shape[1]),
         I(d_v), ctypes.c_float(scale), ctypes.c_int(dt_code(q)), ctypes.c_int(dt_code(cache)))
    ro, rl = ref.sparse_mla(q, cache, idx, scale, d_v)
    got = out.float()
    assert torch.isfinite(got).all()
    assert (got[1 % s_q] == 0).all() and torch.isneginf(lse[1 % s_q]).all()
    assert rel_err(got, ro.float()) < bar
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - rl[fin]).abs().max() < (1e-4 if bar < 1e-2 else 2e-2)


# ------------------------------------------------------------------ misaligned inputs (scalar load paths)

def misaligned(t):
    """A copy of t whose data pointer is 1 element (fp8: 1 byte) off 16-byte alignment."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype)
    base = flat.data_ptr()
    off = next(i for i in range(1, 16) if (base + i * t.element_size()) % 16 != 0)
    view = flat[off:off + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_indexer_misaligned(dtype):
    q, k, ksc, w = indexer_inputs(5, 260, 16, dtype, seed=11)
    ks, ke = causal_windows(5, 260)
    expect = run_logits(q, k, ksc, w, ks, ke)
    qm, km = misaligned(q.view(torch.uint8) if dtype == "fp8" else q), misaligned(k.view(torch.uint8) if dtype == "fp8" else k)
    if dtype == "fp8":
        qm, km = qm.view(torch.float8_e4m3fn), km.view(torch.float8_e4m3fn)
    assert torch.equal(run_logits(qm, km, ksc, w, ks, ke), expect)
    assert torch.equal(run_fused(qm, km, ksc, w, ks, ke, 32), run_fused(q, k, ksc, w, ks, ke, 32))


# ------------------------------------------------------------------ indexer: the cp.async key ring

def ring_stages(n):
    """Forces the indexer's key-ring depth (0: the launcher's choice); returns the previous one."""
    return lib().emu_set_indexer_stages(ctypes.c_int(n))


def exact_indexer_inputs(s_q, s_kv, h, dtype, seed):
    """Inputs whose logits are exact in fp32 in any summation order: small integers in q and
    keys (exact in e4m3 and bf16), weights in quarters, power-of-two key scales. The CUDA
    code must then match reference.py bit for bit."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (s_q, h, 128), generator=g).float()
    k = torch.randint(-3, 4, (s_kv, 128), generator=g).float()
    w = torch.randint(-4, 5, (s_q, h), generator=g).float() * 0.25
    if dtype == "fp8":
        ksc = torch.pow(2.0, torch.randint(-3, 4, (s_kv,), generator=g).float())
        return q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), ksc, w
    return q.bfloat16(), k.bfloat16(), None, w


# Windows that leave whole tiles between them unneeded (empty ring groups), start and end off
# the 4-key scale groups, and one empty row.
RING_WINDOWS = [(0, 70), (1901, 2000), (3, 67), (130, 131), (700, 700), (2590, 2600), (255, 1290)]


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("h,stages,sms", [(16, 2, 1), (16, 3, 132), (64, 4, 1), (12, 3, 1), (48, 0, 132)])
def test_indexer_ring_bit_exact(dtype, h, stages, sms):
    """The aligned (cp.async ring) instantiations at every ring depth, on windows that skip
    tiles: logits bit-identical to reference.py (exact inputs), the fused op's selection equal
    to the reference's, and both equal to the synchronous misaligned path."""
    s_kv = 2600
    q, k, ksc, w = exact_indexer_inputs(len(RING_WINDOWS), s_kv, h, dtype, seed=h + stages)
    ks = torch.tensor([a for a, _ in RING_WINDOWS], dtype=torch.int32)
    ke = torch.tensor([b for _, b in RING_WINDOWS], dtype=torch.int32)
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    was = ring_stages(stages)
    try:
        got = run_logits(q, k, ksc, w, ks, ke, sms=sms)
        fused = run_fused(q, k, ksc, w, ks, ke, 16, sms=sms)
    finally:
        ring_stages(was)
    assert torch.equal(got, expect)
    assert torch.equal(fused, ref.indexer_topk(q, k, ksc, w, ks, ke, 16))
    raw = (lambda t: t.view(torch.uint8)) if dtype == "fp8" else (lambda t: t)
    back = (lambda t: t.view(torch.float8_e4m3fn)) if dtype == "fp8" else (lambda t: t)
    qm, km = back(misaligned(raw(q))), back(misaligned(raw(k)))
    assert torch.equal(run_logits(qm, km, ksc, w, ks, ke, sms=sms), expect)
    assert torch.equal(run_fused(qm, km, ksc, w, ks, ke, 16, sms=sms), fused)


def test_indexer_ring_misaligned_scales_take_the_sync_path():
    """A key-scale pointer off 16 bytes (the rest aligned) selects the synchronous staging;
    same bits."""
    q, k, ksc, w = exact_indexer_inputs(3, 700, 16, "fp8", seed=2)
    ks, ke = causal_windows(3, 700)
    flat = torch.empty(701)
    kscm = flat[1:]
    kscm.copy_(ksc)
    assert kscm.data_ptr() % 16 != 0
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    assert torch.equal(run_logits(q, k, kscm, w, ks, ke), expect)
    assert torch.equal(run_logits(q, k, ksc, w, ks, ke), expect)


def exact_paged_inputs(batch, next_n, h, bs, max_len, seed):
    """A paged index-K cache of exact values (small integers, power-of-two scales) for requests
    of 7, 1000 and 258 keys (cut to batch), q and weights as exact_indexer_inputs."""
    seq_lens = torch.tensor([7, 1000, 258][:batch], dtype=torch.int32)
    max_blocks = (max_len + bs - 1) // bs
    blocks = batch * max_blocks + 3
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(blocks, generator=g, dtype=torch.int32)[: batch * max_blocks].reshape(batch, max_blocks)
    vals = torch.randint(-3, 4, (blocks, bs, 128), generator=g).float().to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.pow(2.0, torch.randint(-3, 4, (blocks, bs), generator=g).float())
    cache = torch.cat([vals.reshape(blocks, -1), scales.view(torch.uint8).reshape(blocks, -1)], 1).contiguous()
    qv = torch.randint(-3, 4, (batch * next_n, h, 128), generator=g).float().to(torch.float8_e4m3fn)
    w = torch.randint(-4, 5, (batch * next_n, h), generator=g).float() * 0.25
    table = table.contiguous()
    args = [P(qv), P(w), P(cache), P(table), P(seq_lens), I(batch), I(next_n), I(h), I(bs), I(max_blocks), I(blocks)]
    return seq_lens, qv, w, cache, table, args


@pytest.mark.parametrize("bs,stages", [(64, 2), (16, 4), (4, 3), (5, 0)])  # 5: rows off 16 bytes (sync)
def test_indexer_paged_ring_bit_exact(bs, stages):
    """Paged decode through the ring: 132-byte cache rows (128 e4m3 values, then the block's
    fp32 scales), requests of several tiles with windows off the scale groups; exact values,
    so logits equal reference.py bit for bit and top-k equals its selection."""
    batch, next_n, h, max_len = 3, 2, 32, 1024
    seq_lens, qv, w, cache, table, args = exact_paged_inputs(batch, next_n, h, bs, max_len, seed=bs)
    out = torch.full((batch * next_n, max_len), float("nan"))
    topk = 24
    buf = torch.full((batch * next_n, topk), POISON_I, dtype=torch.int32)
    was = ring_stages(stages)
    try:
        call("emu_indexer_logits_paged", *args, I(max_len), P(out), I(max_len), I(max_len), sms=4)
        call("emu_indexer_topk_paged", *args, I(max_len), P(buf), I(topk), I(topk), I(topk), sms=4)
    finally:
        ring_stages(was)
    expect = ref.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, max_len)
    assert torch.equal(out, expect)
    windows = ref.decode_windows(seq_lens, next_n).int()
    assert torch.equal(buf, ref.topk_indices(expect, torch.zeros_like(windows), windows, topk))


def wgmma_path(on):
    """1: the fp8 indexer may take the sm_90a wgmma kernels (as on an H200); 0: mma.sync only."""
    return lib().emu_set_wgmma(ctypes.c_int(1 if on else 0))


@pytest.mark.parametrize("h,stages", [(64, 2), (128, 3), (64, 4)])
def test_indexer_wgmma_bit_exact(h, stages):
    """The fp8 warpgroup-MMA kernels (h % 64 == 0: 64 heads are one M = 64 tile, 128 two):
    wgmma descriptors, 128-byte swizzled q and key tiles, fences, commit / wait groups, as the
    emulator runs them. On exact inputs their logits equal reference.py bit for bit, dense and
    paged, at every ring depth, and so do the mma.sync kernels' (the switch off)."""
    s_kv = 2600
    q, k, ksc, w = exact_indexer_inputs(len(RING_WINDOWS), s_kv, h, "fp8", seed=h + stages)
    ks = torch.tensor([a for a, _ in RING_WINDOWS], dtype=torch.int32)
    ke = torch.tensor([b for _, b in RING_WINDOWS], dtype=torch.int32)
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    expect_topk = ref.indexer_topk(q, k, ksc, w, ks, ke, 16)
    batch, next_n, max_len = 2, 2, 1024
    seq_lens, qv, wp, cache, table, args = exact_paged_inputs(batch, next_n, h, 64, max_len, seed=h)
    expect_paged = ref.indexer_logits_paged(qv, wp, cache, table, seq_lens, next_n, max_len)
    was_stages, was_wg = ring_stages(stages), wgmma_path(True)
    try:
        for on in (True, False):
            wgmma_path(on)
            assert torch.equal(run_logits(q, k, ksc, w, ks, ke, sms=1), expect), on
            assert torch.equal(run_fused(q, k, ksc, w, ks, ke, 16, sms=1), expect_topk), on
            out = torch.full((batch * next_n, max_len), float("nan"))
            call("emu_indexer_logits_paged", *args, I(max_len), P(out), I(max_len), I(max_len), sms=4)
            assert torch.equal(out, expect_paged), on
    finally:
        ring_stages(was_stages)
        wgmma_path(was_wg)


def test_indexer_wgmma_random_inputs():
    """Quantized random inputs (not exact): the wgmma kernels within the ops' 1e-5 bar of the
    reference, the same -inf pattern, and the fused op selecting exactly what topk_indices
    selects on their logits."""
    q, k, ksc, w = indexer_inputs(6, 900, 64, "fp8", seed=9)
    ks, ke = causal_windows(6, 900)
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    was = wgmma_path(True)
    try:
        got = run_logits(q, k, ksc, w, ks, ke)
        fused = run_fused(q, k, ksc, w, ks, ke, 40)
    finally:
        wgmma_path(was)
    assert torch.equal(torch.isinf(got), torch.isinf(expect)) and not got.isnan().any()
    fin = torch.isfinite(expect)
    assert rel_err(got[fin], expect[fin]) < 1e-5
    assert torch.equal(fused, ref.topk_indices(got, ks, ke, 40))


def test_quantize_misaligned():
    x = torch.randn(6, 256)
    xm = misaligned(x)
    v = torch.empty(6, 256, dtype=torch.uint8)
    vm = misaligned(v)
    s = torch.empty(6, 2)
    call("emu_quantize", P(xm), ctypes.c_int(F32), P(vm), P(s), I(6), I(256), ctypes.c_float(1e-4), ctypes.c_int(1))
    rv, rs = ref.quantize_fp8(x, 1e-4, True)
    assert torch.equal(vm, rv.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
def test_sparse_mla_misaligned(cache_kind):
    cache, idx = make_mla(cache_kind, 2, 50, seed=4)
    q = torch.randn(2, 16, 576).bfloat16()
    scale = 0.1
    outs = []
    for qq, cc in ((q, cache), (misaligned(q), misaligned(cache))):
        out = torch.empty(2, 16, 512, dtype=torch.bfloat16)
        lse = torch.empty(2, 16)
        call("emu_sparse_mla", P(qq), P(cc), P(idx), P(out), P(lse), I(2), I(16), I(50), I(cache.shape[0] * cache.shape[1]),
             I(512), ctypes.c_float(scale), ctypes.c_int(BF16), ctypes.c_int(dt_code(cache)))
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ------------------------------------------------------------------ sparse MLA: 64-head CTAs, splits, cp.async

def run_mla(q, cache, idx, d_v, sms=132, scale=None, smem=227 * 1024):
    s_q, h = q.shape[:2]
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0) if scale is None else scale
    out = torch.full((s_q, h, d_v), 0x7F81, dtype=torch.int16).view(torch.bfloat16)  # a NaN no kernel makes
    lse = torch.full((s_q, h), 0x7F8DEAD1, dtype=torch.int32).view(torch.float32)
    call("emu_sparse_mla", P(q), P(cache), P(idx), P(out), P(lse), I(s_q), I(h), I(idx.shape[1]),
         I(cache.shape[0] * cache.shape[1]), I(d_v), ctypes.c_float(scale), ctypes.c_int(BF16),
         ctypes.c_int(dt_code(cache)), sms=sms, smem=smem)
    assert not (out.view(torch.int16) == 0x7F81).any() and not (lse.view(torch.int32) == 0x7F8DEAD1).any()
    return out, lse


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
def test_sparse_mla_fewer_heads_per_cta_when_shared_memory_is_short(cache_kind):
    """A100 allows 163 KB per block: 64-head CTAs (201 KB) do not fit, so the launcher takes
    32-head CTAs (144 KB) and the same bits come out (one SM: no split either way). Below the
    16-head CTA's 112,064 B it is an error that names the sizes."""
    cache, idx = make_mla(cache_kind, 2, 200, blocks=4, bs=64, seed=7)
    q = torch.randn(2, 40, 576, generator=torch.Generator().manual_seed(8)).bfloat16()
    wide = run_mla(q, cache, idx, 512, sms=1)
    a100 = run_mla(q, cache, idx, 512, sms=1, smem=166912)
    assert torch.equal(wide[0], a100[0]) and torch.equal(wide[1], a100[1])
    with pytest.raises(RuntimeError, match="sparse MLA needs 112064 bytes of shared memory; the device allows 101376"):
        run_mla(q, cache, idx, 512, sms=1, smem=101376)


def mla_splits(s_q, h, topk, sms):
    """The launcher's split count (sparse_mla_impl.cuh mla_num_splits), for the tests' own checks."""
    heads = 64 if h > 32 else (32 if h > 16 else 16)
    base = s_q * -(-h // heads)
    if base * 2 > sms:
        return 1
    want = max(1, min(sms // base, topk // 256, 32))
    if want == 1:
        return 1
    chunk = -(-(-(-topk // want)) // 32) * 32
    return -(-topk // chunk)


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("s_q,h,topk,d_v,sms", [
    (1, 128, 600, 512, 132),   # 64-head CTAs, 2 splits + merge
    (2, 20, 700, 512, 132),    # 32-head CTAs (4 real heads in the second group), 2 splits
    (2, 72, 300, 128, 132),    # a 64-head CTA with 8 real heads (3 idle groups), no split (topk < 512)
    (1, 16, 1100, 64, 132),    # 16-head CTAs, 4 splits, short d_v
    (1, 40, 2100, 64, 1),      # one SM: no split; two compaction passes (2048 + 52 entries)
])
def test_sparse_mla_wide_and_split(cache_kind, s_q, h, topk, d_v, sms):
    cache, idx = make_mla(cache_kind, s_q, topk, blocks=20, bs=64, seed=h + topk)
    splits = mla_splits(s_q, h, topk, sms)
    if s_q > 1:
        idx[1] = -1  # a row with no valid slot: 0 and -inf
    # Row 0's first half has no valid slot, so with splits the first split sees nothing (l = 0).
    idx[0, : topk // 2] = -1
    q = torch.randn(s_q, h, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    out, lse = run_mla(q, cache, idx, d_v, sms=sms)
    ro, rl = ref.sparse_mla(q, cache, idx, ref.mla_softmax_scale(128, 64, 1.0, 40.0), d_v)
    got = out.float()
    assert torch.isfinite(got).all()
    if s_q > 1:
        assert (got[1] == 0).all() and torch.isneginf(lse[1]).all()
    assert rel_err(got, ro.float()) < 1e-2
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - rl[fin]).abs().max() < 2e-2
    if (s_q, h, topk) == (1, 128, 600):
        assert splits == 2
        # Deterministic: a second call gives the same bits.
        out2, lse2 = run_mla(q, cache, idx, d_v, sms=sms)
        assert torch.equal(out2.view(torch.int16), out.view(torch.int16)) and torch.equal(lse2, lse)
    if splits > 1:
        # The unsplit result (the SMs busy: 1 here) agrees within the bar.
        o1, l1 = run_mla(q, cache, idx, d_v, sms=1)
        assert rel_err(out.float(), o1.float()) < 1e-2
        assert torch.equal(torch.isfinite(l1), fin) and (l1[fin] - lse[fin]).abs().max() < 1e-3


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
def test_sparse_mla_split_nonfinite(cache_kind):
    """A NaN in one q head, and an inf cache row that only the second split selects: those heads
    / that row come out NaN (out and lse), the rest stays finite and matches the reference."""
    s_q, h, topk = 2, 128, 600
    assert mla_splits(s_q, h, topk, 132) == 2
    cache, idx = make_mla(cache_kind, s_q, topk, blocks=20, bs=64, seed=3)
    n = cache.shape[0] * cache.shape[1]
    bad_slot = n - 1
    idx[idx == bad_slot] = 0
    idx[1, topk - 5] = bad_slot  # in the second split's part of row 1
    flat = cache.view(n, -1)
    if cache_kind == "fp8":
        flat[bad_slot, 600] = 0x80  # a RoPE bf16 = 0x7F80: +inf
        flat[bad_slot, 601] = 0x7F
    else:
        flat[bad_slot, 3] = math.inf
    q = torch.randn(s_q, h, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    q[0, 77, 100] = math.nan
    out, lse = run_mla(q, cache, idx, 512)
    ro, rl = ref.sparse_mla(q, cache, idx, ref.mla_softmax_scale(128, 64, 1.0, 40.0), 512)
    assert torch.equal(torch.isnan(out.float()), torch.isnan(ro.float()))
    assert torch.equal(torch.isnan(lse), torch.isnan(rl))
    assert torch.isnan(lse[1]).all() and torch.isnan(lse[0, 77]) and torch.isfinite(lse[0, :77]).all()
    ok = ~torch.isnan(rl)
    assert rel_err(out.float()[ok], ro.float()[ok]) < 1e-2


def test_sparse_mla_fp8_paths_identical():
    """The sm_89+ dequantization (cvt.rn.f16x2.e4m3x2, then fp32) and the software e4m3 decode give
    the same bits; every finite e4m3 code appears in the selected rows."""
    g = torch.Generator().manual_seed(8)
    n, s_q, h, topk = 128, 2, 40, 96
    cache = torch.randint(0, 256, (n, 656), dtype=torch.uint8, generator=g)
    lat = cache[:, :512]
    lat[(lat & 0x7F) == 0x7F] = 0x3C
    lat[:126, 0] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)[:126]
    lat[:124, 1] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)[126:250]
    scales = torch.rand(n, 4, generator=g) * 0.02 + 1e-3
    cache[:, 512:528] = scales.view(torch.uint8).view(n, 16)
    cache[:, 528:] = (torch.randn(n, 64, generator=g) * 0.1).bfloat16().view(torch.uint8).view(n, 128)
    cache = cache.view(2, 64, 656).contiguous()
    idx = torch.stack([torch.randperm(n, generator=g)[:topk] for _ in range(s_q)]).int()
    q = torch.randn(s_q, h, 576, generator=g).bfloat16()
    outs = []
    was = fp8_path(True)
    try:
        for on in (True, False):
            fp8_path(on)
            outs.append(run_mla(q, cache, idx, 512))
    finally:
        fp8_path(was)
    assert torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
    assert torch.equal(outs[0][1], outs[1][1])
    ro, _ = ref.sparse_mla(q, cache, idx, ref.mla_softmax_scale(128, 64, 1.0, 40.0), 512)
    assert rel_err(outs[0][0].float(), ro.float()) < 1e-2


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
def test_sparse_mla_misaligned_wide_split(cache_kind):
    """cp.async staging (aligned) and the byte-load path (misaligned) of the 64-head kernel with a
    split give the same bits."""
    cache, idx = make_mla(cache_kind, 1, 600, blocks=20, bs=64, seed=12)
    q = torch.randn(1, 70, 576, generator=torch.Generator().manual_seed(13)).bfloat16()
    assert mla_splits(1, 70, 600, 132) == 2
    a = run_mla(q, cache, idx, 512)
    b = run_mla(misaligned(q), misaligned(cache), idx, 512)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)) and torch.equal(a[1], b[1])
