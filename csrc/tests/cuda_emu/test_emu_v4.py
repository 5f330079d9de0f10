"""DeepSeek-V4's shapes in the CUDA sparse MLA kernels (csrc/cuda/sparse_mla_impl.cuh), run on the
CPU through the emulator, against reference.py: d_qk = 512 (one shared K=V head, the value tile is
the key tile) and extra_indices (a second slot list, V4's sliding window, compacted after the
selected entries into one list), with and without sinks, on the tensor-core kernel (aligned
cp.async staging and the byte-safe fallback, with and without key splits) and the fp32 FMA
kernel; the 576 form through the same entry point with extra_indices.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_v4.py
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from test_emu import I, P, call, dt_code, make_mla, mla_splits, ref, rel_err

V4_SCALE = 512 ** -0.5
POISON_F32 = 0x7F8DEAD1  # NaN payloads no kernel makes
POISON_BF16 = 0x7F81


def make_v4(cache_kind, s_q, topk, n_extra, blocks=3, bs=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = blocks * bs
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[cache_kind]
    cache = torch.zeros(blocks, bs, 512, dtype=dt)
    rows = torch.randn(n, 512, generator=g) + 0.05
    ref.mla_kv_cache_insert(rows[:, :448], rows[:, 448:], torch.arange(n), cache)
    idx = torch.randint(0, n, (s_q, topk), dtype=torch.int32, generator=g)
    idx[:, ::3] = -1
    extra = torch.randint(0, n, (s_q, n_extra), dtype=torch.int32, generator=g)
    extra[:, ::5] = -1
    return cache, idx, extra


def run(q, cache, idx, extra, d_v, sinks, sms=132, scale=V4_SCALE, misalign=False):
    """out, lse of the emulated kernels, poisoned before the call and checked written. misalign:
    q and the cache copied one element past a 16-byte boundary (the byte-safe staging)."""
    s_q, h, d_qk = q.shape
    if misalign:
        qq = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
        qq.copy_(q)
        cc = torch.empty(cache.numel() + 1, dtype=cache.dtype)[1:].view(cache.shape)
        cc.copy_(cache)
        q, cache = qq, cc
    if q.dtype == torch.float32:
        out = torch.full((s_q, h, d_v), POISON_F32, dtype=torch.int32).view(torch.float32)
    else:
        out = torch.full((s_q, h, d_v), POISON_BF16, dtype=torch.int16).view(torch.bfloat16)
    lse = torch.full((s_q, h), POISON_F32, dtype=torch.int32).view(torch.float32)
    slots = cache.numel() // cache.shape[-1]
    call("emu_sparse_mla_v4", P(q), P(cache), P(idx), P(extra) if extra is not None else None, P(out), P(lse),
         I(s_q), I(h), I(idx.shape[1]), I(0 if extra is None else extra.shape[1]), I(slots), I(d_v),
         ctypes.c_float(scale), ctypes.c_int(dt_code(q)), ctypes.c_int(dt_code(cache)),
         P(sinks) if sinks is not None else None, I(d_qk), sms=sms)
    bits = out.view(torch.int32 if q.dtype == torch.float32 else torch.int16)
    poison = POISON_F32 if q.dtype == torch.float32 else POISON_BF16 - 0x10000 * (POISON_BF16 >= 0x8000)
    assert not (bits == poison).any() and not (lse.view(torch.int32) == POISON_F32).any()
    return out, lse


def sinks_for(h, seed):
    g = torch.Generator().manual_seed(seed + 7)
    s = torch.randn(h, generator=g) * 3
    if h > 2:
        s[1], s[2] = 40.0, -60.0
    return s


@pytest.mark.parametrize("cache_kind,q_dtype,bar", [("bf16", torch.bfloat16, 1e-2), ("fp32", torch.float32, 1e-5),
                                                     ("bf16", torch.float32, 1e-5)])
@pytest.mark.parametrize("s_q,h,topk,n_extra", [(3, 16, 40, 24), (2, 64, 70, 33), (4, 5, 7, 0)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_v4_shapes(cache_kind, q_dtype, bar, s_q, h, topk, n_extra, with_sinks):
    cache, idx, extra = make_v4(cache_kind, s_q, topk, n_extra, seed=s_q * 131 + h)
    idx[1 % s_q] = -1
    extra[1 % s_q] = -1  # a row with no valid slot in either list
    if s_q > 2:
        idx[2] = -1  # a row with window entries only
    q = torch.randn(s_q, h, 512, generator=torch.Generator().manual_seed(h)).to(q_dtype)
    sinks = sinks_for(h, s_q) if with_sinks else None
    out, lse = run(q, cache, idx, extra, 512, sinks)
    ro, rl = ref.sparse_mla(q, cache, idx, V4_SCALE, 512, sinks=sinks, extra_indices=extra)
    assert torch.isfinite(out.float()).all()
    assert (out[1 % s_q].float() == 0).all()
    assert rel_err(out.float(), ro.float()) < bar
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - rl[fin]).abs().max() < (1e-4 if bar < 1e-2 else 2e-2)


@pytest.mark.parametrize("s_q,h,topk,n_extra,sms", [(1, 64, 1024, 128, 132), (2, 16, 600, 128, 64)])
def test_v4_split_keys_and_misaligned(s_q, h, topk, n_extra, sms):
    """Decode shapes: the row's combined list is split across CTAs (the split boundary falls
    inside extra_indices on the second shape) and merged; the misaligned copy takes the byte
    staging. Sinks join once, in the merge."""
    assert mla_splits(s_q, h, topk + n_extra, sms) > 1
    cache, idx, extra = make_v4("bf16", s_q, topk, n_extra, blocks=20, seed=topk)
    q = torch.randn(s_q, h, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    sinks = sinks_for(h, 3)
    ro, rl = ref.sparse_mla(q, cache, idx, V4_SCALE, 512, sinks=sinks, extra_indices=extra)
    for misalign in (False, True):
        out, lse = run(q, cache, idx, extra, 512, sinks, sms=sms, misalign=misalign)
        assert rel_err(out.float(), ro.float()) < 1e-2
        assert (lse - rl).abs().max() < 2e-2


def test_v4_extra_is_the_same_as_one_list():
    """extra_indices = the concatenated list, to the bit (one compacted list per row)."""
    cache, idx, extra = make_v4("bf16", 3, 40, 20, seed=11)
    q = torch.randn(3, 32, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    a = run(q, cache, idx, extra, 512, None)
    b = run(q, cache, torch.cat((idx, extra), 1).contiguous(), None, 512, None)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("cache_kind,q_dtype", [("fp8", torch.bfloat16), ("bf16", torch.bfloat16),
                                                ("fp32", torch.float32)])
def test_576_with_extra_indices(cache_kind, q_dtype):
    """The DSA form takes extra_indices too (every format, fp8_ds_mla included)."""
    cache, idx = make_mla(cache_kind, 3, 50, seed=4)
    extra = torch.randint(0, cache.shape[0] * cache.shape[1], (3, 30), dtype=torch.int32)
    extra[:, ::4] = -1
    q = torch.randn(3, 16, 576, generator=torch.Generator().manual_seed(9)).to(q_dtype)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    out, lse = run(q, cache, idx, extra, 512, None, scale=scale)
    ro, rl = ref.sparse_mla(q, cache, idx, scale, 512, extra_indices=extra)
    assert rel_err(out.float(), ro.float()) < (1e-5 if q_dtype == torch.float32 else 1e-2)
    assert (lse - rl).abs().max() < 2e-2


def test_v4_rejects_fp8_cache():
    cache, idx = make_mla("fp8", 2, 8, seed=1)
    q = torch.randn(2, 16, 512).bfloat16()
    with pytest.raises(RuntimeError, match="d_qk 576 \\(any cache\\) or 512 \\(bf16/fp32 cache\\)"):
        run(q, cache, idx, None, 512, None)
