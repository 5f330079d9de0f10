"""Attention sinks in the CUDA sparse MLA kernels (csrc/cuda/sparse_mla_impl.cuh), run on the CPU
through the emulator, against reference.py: the tensor-core kernel with and without key
splits (the sink joins once, in the final normalisation or in the merge), the fp32 FMA kernel,
-inf sinks bit-identical to no sinks, NaN / ±inf sinks as docs/ops.md says, and a fuzz.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_sinks.py
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_emu import I, P, call, dt_code, make_mla, mla_splits, ref, rel_err
from test_emu_fuzz import few, rand, seeds

SCALE = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
POISON_F32 = 0x7F8DEAD1  # NaN payloads no kernel makes
POISON_BF16 = 0x7F81


def run(q, cache, idx, d_v, sinks, sms=132, scale=SCALE, fn="emu_sparse_mla_sinks"):
    """out, lse of the emulated kernels, poisoned before the call and checked written."""
    s_q, h = q.shape[:2]
    if q.dtype == torch.float32:
        out = torch.full((s_q, h, d_v), POISON_F32, dtype=torch.int32).view(torch.float32)
    else:
        out = torch.full((s_q, h, d_v), POISON_BF16, dtype=torch.int16).view(torch.bfloat16)
    lse = torch.full((s_q, h), POISON_F32, dtype=torch.int32).view(torch.float32)
    args = [P(q), P(cache), P(idx), P(out), P(lse), I(s_q), I(h), I(idx.shape[1]), I(cache.shape[0] * cache.shape[1]),
            I(d_v), ctypes.c_float(scale), ctypes.c_int(dt_code(q)), ctypes.c_int(dt_code(cache))]
    if fn == "emu_sparse_mla_sinks":
        args.append(P(sinks))
    call(fn, *args, sms=sms)
    poison = POISON_F32 if q.dtype == torch.float32 else POISON_BF16
    bits = out.view(torch.int32 if q.dtype == torch.float32 else torch.int16)
    if q.dtype == torch.bfloat16:
        poison = poison if poison < 0x8000 else poison - 0x10000
    assert not (bits == poison).any() and not (lse.view(torch.int32) == POISON_F32).any()
    return out, lse


def make_sinks(h, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(h, generator=g) * 3
    if h > 2:
        s[1], s[2] = 40.0, -60.0
    return s


@pytest.mark.parametrize("cache_kind,q_dtype,bar", [("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2),
                                                     ("fp8", torch.bfloat16, 1e-2), ("bf16", torch.float32, 1e-5),
                                                     ("fp8", torch.float32, 1e-5)])
@pytest.mark.parametrize("s_q,h,topk,d_v", [(3, 16, 64, 512), (2, 20, 200, 512), (3, 5, 7, 128)])
def test_sparse_mla_sinks(cache_kind, q_dtype, bar, s_q, h, topk, d_v):
    cache, idx = make_mla(cache_kind, s_q, topk, seed=h)
    idx[1 % s_q] = -1
    q = torch.randn(s_q, h, 576, generator=torch.Generator().manual_seed(9)).to(q_dtype)
    sinks = make_sinks(h, topk)
    out, lse = run(q, cache, idx, d_v, sinks)
    ro, rl = ref.sparse_mla(q, cache, idx, SCALE, d_v, sinks=sinks)
    got = out.float()
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    assert (got[1 % s_q] == 0).all() and torch.equal(lse[1 % s_q], sinks)
    assert rel_err(got, ro.float()) < bar
    assert (lse - rl).abs().max() < (1e-4 if bar < 1e-2 else 2e-2)
    plain, _ = ref.sparse_mla(q, cache, idx, SCALE, d_v)
    assert rel_err(plain.float(), ro.float()) > 3 * bar  # the sinks change the result


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("s_q,h,topk,d_v,sms", [
    (1, 128, 600, 512, 132),   # 64-head CTAs, 2 splits + merge
    (2, 20, 700, 512, 132),    # 32-head CTAs, 2 splits
    (1, 16, 1100, 64, 132),    # 16-head CTAs, 4 splits
    (2, 72, 300, 128, 132),    # no split
])
def test_sparse_mla_sinks_wide_and_split(cache_kind, s_q, h, topk, d_v, sms):
    cache, idx = make_mla(cache_kind, s_q, topk, blocks=20, bs=64, seed=h + topk)
    splits = mla_splits(s_q, h, topk, sms)
    idx[0, : topk // 2] = -1  # the first split of row 0 sees nothing (l = 0)
    if s_q > 1:
        idx[1] = -1
    q = torch.randn(s_q, h, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    sinks = make_sinks(h, topk)
    out, lse = run(q, cache, idx, d_v, sinks, sms=sms)
    ro, rl = ref.sparse_mla(q, cache, idx, SCALE, d_v, sinks=sinks)
    assert torch.isfinite(out.float()).all()
    if s_q > 1:
        assert (out[1].float() == 0).all() and torch.equal(lse[1], sinks)
    assert rel_err(out.float(), ro.float()) < 1e-2
    assert (lse - rl).abs().max() < 2e-2
    if splits > 1:
        # The sink joined once: the unsplit kernel (one SM) agrees within the bar.
        o1, l1 = run(q, cache, idx, d_v, sinks, sms=1)
        assert rel_err(out.float(), o1.float()) < 1e-2 and (l1 - lse).abs().max() < 1e-3
        again = run(q, cache, idx, d_v, sinks, sms=sms)
        assert torch.equal(again[0].view(torch.int16), out.view(torch.int16)) and torch.equal(again[1], lse)


# fp32 q takes the FMA kernel, which has no splits: the small shape covers it.
@pytest.mark.parametrize("cache_kind,q_dtype,h,topk", [
    *[(kind, torch.bfloat16, h, topk) for kind in ("bf16", "fp8") for h, topk in ((20, 60), (128, 600))],
    ("fp32", torch.float32, 20, 60), ("bf16", torch.float32, 20, 60)])
def test_sparse_mla_minus_inf_sinks_bit_identical(cache_kind, q_dtype, h, topk):
    """-inf sinks and no sinks: the same bits from every kernel (mma with and without the split
    merge, FMA)."""
    cache, idx = make_mla(cache_kind, 2, topk, blocks=20, seed=topk)
    idx[1, 5:] = -1
    q = torch.randn(2, h, 576, generator=torch.Generator().manual_seed(2)).to(q_dtype)
    a = run(q, cache, idx, 512, None, fn="emu_sparse_mla")
    b = run(q, cache, idx, 512, torch.full((h,), -math.inf))
    c = run(q, cache, idx, 512, None)  # a null sinks pointer
    ib = torch.int32 if q_dtype == torch.float32 else torch.int16
    for x in (b, c):
        assert torch.equal(x[0].view(ib), a[0].view(ib)) and torch.equal(x[1].view(torch.int32), a[1].view(torch.int32))


@pytest.mark.parametrize("cache_kind,q_dtype", [("bf16", torch.bfloat16), ("fp8", torch.bfloat16),
                                                ("fp32", torch.float32)])
@pytest.mark.parametrize("topk", [40, 600])
def test_sparse_mla_nonfinite_sinks(cache_kind, q_dtype, topk):
    """NaN / +inf sink: NaN out and lse on the head's rows with a valid slot (also through the
    split merge); -inf: no sink; a row with no valid slot: 0 and lse = the sink."""
    s_q, h = 3, 70
    cache, idx = make_mla(cache_kind, s_q, topk, blocks=20, seed=1)
    idx[2] = -1
    q = torch.randn(s_q, h, 576, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    sinks = make_sinks(h, 7)
    sinks[[3, 40]] = math.nan
    sinks[[5, 66]] = math.inf
    sinks[[6, 69]] = -math.inf
    out, lse = run(q, cache, idx, 512, sinks)
    ro, rl = ref.sparse_mla(q, cache, idx, SCALE, 512, sinks=sinks)
    bad = torch.zeros(h, dtype=torch.bool)
    bad[[3, 40, 5, 66]] = True
    got = out.float()
    for r in (0, 1):
        assert torch.equal(torch.isnan(lse[r]), bad) and torch.equal(torch.isnan(rl[r]), bad)
        assert torch.isnan(got[r][bad]).all() and torch.isfinite(got[r][~bad]).all()
    assert (got[2] == 0).all()
    assert torch.equal(torch.isnan(lse[2]), torch.isnan(sinks))
    fin = ~torch.isnan(sinks)
    assert torch.equal(lse[2][fin], sinks[fin])
    ok = ~bad
    bar = 1e-5 if q_dtype == torch.float32 else 1e-2
    assert rel_err(got[:2][:, ok], ro[:2][:, ok].float()) < bar


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_sparse_mla_sinks(data, seed):
    draw = data.draw
    s_q, h = draw(st.integers(1, 2)), draw(st.integers(1, 20))
    cache_kind = draw(st.sampled_from(["fp32", "bf16", "fp8"]))
    q_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    bs, blocks = 16, draw(st.integers(1, 2))
    n = bs * blocks
    topk = draw(st.integers(1, 40))
    d_v = draw(st.sampled_from([64, 512]))
    e = draw(st.integers(-12, 12))
    kv_c, k_pe = rand((n, 512), seed, 2.0 ** e), rand((n, 64), seed + 1, 2.0 ** e)
    width = 656 if cache_kind == "fp8" else 576
    dt = {"fp8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}[cache_kind]
    cache = torch.zeros(blocks, bs, width, dtype=dt)
    ref.mla_kv_cache_insert(kv_c, k_pe, torch.arange(n), cache)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (s_q, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(s_q, topk, generator=g) < 0.3] = -1
    if draw(st.booleans()):
        idx[draw(st.integers(0, s_q - 1))] = -1
    q = rand((s_q, h, 576), seed + 2, 2.0 ** -e).to(q_dtype).contiguous()
    sinks = rand((h,), seed + 3, 2.0 ** draw(st.integers(-4, 6)))
    for _ in range(draw(st.integers(0, 2))):
        sinks[draw(st.integers(0, h - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30]))
    out, lse = run(q, cache, idx, d_v, sinks)
    ro, rl = ref.sparse_mla(q, cache, idx, SCALE, d_v, sinks=sinks)
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pred(lse), pred(rl))
    assert torch.equal(torch.isnan(out.float()), torch.isnan(ro.float()))
    ok = ~torch.isnan(rl)
    if ok.any():
        assert rel_err(out.float()[ok], ro.float()[ok]) < (1e-5 if q_dtype == torch.float32 else 1e-2)
