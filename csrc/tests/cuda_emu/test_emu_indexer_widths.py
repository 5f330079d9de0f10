"""The CUDA dense indexer ops at head widths other than 128 (csrc/cuda/indexer_any_impl.cuh: the
key-pooled and QSA indexers' widths), run through the emulator against reference.py: fresh random
inputs, poisoned outputs, per-row windows over concatenated requests, a wider output, bad windows
made empty and counted, the chunked fused route selecting exactly what the plain scores give.

    python -m pytest -q csrc/tests/cuda_emu/test_emu_indexer_widths.py
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from test_emu import FP8, I, P, call, dt_code, lib, ref, rel_err

POISON_I = -7777


def inputs(s_q, s_kv, h, d, dtype, gen):
    q = torch.randn(s_q, h, d, generator=gen) * 2 + 0.1
    k = torch.randn(s_kv, d, generator=gen) + 0.05
    w = torch.randn(s_q, h, generator=gen)
    if dtype == "fp8":
        qs = q.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
        kscale = k.abs().amax(-1).clamp(min=1e-4) / 448.0
        return (q / qs).to(torch.float8_e4m3fn), (k / kscale.unsqueeze(-1)).to(torch.float8_e4m3fn), kscale, w * qs[..., 0]
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return q.to(dt), k.to(dt), None, w


def windows(counts, rows):
    ks, ke, base = [], [], 0
    for n, m in zip(counts, rows):
        for j in range(m):
            ks.append(base)
            ke.append(base + (n * (j + 1)) // m)
        base += n
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


def raw(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def logits_d(q, k, ksc, w, ks, ke, cols):
    s_q, h, d = q.shape
    out = torch.full((s_q, cols), float("nan"))
    call("emu_indexer_logits_d", P(raw(q)), P(raw(k)), P(ksc), P(w), P(ks), P(ke), I(s_q), I(k.shape[0]), I(h), I(d),
         ctypes.c_int(dt_code(q)), P(out), I(cols), I(cols))
    return out


def topk_d(q, k, ksc, w, ks, ke, topk, width):
    s_q, h, d = q.shape
    out = torch.full((s_q, width), POISON_I, dtype=torch.int32)
    call("emu_indexer_topk_d", P(raw(q)), P(raw(k)), P(ksc), P(w), P(ks), P(ke), I(s_q), I(k.shape[0]), I(h), I(d),
         ctypes.c_int(dt_code(q)), P(out), I(width), I(width), I(topk))
    return out


@pytest.mark.parametrize("d", [16, 24, 256])
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_logits_and_topk_at_width(d, dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    counts, rows = [0, 37, 70], [2, 3, 3]
    ks, ke = windows(counts, rows)
    h = 5
    q, k, ksc, w = inputs(sum(rows), sum(counts), h, d, dtype, gen)
    cols = sum(counts) + 9  # a wider output: the columns past s_kv are -inf
    got = logits_d(q, k, ksc, w, ks, ke, cols)
    expect = torch.full((sum(rows), cols), float("-inf"))
    expect[:, :sum(counts)] = ref.indexer_logits(q, k, ksc, w, ks, ke)
    assert not got.isnan().any() and torch.equal(torch.isinf(got), torch.isinf(expect))
    fin = torch.isfinite(expect)
    assert rel_err(got[fin], expect[fin]) < 1e-5
    for topk in (1, 6, 30):
        sel = topk_d(q, k, ksc, w, ks, ke, topk, topk + 2)
        # exactly the top-k of the kernel's own scores (the same scores, the exact selection)
        assert torch.equal(sel, ref.topk_indices(got[:, :sum(counts)], ks, ke, topk, width=topk + 2))


def test_bad_window_is_empty_and_counted():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    q, k, _, w = inputs(3, 20, 2, 24, "fp32", gen)
    ks = torch.tensor([0, 5, 3], dtype=torch.int32)
    ke = torch.tensor([20, 25, 2], dtype=torch.int32)  # row 1 past the keys, row 2 reversed
    lib().emu_reset_error_count()
    sel = topk_d(q, k, None, w, ks, ke, 4, 4)
    assert lib().emu_error_count() == 2
    assert (sel[1:] == -1).all() and (sel[0] >= 0).all()


def test_fp8_widths_match_the_exact_products():
    """fp8 at width 24: the e4m3 values are widened exactly, so the scores equal fp32 scores of the
    dequantized values up to fp32 summation order."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    q, k, ksc, w = inputs(4, 50, 3, 24, "fp8", gen)
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 50, dtype=torch.int32)
    got = logits_d(q, k, ksc, w, ks, ke, 50)
    expect = ref.indexer_logits(q.float(), k.float(), ksc, w, ks, ke)
    assert rel_err(got, expect) < 1e-6
    assert FP8 == dt_code(q)
