"""Property-based fuzzing of the hybrid families' CUDA kernels (issue 34) through the emulator, against
reference.py: delta_rule through both of its kernels (the chunked prefill kernel and the recurrent
one, each forced or left to the launcher's length rule, with every chunk size the shared-memory
limit can pick) and kpool_pool_paged (fp32 / bf16 caches and ape, non-finite logits and keys).

    python -m pytest -q csrc/tests/cuda_emu/test_emu_fuzz_hybrid.py
    python -m pytest -q csrc/tests/cuda_emu/test_emu_fuzz_hybrid.py --hypothesis-profile=long

The emulator runs one OS thread per CUDA thread, so examples are small and few (a fifteenth of
the profile's count, as test_emu_fuzz.py: 16 by default, which keeps the file well under a minute). The kernels get
valid arguments; the invalid index values they must skip are tested in test_emu_delta_rule.py and
test_emu_kpool_pool.py.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_emu_delta_rule import RECURRENT_ONLY, chunk_tokens, emu_delta_rule, gates, make_inputs
from test_emu_delta_rule import ref as dref
from test_emu_kpool_pool import emu_pool, make_case, same
from test_emu_kpool_pool import ref as kref

seeds = st.integers(0, 2**31 - 1)


def few():
    """A fifteenth of the active profile's examples (the emulator is ~100x slower than the CPU op)."""
    return settings(max_examples=max(5, settings.default.max_examples // 15))


def within(got, want, bar):
    """|got - want| <= bar |want| + an absolute floor (a tiny d_k with strong decays leaves outputs
    near 0, where a relative bar means nothing; 1e-6 of the inputs' unit scale)."""
    err = (got.double() - want.double()).norm().item()
    return err <= bar * want.double().norm().item() + 1e-6 * want.numel() ** 0.5


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_delta_rule(data, seed):
    draw = data.draw
    lens = draw(st.lists(st.one_of(st.integers(0, 80), st.sampled_from([1, 15, 16, 17, 63, 64, 65])),
                         min_size=1, max_size=4))
    h_k = draw(st.integers(1, 2))
    h_v = h_k * draw(st.integers(1, 2))
    d_k, d_v = draw(st.integers(1, 40)), draw(st.sampled_from([1, 7, 16, 64, 70]))
    per_channel = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    # 0: the launcher's rule (16 tokens and up run chunked); 1: every sequence chunked; or none.
    min_chunked = draw(st.sampled_from([0, 1, RECURRENT_ONLY]))
    smem = draw(st.sampled_from([227 * 1024, 64 * 1024, 40 * 1024]))
    kind = draw(st.sampled_from(["small", "mixed", "strong", "huge", "growth"] + (["channels"] if per_channel else [])))
    q, k, v, g, beta, state, cu, si = make_inputs(lens, h_k, h_v, d_k, d_v, per_channel, dtype, seed)
    if kind != "small":
        g = gates(kind, g.shape, torch.Generator().manual_seed(seed + 1))
    if draw(st.booleans()):
        beta = torch.rand(beta.shape, generator=torch.Generator().manual_seed(seed + 2))  # beta in [0, 1)
    scale = draw(st.sampled_from([1.0, 0.37, 1 / math.sqrt(max(d_k, 1))]))
    s_emu, s_ref = state.clone(), state.clone()
    o_emu, errs = emu_delta_rule(q, k, v, g, beta, s_emu, cu, si, scale, smem=smem, min_chunked=min_chunked)
    o_ref = dref.delta_rule(q, k, v, g, beta, s_ref, cu, si, scale)
    assert errs == 0
    assert torch.isfinite(o_emu).all()
    assert within(o_emu, o_ref, 1e-5 if dtype == torch.float32 else 1e-2)
    assert within(s_emu, s_ref, 1e-5)
    assert chunk_tokens(d_k, per_channel, smem) in (16, 32, 64)  # every drawn shape fits some chunk


@few()
@given(data=st.data(), seed=seeds)
def test_emu_fuzz_kpool_pool(data, seed):
    draw = data.draw
    p = draw(st.sampled_from([1, 2, 4, 16]))
    bs = p * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([1, 8, 33, 128, 136]))
    n = draw(st.integers(1, 3))
    ctx = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    q = draw(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 50)), min_size=n, max_size=n))
    dts = [draw(st.sampled_from([torch.float32, torch.bfloat16])) for _ in range(3)]
    raw, pool, ape, table, c, m = make_case(seed, p, d, bs, ctx, q, *dts)
    if draw(st.booleans()):  # non-finite gate logits or keys (softmax and the weighted sum carry them)
        flat = raw.view(-1)
        for _ in range(draw(st.integers(1, 4))):
            flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    if draw(st.booleans()):
        ape.mul_(draw(st.sampled_from([1e-3, 30.0])))
    want = pool.clone()
    kref.kpool_pool_paged(raw, want, ape, table, c, m)
    assert emu_pool(raw, pool, ape, table, c, m) == 0
    same(pool, want, 1e-5 if pool.dtype == torch.float32 else 2 ** -7)
