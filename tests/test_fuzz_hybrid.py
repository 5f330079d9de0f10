"""Property-based fuzzing of the hybrid families' CPU ops (issue 34) against reference.py, as
tests/test_fuzz.py does for the DSA ops (delta_rule's own fuzz is in tests/test_delta_rule.py; the
CUDA kernels' in csrc/tests/cuda_emu/test_emu_fuzz_hybrid.py):

- ``kpool_pool_paged`` (GLM-5.3-Flash's paged key pooling): pool sizes 1-16, block sizes of 1-4
  pools, 0-4 requests with shuffled block tables, contexts and step lengths starting and ending
  mid-pool or adding nothing, every dtype mix of cache / pool rows / ape, magnitudes from 2^-20 to
  2^20 and NaN / +-inf keys and gates. The rows the reference writes hold its values (NaN where it
  has NaN), every other row keeps its poison bit for bit, and two calls are bit-identical.
- ``indexer_logits`` / ``indexer_topk`` at the pooled and QSA indexers' head widths (even, 2-256,
  not 128): per-row windows over concatenated requests, fp32 and bf16, the DESIGN §8 bars, NaN /
  +-inf inputs; top-k exactly the plain top-k of the op's own scores.

    python -m pytest -q tests/test_fuzz_hybrid.py --hypothesis-profile=long
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from indexcache import ops
from indexcache import reference as ref
from test_fuzz import (POISON_I, assert_written, cmp_float, isas, magnitude, poisoned, same_bits, seeds, set_isa,
                       sprinkle)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    set_isa("auto")


def kpool_case(draw, seed):
    p = draw(st.sampled_from([1, 2, 3, 4, 16]))
    bs = p * draw(st.integers(1, 4))
    d = draw(st.sampled_from([1, 3, 8, 16, 33, 128]))
    batch = draw(st.integers(0, 4))
    ctx = [draw(st.integers(0, 60)) for _ in range(batch)]
    q = [draw(st.integers(0, 3 * p + 2)) for _ in range(batch)]
    width = max((-(-(c + m) // bs) for c, m in zip(ctx, q)), default=0) + draw(st.integers(0, 2))
    nb = batch * width + draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(nb, generator=g)[:batch * width].to(torch.int32).view(batch, width).contiguous()
    raw_dtype, pool_dtype, ape_dtype = (DTYPES[draw(st.sampled_from(["fp32", "bf16"]))] for _ in range(3))
    raw = torch.randn(nb, bs, 2 * d, generator=g) * magnitude(draw, -20, 20)
    sprinkle(draw, raw)
    ape = torch.randn(p, d, generator=g) * magnitude(draw, -6, 6)
    pool = poisoned((nb, bs // p, d), pool_dtype)
    lens = torch.tensor(ctx, dtype=torch.int32), torch.tensor(q, dtype=torch.int32)
    return raw.to(raw_dtype), pool, ape.to(ape_dtype), table, *lens


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_kpool_pool_paged(data, seed, isa):
    set_isa(isa)
    raw, pool, ape, table, ctx, q = kpool_case(data.draw, seed)
    want = pool.clone()
    ref.kpool_pool_paged(raw, want, ape, table, ctx, q)
    again = pool.clone()
    ops.kpool_pool_paged(raw, pool, ape, table, ctx, q)
    ops.kpool_pool_paged(raw, again, ape, table, ctx, q)
    assert same_bits(pool, again)
    written = ~torch.eq(want.view(torch.int32 if want.dtype == torch.float32 else torch.int16),
                        poisoned(want.shape, want.dtype).view(torch.int32 if want.dtype == torch.float32
                                                              else torch.int16)).all(-1)
    assert same_bits(pool[~written], want[~written])  # untouched rows keep their poison
    got, expect = pool[written].float(), want[written].float()
    assert torch.equal(torch.isnan(got), torch.isnan(expect))
    fin = torch.isfinite(expect)
    assert torch.equal(got[~fin & ~torch.isnan(expect)], expect[~fin & ~torch.isnan(expect)])
    # a pooled key is a convex combination of P keys: fp32 sums err by a few ulps of the largest
    keys = raw[..., :raw.shape[-1] // 2].float()
    top = keys[torch.isfinite(keys)].abs().amax() if torch.isfinite(keys).any() else torch.tensor(0.0)
    tol = 1e-5 if pool.dtype == torch.float32 else 2 ** -7
    assert ((got[fin] - expect[fin]).abs() <= tol * expect[fin].abs() + 1e-5 * top + 1e-30).all()


def width_inputs(draw, seed):
    d = draw(st.sampled_from([2, 4, 16, 24, 64, 96, 130, 192, 256]))
    dtype = DTYPES[draw(st.sampled_from(["fp32", "bf16"]))]
    h = draw(st.integers(1, 40))
    counts = [draw(st.integers(0, 120)) for _ in range(draw(st.integers(1, 3)))]
    rows = [draw(st.integers(0, 4)) for _ in counts]
    ks, ke, base = [], [], 0
    for n, r in zip(counts, rows):  # each row a prefix of its request's keys, maybe empty
        for _ in range(r):
            ks.append(base)
            ke.append(base + draw(st.integers(0, n)))
        base += n
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(ks), h, d, generator=g) * magnitude(draw, -10, 10)
    k = torch.randn(base, d, generator=g) * magnitude(draw, -10, 10)
    sprinkle(draw, q)
    sprinkle(draw, k)
    w = torch.randn(len(ks), h, generator=g)
    return (q.to(dtype), k.to(dtype), None, w, torch.tensor(ks, dtype=torch.int32),
            torch.tensor(ke, dtype=torch.int32))


@given(data=st.data(), seed=seeds, isa=isas)
def test_fuzz_indexer_at_pooled_and_qsa_widths(data, seed, isa):
    set_isa(isa)
    q, k, ksc, w, ks, ke = width_inputs(data.draw, seed)
    s_q, s_kv = q.shape[0], k.shape[0]
    out = poisoned((s_q, s_kv), torch.float32)
    ops.indexer_logits(q, k, ksc, w, ks, ke, out=out)
    assert_written(out)
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    cmp_float(out, expect, 1e-3)  # DESIGN §8 (the same inputs: fp32 sums in another order)
    assert same_bits(ops.indexer_logits(q, k, ksc, w, ks, ke), out)
    topk = data.draw(st.integers(1, 130))
    width = topk + data.draw(st.sampled_from([0, 3]))
    sel = torch.full((s_q + 1, width), POISON_I, dtype=torch.int32)
    got = ops.indexer_topk(q, k, ksc, w, ks, ke, topk, out=sel)
    assert (sel[s_q:] == POISON_I).all() and not (got == POISON_I).any()
    assert torch.equal(got, ref.topk_indices(out, ks, ke, topk, width))  # NaN above +inf, ties low first
    assert torch.equal(ops.indexer_topk(q, k, ksc, w, ks, ke, topk, width), got)
