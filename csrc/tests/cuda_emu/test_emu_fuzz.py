"""Property-based fuzzing of the CUDA kernels (csrc/cuda/*_impl.cuh) through the emulator,
against reference.py, non-finite inputs included (docs/ops.md, "Non-finite inputs").

    python -m pytest -q csrc/tests/cuda_emu/test_emu_fuzz.py
    python -m pytest -q csrc/tests/cuda_emu/test_emu_fuzz.py --hypothesis-profile=long

The emulator runs one OS thread per CUDA thread, so examples are small and fewer than the
CPU fuzz's (a tenth of the profile's count). The argument checks live in csrc/checks.h,
shared with the CPU op and fuzzed there (tests/test_fuzz.py); the kernels here get valid
arguments, including the index values the launchers themselves must skip (sparse MLA drops
-1 and out-of-range slots). Under AddressSanitizer: see docs/cuda_kernels.md.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from emu_build import ROOT
from test_emu import BF16, F32, FP8, I, P, call, dt_code, ref, rel_err, run_fused, run_logits, run_topk

# tests/bitwise.py by path (this folder runs without the package's tests on sys.path)
_spec = importlib.util.spec_from_file_location("indexcache_tests_bitwise", ROOT / "tests" / "bitwise.py")
_bitwise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bitwise)
bits, nan_equal = _bitwise.bits, _bitwise.nan_equal

NONFINITE = [math.nan, -math.nan, math.inf, -math.inf]
seeds = st.integers(0, 2**31 - 1)


def few():
    """A tenth of the active profile's examples (the emulator is ~100x slower)."""
    return settings(max_examples=max(5, settings.default.max_examples // 15))


def rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def sprinkle(draw, x):
    if x.numel() == 0 or not draw(st.booleans()):
        return x
    flat = x.view(-1)
    for _ in range(draw(st.integers(1, 3))):
        flat[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(NONFINITE))
    return x


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_quantize(data, seed):
    draw = data.draw
    rows, d = draw(st.integers(0, 6)), 128 * draw(st.integers(1, 2))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    hadamard = draw(st.booleans())
    x = rand((rows, d), seed, 2.0 ** draw(st.integers(-60, 60)))
    if draw(st.booleans()):
        x = x.clamp(-1, 1) * 3.38e38
    x = x.to(dtype).contiguous()
    sprinkle(draw, x)
    v = torch.full((rows, d), 0x55, dtype=torch.uint8)
    s = torch.full((rows, d // 128), 7.0)
    call("emu_quantize", P(x), ctypes.c_int(dt_code(x)), P(v), P(s), I(rows), I(d), ctypes.c_float(1e-4),
         ctypes.c_int(int(hadamard)))
    rv, rs = ref.quantize_fp8(x, 1e-4, hadamard)
    assert torch.equal(v, rv.view(torch.uint8))
    assert torch.equal(bits(s), bits(rs))


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_cache_inserts(data, seed):
    draw = data.draw
    bs, blocks = draw(st.sampled_from([1, 5, 16])), draw(st.integers(1, 3))
    n = draw(st.integers(0, min(12, blocks * bs)))
    src = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.3] = -1
    k = rand((n, 128), seed, 2.0 ** draw(st.integers(-40, 40))).to(src).contiguous()
    sprinkle(draw, k)
    cache = torch.randint(0, 256, (blocks, bs * 132), dtype=torch.uint8, generator=g)
    expect = cache.clone()
    call("emu_index_k_insert", P(k), P(slots), P(cache), I(n), I(128), I(bs), I(blocks), ctypes.c_int(0),
         ctypes.c_int(dt_code(k)))
    ref.index_k_cache_insert(k, slots, expect)
    assert torch.equal(cache, expect)
    cache_dt = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
    kv_c = rand((n, 512), seed + 1, 2.0 ** draw(st.integers(-20, 20))).to(src).contiguous()
    k_pe = rand((n, 64), seed + 2).to(src).contiguous()
    sprinkle(draw, kv_c)
    sprinkle(draw, k_pe)
    width = 656 if cache_dt == torch.uint8 else 576
    mcache = torch.full((blocks, bs, width), 3, dtype=cache_dt)
    mexpect = mcache.clone()
    call("emu_mla_insert", P(kv_c), P(k_pe), P(slots), P(mcache), I(n), I(blocks * bs), ctypes.c_int(dt_code(kv_c)),
         ctypes.c_int(dt_code(mcache)))
    ref.mla_kv_cache_insert(kv_c, k_pe, slots, mexpect)
    assert nan_equal(mcache, mexpect)


def topk_logits(draw, rows, n, seed):
    """Logits for the top-k fuzz: plain, heavy ties, signed zeros only, or a quarter non-finite."""
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["randn", "ties", "signed_zero", "nonfinite"]))
    if kind == "ties":
        return torch.randint(-2, 3, (rows, n), generator=g).float()
    if kind == "signed_zero":
        return torch.randint(-1, 2, (rows, n), generator=g).float() * 0.0
    logits = torch.randn(rows, n, generator=g)
    if kind == "nonfinite":
        c = torch.randint(0, 6, (rows, n), generator=g)
        logits[c == 0], logits[c == 1], logits[c == 2], logits[c == 3] = math.nan, -math.nan, math.inf, -math.inf
    return logits


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_topk(data, seed):
    draw = data.draw
    rows = draw(st.integers(1, 3))
    n = draw(st.integers(1, draw(st.sampled_from([50, 3000]))))
    topk = draw(st.integers(1, n + 2))
    logits = topk_logits(draw, rows, n, seed)
    ks = torch.tensor([draw(st.integers(0, n)) for _ in range(rows)], dtype=torch.int32)
    ke = torch.tensor([draw(st.integers(int(a), n)) for a in ks], dtype=torch.int32)
    got = run_topk(logits, ks, ke, topk, topk + 2, rows + 1, sms=draw(st.sampled_from([1, 132])))
    assert (got[rows:] == -7777).all()
    assert torch.equal(got[:rows], ref.topk_indices(logits, ks, ke, topk, topk + 2))


@settings(max_examples=5, deadline=None)
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_topk_persistent(data, seed):
    """Few long rows: the persistent cooperative kernel (G = 2..4 CTAs per row) against the
    reference, ties, signed zeros and non-finite values included; short rows mixed in."""
    draw = data.draw
    rows = draw(st.integers(1, 2))
    n = draw(st.integers(32768, 36000))
    topk = draw(st.integers(1, n // 8))
    logits = topk_logits(draw, rows, n, seed)
    ks = torch.tensor([draw(st.integers(0, n // 4)) for _ in range(rows)], dtype=torch.int32)
    ke = torch.tensor([draw(st.integers(int(a), n)) for a in ks], dtype=torch.int32)
    sms = rows * draw(st.integers(2, 4)) + draw(st.integers(0, 1))
    got = run_topk(logits, ks, ke, topk, topk + 2, rows + 1, sms=sms)
    assert (got[rows:] == -7777).all()
    assert torch.equal(got[:rows], ref.topk_indices(logits, ks, ke, topk, topk + 2))


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_indexer(data, seed):
    draw = data.draw
    dtype = draw(st.sampled_from(["fp8", "bf16", "fp32"]))
    s_q, s_kv, h = draw(st.integers(1, 3)), draw(st.integers(1, 200)), draw(st.integers(1, 20))
    q = rand((s_q, h, 128), seed, 2.0 ** draw(st.integers(-20, 20))) + 0.1
    k = rand((s_kv, 128), seed + 1, 2.0 ** draw(st.integers(-20, 20))) + 0.05
    w = rand((s_q, h), seed + 2)
    sprinkle(draw, q)
    sprinkle(draw, k)
    if dtype == "fp8":
        qv, qs = ref.quantize_fp8(q, ref.INDEX_Q_EPS)
        kv, ksc = ref.quantize_fp8(k, ref.INDEX_K_EPS)
        q, k, ksc, w = qv, kv, ksc[:, 0].contiguous(), ref.indexer_weights(w, qs[..., 0]).contiguous()
    else:
        t = torch.bfloat16 if dtype == "bf16" else torch.float32
        q, k, ksc, w = q.to(t), k.to(t), None, ref.indexer_weights(w).contiguous()
    ks = torch.tensor([draw(st.integers(0, s_kv)) for _ in range(s_q)], dtype=torch.int32)
    ke = torch.tensor([draw(st.integers(int(a), s_kv)) for a in ks], dtype=torch.int32)
    got = run_logits(q, k, ksc, w, ks, ke)
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    for pred in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(pred(got), pred(expect))
    fin = torch.isfinite(expect)
    if fin.any():
        absx = ref.indexer_logits(q.float().abs(), k.float().abs(), ksc, w.abs(), ks, ke)
        err = (got[fin].double() - expect[fin].double()).norm()
        assert err <= 1e-5 * expect[fin].double().norm() + 1e-6 * absx[fin].double().norm() + 1e-30
    topk = draw(st.integers(1, 64))
    fused = run_fused(q, k, ksc, w, ks, ke, topk, sms=draw(st.sampled_from([1, 132])))
    assert torch.equal(fused, ref.topk_indices(got, ks, ke, topk))


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_sparse_mla(data, seed):
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
    if draw(st.booleans()):
        kv_c[draw(st.integers(0, n - 1)), draw(st.integers(0, 511))] = draw(st.sampled_from(NONFINITE))
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
    if draw(st.booleans()):
        q[draw(st.integers(0, s_q - 1)), draw(st.integers(0, h - 1)), draw(st.integers(0, 575))] = draw(
            st.sampled_from(NONFINITE))
    # Poisoned with NaN payloads no kernel makes.
    out = (torch.full((s_q, h, d_v), 0x7F8DEAD1, dtype=torch.int32).view(torch.float32) if q_dtype == torch.float32
           else torch.full((s_q, h, d_v), 0x7F81, dtype=torch.int16).view(torch.bfloat16))
    lse = torch.full((s_q, h), 0x7F8DEAD1, dtype=torch.int32).view(torch.float32)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    call("emu_sparse_mla", P(q), P(cache), P(idx), P(out), P(lse), I(s_q), I(h), I(topk), I(n), I(d_v),
         ctypes.c_float(scale), ctypes.c_int(dt_code(q)), ctypes.c_int(dt_code(cache)))
    ro, rl = ref.sparse_mla(q, cache, idx, scale, d_v)
    assert not (bits(lse) == 0x7F8DEAD1).any()
    assert not (bits(out) == (0x7F8DEAD1 if q_dtype == torch.float32 else 0x7F81)).any()
    assert torch.equal(torch.isnan(out.float()), torch.isnan(ro.float()))
    assert torch.equal(torch.isnan(lse), torch.isnan(rl)) and torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    ok = ~torch.isnan(rl)
    if ok.any():
        assert rel_err(out.float()[ok], ro.float()[ok]) < (1e-5 if q_dtype == torch.float32 else 1e-2)


def test_emu_indexer_padding_heads_ignore_an_infinite_key():
    # Found by the long profile: with fewer heads than the mma's 16, the zero q rows of the padding
    # heads met a key holding -inf (0 * -inf = NaN), and a zero weight did not cancel that NaN. The
    # real head's dot is -inf, which ReLU makes 0, so the logit is a finite 0, as reference.py says.
    for h in (1, 5, 17):
        q = (torch.rand(2, h, 128, generator=torch.Generator().manual_seed(h)) + 0.1).to(torch.bfloat16)
        k = torch.rand(3, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        k[1, 7] = -math.inf
        w = ref.indexer_weights(torch.rand(2, h) + 0.5).contiguous()
        ks, ke = torch.zeros(2, dtype=torch.int32), torch.full((2,), 3, dtype=torch.int32)
        got, want = run_logits(q, k, None, w, ks, ke), ref.indexer_logits(q, k, None, w, ks, ke)
        assert torch.equal(want[:, 1], torch.zeros(2)) and torch.equal(got[:, 1], want[:, 1])
        assert torch.isfinite(got).all()
