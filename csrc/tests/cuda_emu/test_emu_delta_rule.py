"""The delta-rule CUDA kernel (csrc/cuda/delta_rule_impl.cuh), run on the CPU through the cuda_emu.h
emulator, against reference.py's delta_rule: both gate shapes (per head, per channel), GQA, varlen
batches continuing a nonzero state, lengths around the CPU's chunk size, d_v past one CTA's column
tile, strided token rows, bf16 and fp32, the shared-memory limit, and invalid cu_seqlens /
state_indices values (skipped and counted, never faulting). Outputs are poisoned before each call.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_delta_rule.py

Builds its own libicemu_delta_rule.so (beside INDEXCACHE_EMU_LIB's) with g++ on first use.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
from emu_build import build_emu_lib, load_reference

ref = load_reference("reference.py", "indexcache_reference_dr")
F32, BF16 = 0, 1
POISON_F32 = 0x7F8DEAD1  # a NaN payload no kernel makes
POISON_BF16 = 0x7F81

_LIB = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        base = Path(os.environ.get("INDEXCACHE_EMU_LIB", "/tmp/indexcache_emu/libicemu.so")).parent
        _LIB = build_emu_lib("emu_delta_rule.cpp", base / "libicemu_delta_rule.so")
        _LIB.emu_dr_last_error.restype = ctypes.c_char_p
    return _LIB


def P(t):
    return ctypes.c_void_p(t.data_ptr())


def I(x):
    return ctypes.c_int64(int(x))


def poisoned(shape, dtype):
    if dtype == torch.float32:
        return torch.full(shape, POISON_F32, dtype=torch.int32).view(torch.float32)
    return torch.full(shape, POISON_BF16, dtype=torch.int16).view(torch.bfloat16)


def is_poison(t):
    if t.dtype == torch.float32:
        return t.view(torch.int32) == POISON_F32
    return t.view(torch.int16) == POISON_BF16


def emu_delta_rule(q, k, v, g, beta, state, cu, si, scale, smem=227 * 1024, check_written=True):
    """The kernel on the emulated device; returns (o, errors counted). state is updated in place."""
    L = lib()
    L.emu_dr_set_device(ctypes.c_int(132), ctypes.c_int(smem))
    L.emu_dr_reset_error_count()
    T, h_k, d_k = q.shape
    h_v, d_v = v.shape[1], v.shape[2]
    out = poisoned(v.shape, v.dtype)
    rc = L.emu_delta_rule(P(q), P(k), P(v), P(g), P(beta), P(state), P(cu), P(si), P(out), I(T), I(cu.shape[0] - 1),
                          I(h_k), I(h_v), I(d_k), I(d_v), I(state.shape[0]), I(q.stride(0)), I(k.stride(0)),
                          I(v.stride(0)), ctypes.c_int(int(g.dim() == 3)), ctypes.c_float(scale),
                          ctypes.c_int(F32 if q.dtype == torch.float32 else BF16))
    if rc != 0:
        raise RuntimeError(L.emu_dr_last_error().decode())
    if check_written:
        assert not is_poison(out).any(), "an output element was not written"
    return out, L.emu_dr_error_count()


def make_inputs(lens, h_k, h_v, d_k, d_v, per_channel, dtype, seed, gate=0.3, strided=False):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def unit(*shape):
        return torch.nn.functional.normalize(torch.randn(*shape, generator=gen), dim=-1)

    if strided:  # q, k, v as views of one fused projection, as the models slice it
        fused = torch.randn(T, 2 * h_k * d_k + h_v * d_v + 3, generator=gen)
        q = fused[:, :h_k * d_k].view(T, h_k, d_k)
        k = fused[:, h_k * d_k:2 * h_k * d_k].view(T, h_k, d_k)
        v = fused[:, 2 * h_k * d_k:2 * h_k * d_k + h_v * d_v].view(T, h_v, d_v)
        q.copy_(unit(T, h_k, d_k))
        k.copy_(unit(T, h_k, d_k))
        assert dtype == torch.float32
    else:
        q, k = unit(T, h_k, d_k).to(dtype), unit(T, h_k, d_k).to(dtype)
        v = torch.randn(T, h_v, d_v, generator=gen).to(dtype)
    gshape = (T, h_v, d_k) if per_channel else (T, h_v)
    g = -torch.rand(gshape, generator=gen) * gate - 1e-3
    beta = torch.rand(T, h_v, generator=gen) * 0.9 + 0.05
    B = len(lens)
    state = torch.randn(B + 3, h_v, d_k, d_v, generator=gen) * 0.5
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    si = torch.randperm(B + 3, generator=gen)[:B].to(torch.int32)
    return q, k, v, g, beta, state, cu, si


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def check(inputs, scale=0.37):
    q, k, v, g, beta, state, cu, si = inputs
    s_emu, s_ref = state.clone(), state.clone()
    o_emu, errs = emu_delta_rule(q, k, v, g, beta, s_emu, cu, si, scale)
    o_ref = ref.delta_rule(q, k, v, g, beta, s_ref, cu, si, scale)
    assert errs == 0
    bar = 1e-5 if v.dtype == torch.float32 else 1e-2
    assert rel_err(o_emu, o_ref) < bar
    assert rel_err(s_emu, s_ref) < 1e-5
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[si.long()] = False
    assert torch.equal(s_emu[untouched], state[untouched]), "a state row no sequence continues changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("lens,h_k,h_v,d_k,d_v", [
    ([1, 63, 64, 65], 1, 2, 32, 16),   # around the CPU's chunk of 64; MQA-like group of 2
    ([5, 0, 30], 2, 4, 16, 70),        # an empty sequence; d_v over one 64-column tile
    ([1, 1, 1, 1, 1], 2, 2, 24, 24),   # decode: one token per sequence
])
def test_delta_rule_matches_reference(dtype, per_channel, lens, h_k, h_v, d_k, d_v):
    check(make_inputs(lens, h_k, h_v, d_k, d_v, per_channel, dtype, seed=hash((tuple(lens), d_v)) % 1000))


def test_delta_rule_strided_token_rows():
    check(make_inputs([9, 40], 2, 4, 16, 8, True, torch.float32, seed=3, strided=True))


def test_delta_rule_strong_decay():
    check(make_inputs([50], 1, 1, 16, 16, True, torch.float32, seed=4, gate=30.0))


def test_decode_continues_prefill():
    """A 20-token prefill then 3 decode steps equals the 23 tokens in one call."""
    q, k, v, g, beta, state, _, si = make_inputs([23], 1, 2, 16, 16, True, torch.float32, seed=5)
    one = state.clone()
    o_all, _ = emu_delta_rule(q, k, v, g, beta, one, torch.tensor([0, 23], dtype=torch.int32), si, 0.5)
    steps = state.clone()
    outs = [emu_delta_rule(q[:20], k[:20], v[:20], g[:20], beta[:20], steps, torch.tensor([0, 20], dtype=torch.int32),
                           si, 0.5)[0]]
    for t in range(20, 23):
        sl = slice(t, t + 1)
        outs.append(emu_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], steps, torch.tensor([0, 1], dtype=torch.int32),
                                   si, 0.5)[0])
    assert torch.equal(torch.cat(outs), o_all)  # the same recurrence in the same order: the same bits
    assert torch.equal(steps, one)


def test_deterministic():
    inputs = make_inputs([33, 7], 1, 2, 16, 16, True, torch.bfloat16, seed=6)
    a, b = inputs[5].clone(), inputs[5].clone()
    oa, _ = emu_delta_rule(*inputs[:5], a, *inputs[6:], 0.5)
    ob, _ = emu_delta_rule(*inputs[:5], b, *inputs[6:], 0.5)
    assert torch.equal(oa.view(torch.int16), ob.view(torch.int16)) and torch.equal(a, b)


def test_invalid_values_are_skipped_and_counted():
    q, k, v, g, beta, state, cu, si = make_inputs([4, 5, 6], 1, 1, 8, 8, False, torch.float32, seed=7)
    s_ref = state.clone()
    o_ref = ref.delta_rule(q, k, v, g, beta, s_ref, cu, si, 0.5)
    # Sequence 1 takes an out-of-range row; sequence 2 repeats sequence 0's row.
    bad = torch.tensor([int(si[0]), state.shape[0], int(si[0])], dtype=torch.int32)
    s = state.clone()
    o, errs = emu_delta_rule(q, k, v, g, beta, s, cu, bad, 0.5)
    assert errs == 2
    assert torch.allclose(o[:4], o_ref[:4], rtol=1e-5, atol=1e-6)
    assert torch.equal(o[4:], torch.zeros_like(o[4:])), "a skipped sequence writes zeros"
    assert torch.allclose(s[si[0]], s_ref[si[0]], rtol=1e-5, atol=1e-6)
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[int(si[0])] = False
    assert torch.equal(s[others], state[others])
    # A token range outside [0, T]: that sequence is skipped (its rows stay unwritten), the others run.
    cu_bad = torch.tensor([0, 4, 99, 15], dtype=torch.int32)
    o2, errs2 = emu_delta_rule(q, k, v, g, beta, state.clone(), cu_bad, si, 0.5, check_written=False)
    assert errs2 == 2  # [4, 99) and [99, 15)
    assert torch.allclose(o2[:4], o_ref[:4], rtol=1e-5, atol=1e-6)
    assert is_poison(o2[4:]).all()


def test_shared_memory_limit_is_a_clear_error():
    inputs = make_inputs([3], 1, 1, 256, 8, False, torch.float32, seed=8)
    with pytest.raises(RuntimeError, match="delta_rule on CUDA needs .* bytes of shared memory for d_k = 256"):
        emu_delta_rule(*inputs[:5], inputs[5].clone(), *inputs[6:], 0.5, smem=48 * 1024)
