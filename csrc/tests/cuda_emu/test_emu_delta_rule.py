"""The delta-rule CUDA kernels (csrc/cuda/delta_rule_impl.cuh: the chunked prefill kernel for
sequences of 16+ tokens, the recurrent one for shorter ones), run on the CPU through the cuda_emu.h
emulator, against reference.py's delta_rule: both gate shapes (per head, per channel), GQA, varlen
batches continuing a nonzero state, lengths below, at and across the 16-token switch and the
64-token chunk, d_v past one CTA's column tile, strided token rows, bf16 and fp32, chunks of 32 and
16 (short shared memory) and none (every sequence recurrent), every length forced through the
chunked kernel, decays from e^-0.05 to e^-1000 per token and growing ones, prefill then decode
against one call, the shared-memory limit, and invalid cu_seqlens / state_indices values (skipped
and counted, never faulting) on both kernels. Outputs are poisoned before each call.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_delta_rule.py

Builds its own libicemu_delta_rule.so (beside INDEXCACHE_EMU_LIB's) with g++ on first use.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from emu_build import load_emu_lib, load_reference

ref = load_reference("reference.py", "indexcache_reference_dr")
F32, BF16 = 0, 1
POISON_F32 = 0x7F8DEAD1  # a NaN payload no kernel makes
POISON_BF16 = 0x7F81

def lib() -> ctypes.CDLL:
    return load_emu_lib("emu_delta_rule.cpp", "libicemu_delta_rule.so", "emu_dr_last_error")


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


RECURRENT_ONLY = 1 << 40  # min_chunked no sequence reaches


def emu_delta_rule(q, k, v, g, beta, state, cu, si, scale, smem=227 * 1024, check_written=True, min_chunked=0):
    """The kernels on the emulated device; returns (o, errors counted). state is updated in place.
    min_chunked: sequences of at least this many tokens run chunked (0: the launcher's 16)."""
    L = lib()
    L.emu_dr_set_device(ctypes.c_int(132), ctypes.c_int(smem))
    L.emu_dr_set_min_chunked(ctypes.c_int64(min_chunked))
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


def check(inputs, scale=0.37, **kw):
    q, k, v, g, beta, state, cu, si = inputs
    s_emu, s_ref = state.clone(), state.clone()
    o_emu, errs = emu_delta_rule(q, k, v, g, beta, s_emu, cu, si, scale, **kw)
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


def prefill_then_decode(min_chunked):
    """A 40-token prefill then 3 decode steps, and the 43 tokens in one call: (o, state) of each."""
    q, k, v, g, beta, state, _, si = make_inputs([43], 1, 2, 16, 16, True, torch.float32, seed=5)
    one = state.clone()
    o_all, _ = emu_delta_rule(q, k, v, g, beta, one, torch.tensor([0, 43], dtype=torch.int32), si, 0.5,
                              min_chunked=min_chunked)
    steps = state.clone()
    outs = [emu_delta_rule(q[:40], k[:40], v[:40], g[:40], beta[:40], steps, torch.tensor([0, 40], dtype=torch.int32),
                           si, 0.5, min_chunked=min_chunked)[0]]
    for t in range(40, 43):
        sl = slice(t, t + 1)
        outs.append(emu_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], steps, torch.tensor([0, 1], dtype=torch.int32),
                                   si, 0.5, min_chunked=min_chunked)[0])
    return torch.cat(outs), steps, o_all, one


def test_decode_continues_prefill_recurrent():
    o_steps, s_steps, o_all, s_all = prefill_then_decode(RECURRENT_ONLY)
    assert torch.equal(o_steps, o_all)  # the same recurrence in the same order: the same bits
    assert torch.equal(s_steps, s_all)


def test_decode_continues_chunked_prefill():
    """The state a chunked prefill leaves is the recurrence's: decode steps on it equal one long prefill."""
    o_steps, s_steps, o_all, s_all = prefill_then_decode(0)
    assert rel_err(o_steps, o_all) < 1e-5
    assert rel_err(s_steps, s_all) < 1e-5
    o_rec, _, _, s_rec = prefill_then_decode(RECURRENT_ONLY)
    assert rel_err(o_all, o_rec) < 1e-5 and rel_err(s_all, s_rec) < 1e-5
    assert not torch.equal(s_all, s_rec), "the 43 tokens did not take the chunked kernel"


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


# ----------------------------------------------------------------------------- the chunked kernel (prefill)

def chunk_tokens(d_k, per_channel, smem):
    return lib().emu_dr_chunk_tokens(I(d_k), ctypes.c_int(int(per_channel)), ctypes.c_int(smem))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("lens,h_k,h_v,d_k,d_v", [
    ([15, 16, 17], 1, 1, 32, 16),                # below, at and past the chunked kernel's 16 tokens
    ([64, 65, 128, 129], 1, 2, 16, 8),           # at and across chunk boundaries
    ([1, 40, 0, 100, 3, 64, 17], 2, 4, 24, 70),  # many sequences of different lengths, GQA, two column tiles
    ([130], 1, 1, 128, 64),                      # the models' d_k: chunks of 64 in 222,720 B (per channel)
])
def test_chunked_matches_reference(dtype, per_channel, lens, h_k, h_v, d_k, d_v):
    assert chunk_tokens(d_k, per_channel, 227 * 1024) == 64
    check(make_inputs(lens, h_k, h_v, d_k, d_v, per_channel, dtype, seed=len(lens) * 31 + d_k))


@pytest.mark.parametrize("per_channel", [False, True])
def test_every_length_through_the_chunked_kernel(per_channel):
    """min_chunked = 1: lengths 1 .. 31 (one partial chunk, partial 16-row blocks) run chunked."""
    check(make_inputs([1, 2, 3, 5, 8, 13, 16, 31], 1, 2, 16, 16, per_channel, torch.float32, seed=11), min_chunked=1)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("smem,lc", [(60 * 1024, 32), (40 * 1024, 16)])
def test_smaller_chunks_where_shared_memory_is_short(per_channel, smem, lc):
    assert chunk_tokens(32, per_channel, smem) == lc
    check(make_inputs([1, 16, 33, 70], 1, 1, 32, 24, per_channel, torch.float32, seed=lc), smem=smem, min_chunked=1)


def test_no_chunk_fits_runs_the_recurrence():
    """d_k = 64 in 30 KB: no chunk fits, so every sequence takes the recurrent kernel (the same bits)."""
    assert chunk_tokens(64, True, 30 * 1024) == 0
    q, k, v, g, beta, state, cu, si = make_inputs([70], 1, 1, 64, 16, True, torch.float32, seed=12)
    a, b = state.clone(), state.clone()
    oa, _ = emu_delta_rule(q, k, v, g, beta, a, cu, si, 0.5, smem=30 * 1024)
    ob, _ = emu_delta_rule(q, k, v, g, beta, b, cu, si, 0.5, min_chunked=RECURRENT_ONLY)
    assert torch.equal(oa, ob) and torch.equal(a, b)


def gates(kind, shape, gen):
    u = torch.rand(shape, generator=gen)
    if kind == "mixed":      # g in [-3, 0]: cumulative decays cross e^-40 inside some chunks, not others
        return -u * 3.0
    if kind == "strong":     # e^-30 per token: the factored P is never safe
        return -u * 30.0 - 1.0
    if kind == "huge":       # e^-1000 per token: every decay underflows to 0
        return -u - 1000.0
    if kind == "channels":   # a few channels decay e^-50 per token, the others barely
        g = -u * 0.05
        g[..., ::5] = -50.0
        return g
    return u * 0.3 - 0.2     # "growth": some tokens amplify (g > 0)


@pytest.mark.parametrize("per_channel,kind", [(pc, kind) for pc in (False, True)
                                               for kind in ("mixed", "strong", "huge", "channels", "growth")
                                               if pc or kind != "channels"])
def test_chunked_gate_extremes(per_channel, kind):
    q, k, v, g, beta, state, cu, si = make_inputs([100, 37], 1, 2, 20, 16, per_channel, torch.float32, seed=13)
    g = gates(kind, g.shape, torch.Generator().manual_seed(14))
    check((q, k, v, g, beta, state, cu, si))


def test_chunked_invalid_values_are_skipped_and_counted():
    q, k, v, g, beta, state, cu, si = make_inputs([20, 30, 40], 1, 2, 8, 8, True, torch.float32, seed=15)
    s_ref = state.clone()
    o_ref = ref.delta_rule(q, k, v, g, beta, s_ref, cu, si, 0.5)
    # Sequence 1 takes an out-of-range row; sequence 2 repeats sequence 0's row.
    bad = torch.tensor([int(si[0]), state.shape[0] + 2, int(si[0])], dtype=torch.int32)
    s = state.clone()
    o, errs = emu_delta_rule(q, k, v, g, beta, s, cu, bad, 0.5)
    assert errs == 2
    assert rel_err(o[:20], o_ref[:20]) < 1e-5
    assert torch.equal(o[20:], torch.zeros_like(o[20:])), "a skipped sequence writes zeros"
    assert rel_err(s[si[0]], s_ref[si[0]]) < 1e-5
    others = torch.ones(state.shape[0], dtype=torch.bool)
    others[int(si[0])] = False
    assert torch.equal(s[others], state[others])
    # A long sequence repeating a short (recurrent) one's row: skipped by the chunked kernel.
    cu2 = torch.tensor([0, 3, 90], dtype=torch.int32)
    o3, errs3 = emu_delta_rule(q, k, v, g, beta, state.clone(), cu2, bad[[0, 2]].contiguous(), 0.5)
    assert errs3 == 1 and torch.equal(o3[3:], torch.zeros_like(o3[3:]))
    # Token ranges outside [0, T]: skipped (rows unwritten) and counted once each; the long valid one runs.
    cu_bad = torch.tensor([0, 20, 99, 50], dtype=torch.int32)
    o2, errs2 = emu_delta_rule(q, k, v, g, beta, state.clone(), cu_bad, si, 0.5, check_written=False)
    assert errs2 == 2  # [20, 99) and [99, 50)
    assert rel_err(o2[:20], o_ref[:20]) < 1e-5
    assert is_poison(o2[20:]).all()
