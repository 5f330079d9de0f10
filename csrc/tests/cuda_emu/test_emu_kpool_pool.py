"""The kpool_pool_paged CUDA kernel (csrc/cuda/kpool_pool_impl.cuh), run on the CPU through the
cuda_emu.h emulator, against reference.py's kpool_pool_paged: prefill, decode steps completing a pool
or not, chunks cut through pools, more pools per request than CTAs per request, channels past one
CTA's threads, fp32 / bf16 caches and ape, NaN / +inf logits; pool rows no completing pool owns keep
their poison. Invalid lengths and block ids are skipped and counted, never faulting.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_kpool_pool.py

Builds its own libicemu_kpool_pool.so (beside INDEXCACHE_EMU_LIB's) with g++ on first use.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from emu_build import load_emu_lib, load_reference

ref = load_reference("reference.py", "indexcache_reference_kp")
DT = {torch.float32: 0, torch.bfloat16: 1}
NAN = float("nan")

def lib() -> ctypes.CDLL:
    return load_emu_lib("emu_kpool_pool.cpp", "libicemu_kpool_pool.so", "emu_kp_last_error")


def P(t):
    return ctypes.c_void_p(t.data_ptr())


def I(x):
    return ctypes.c_int64(int(x))


def emu_pool(raw, pool, ape, table, ctx, q):
    """The kernel on the emulated device, in place into pool; returns the errors counted."""
    L = lib()
    L.emu_kp_reset_error_count()
    rc = L.emu_kpool_pool(P(raw), P(pool), P(ape), P(table), P(ctx), P(q), I(table.shape[0]), I(table.shape[1]),
                          I(raw.shape[0]), I(raw.shape[1]), I(ape.shape[0]), I(ape.shape[1]), ctypes.c_int(DT[raw.dtype]),
                          ctypes.c_int(DT[pool.dtype]), ctypes.c_int(DT[ape.dtype]))
    if rc != 0:
        raise RuntimeError(L.emu_kp_last_error().decode())
    return L.emu_kp_error_count()


def make_case(seed, p, d, bs, ctx, q, raw_dtype=torch.float32, pool_dtype=torch.float32, ape_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-(c + m) // bs) for c, m in zip(ctx, q)) + 1
    nb = len(ctx) * width + 2
    table = torch.randperm(nb, generator=g).to(torch.int32)[:len(ctx) * width].view(len(ctx), width).contiguous()
    raw = (torch.randn(nb, bs, 2 * d, generator=g) * 2).to(raw_dtype)
    pool = torch.full((nb, bs // p, d), NAN, dtype=pool_dtype)
    ape = torch.randn(p, d, generator=g).to(ape_dtype)
    return raw, pool, ape, table, torch.tensor(ctx, dtype=torch.int32), torch.tensor(q, dtype=torch.int32)


def same(got, want, tol):
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    live = ~torch.isnan(want)
    assert torch.allclose(got[live].float(), want[live].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("raw_dtype,pool_dtype,ape_dtype", [(torch.float32,) * 3, (torch.bfloat16, torch.float32, torch.bfloat16),
                                                            (torch.bfloat16,) * 3])
@pytest.mark.parametrize("p,d,bs,ctx,q", [
    (4, 8, 16, [0], [37]),
    (4, 8, 16, [3, 7, 15, 16], [1, 1, 1, 1]),
    (4, 16, 16, [5, 0, 30], [18, 3, 35]),
    (16, 136, 64, [0, 100], [300, 60]),   # 18 pools of one request over 16 CTAs; 136 channels > 128 threads
    (1, 8, 4, [2, 0], [3, 9]),
])
def test_matches_reference(raw_dtype, pool_dtype, ape_dtype, p, d, bs, ctx, q):
    args = make_case(sum(ctx) + sum(q) + d, p, d, bs, ctx, q, raw_dtype, pool_dtype, ape_dtype)
    raw, pool, ape, table, c, m = args
    want = pool.clone()
    ref.kpool_pool_paged(raw, want, ape, table, c, m)
    assert emu_pool(*args) == 0
    same(pool, want, 1e-5 if pool_dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("bad", [NAN, float("inf")])
def test_non_finite_logits(bad):
    raw, pool, ape, table, c, m = make_case(4, 4, 40, 16, [0], [32])
    raw[int(table[0, 0]), 5, 40 + 3] = bad
    raw[int(table[0, 1]), 2, 17] = NAN
    want = pool.clone()
    ref.kpool_pool_paged(raw, want, ape, table, c, m)
    assert emu_pool(raw, pool, ape, table, c, m) == 0
    same(pool, want, 1e-5)


def test_invalid_values_are_skipped_and_counted():
    """A negative length, a request past its table row, and a pool whose block id is out of range:
    each skipped (its rows keep their poison) and counted once; the valid pools are written."""
    raw, pool, ape, table, c, m = make_case(6, 4, 8, 16, [0, 0, 0, 0], [20, 20, 20, 20])
    nb = raw.shape[0]
    m[3] = table.shape[1] * 16 + 4  # request 3: more positions than its table row holds
    c[1] = -4                 # request 1: negative ctx
    table[2, 0] = nb + 5      # request 2: pools 0-3 in a block outside the cache (pool 4 valid)
    want = pool.clone()
    ref.kpool_pool_paged(raw, want, ape, table[:1], c[:1], m[:1])
    ref.kpool_pool_paged(raw, want, ape, table[2:3, 1:], torch.tensor([0], dtype=torch.int32),
                         torch.tensor([4], dtype=torch.int32))  # request 2's pool 4 sits in table[2, 1]
    errs = emu_pool(raw, pool, ape, table, c, m)
    assert errs == 1 + 4 + 1  # request 1, request 2's four pools in the bad block, request 3
    same(pool, want, 1e-5)
