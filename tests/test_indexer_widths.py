"""The dense indexer ops at the head widths of the key-pooled (GLM-5.3-Flash ``index_head_dim``) and
QSA (Qwen3.8-Flash-Next ``indexer_head_dim``) indexers, not only the lightning indexer's 128: against
reference.py on fresh random inputs, poisoned outputs, every CPU path, thread-count determinism,
per-row windows over concatenated requests (the two indexers' calls), and the error paths."""

import pytest
import torch

from indexcache import ops
from indexcache import reference as ref
from indexcache.formats import MAX_INDEXER_HEAD_DIM

# not `from conftest import ...`: the README's test command also collects csrc/tests/cuda_emu, whose
# conftest.py takes that module name first
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

POISON_I = -7777
WIDTHS = [2, 16, 24, 64, 96, 192, 256]


def inputs(s_q, s_kv, h, d, dtype, gen):
    q = torch.randn(s_q, h, d, generator=gen) * 2 + 0.1
    k = torch.randn(s_kv, d, generator=gen) + 0.05
    w = torch.randn(s_q, h, generator=gen)
    if dtype == "fp8":  # per-row scales (a width that is not one 128 group: one scale per row)
        qs = q.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
        kscale = k.abs().amax(-1).clamp(min=1e-4) / 448.0
        qv = (q / qs).to(torch.float8_e4m3fn)
        kv = (k / kscale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        return qv, kv, kscale, w * qs[..., 0]
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return q.to(dt), k.to(dt), None, w


def request_windows(key_counts, rows_per_request):
    """Rows of requests laid out one after another over their concatenated keys, each row seeing
    a growing prefix of its own request's keys (as the pooled and QSA indexers call the op)."""
    ks, ke, base = [], [], 0
    for n_keys, rows in zip(key_counts, rows_per_request):
        for j in range(rows):
            ks.append(base)
            ke.append(base + (n_keys * (j + 1)) // rows)
        base += n_keys
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)


def value_sets_match(got, expect, logits, ks):
    """Same count per row, and the selected scores equal as sets (ties may pick other keys of equal score)."""
    assert torch.equal((got >= 0).sum(1), (expect >= 0).sum(1))
    for r in range(got.shape[0]):
        m = int((got[r] >= 0).sum())
        a = logits[r, int(ks[r]) + got[r, :m].long()]
        b = logits[r, int(ks[r]) + expect[r, :m].long()]
        assert torch.allclose(a.sort().values, b.sort().values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("h", [1, 4, 13])
def test_logits_and_fused_topk_at_width(cpu_isa, d, dtype, h):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    counts, rows = [0, 37, 300, 5], [3, 4, 6, 2]
    ks, ke = request_windows(counts, rows)
    q, k, kscale, w = inputs(sum(rows), sum(counts), h, d, dtype, gen)
    out = torch.full((sum(rows), sum(counts)), float("nan"))
    ops.indexer_logits(q, k, kscale, w, ks, ke, out=out)
    expect = ref.indexer_logits(q, k, kscale, w, ks, ke)
    assert torch.equal(torch.isinf(out), torch.isinf(expect)) and not out.isnan().any()
    fin = torch.isfinite(expect)
    err = ((out[fin].double() - expect[fin].double()).norm() / expect[fin].double().norm()).item()
    assert err < 1e-5  # same dequantized inputs, fp32 sums: far inside DESIGN §8's 1e-3
    for topk in (1, 8, 40):
        sel = torch.full((sum(rows), topk + 3), POISON_I, dtype=torch.int32)
        got = ops.indexer_topk(q, k, kscale, w, ks, ke, topk, out=sel)
        assert torch.equal(got, ops.topk_indices(out, ks, ke, topk, width=topk + 3))  # the plain op's scores
        value_sets_match(got, ref.indexer_topk(q, k, kscale, w, ks, ke, topk, width=topk + 3), expect, ks)


@pytest.mark.parametrize("d", [16, 24, 256])
def test_fused_long_rows_split_keys(cpu_isa, d):
    """Few rows over many keys: the fused op splits each row's keys across tasks and merges them."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    ks, ke = request_windows([9000, 12000], [1, 2])
    q, k, _, w = inputs(3, 21000, 4, d, "fp32", gen)
    got = ops.indexer_topk(q, k, None, w, ks, ke, 300)
    logits = ref.indexer_logits(q, k, None, w, ks, ke)
    value_sets_match(got, ref.topk_indices(logits, ks, ke, 300), logits, ks)


@pytest.mark.parametrize("d", [24, 192])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_bit_identical_across_thread_counts(cpu_isa, d, dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    ks, ke = request_windows([5000, 700], [2, 9])
    q, k, kscale, w = inputs(11, 5700, 6, d, dtype, gen)
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            runs.append((ops.indexer_logits(q, k, kscale, w, ks, ke), ops.indexer_topk(q, k, kscale, w, ks, ke, 64)))
    finally:
        torch.set_num_threads(before)
    for logits, sel in runs[1:]:
        assert torch.equal(logits, runs[0][0]) and torch.equal(sel, runs[0][1])


def test_nan_scores_are_largest(cpu_isa):
    """A NaN query at width 24 gives NaN scores, which the top-k orders above every number (as at 128)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    q, k, _, w = inputs(2, 50, 3, 24, "fp32", gen)
    q[1, 0, 5] = float("nan")
    ks, ke = torch.zeros(2, dtype=torch.int32), torch.full((2,), 50, dtype=torch.int32)
    got = ops.indexer_topk(q, k, None, w, ks, ke, 7)
    assert torch.equal(got, ref.topk_indices(ref.indexer_logits(q, k, None, w, ks, ke), ks, ke, 7))


@pytest.mark.parametrize("d,match", [(3, "even"), (0, "even"), (258, "even and in"), (512, str(MAX_INDEXER_HEAD_DIM))])
@pytest.mark.parametrize("op", ["logits", "topk"])
def test_bad_width(d, match, op):
    q, k = torch.randn(2, 2, d), torch.randn(5, d)
    w, ks, ke = torch.randn(2, 2), torch.zeros(2, dtype=torch.int32), torch.full((2,), 5, dtype=torch.int32)
    call = (lambda: ops.indexer_logits(q, k, None, w, ks, ke)) if op == "logits" else (
        lambda: ops.indexer_topk(q, k, None, w, ks, ke, 2))
    with pytest.raises(RuntimeError, match=match):
        call()


def test_width_mismatch_dtype_and_window_errors():
    q, k, w = torch.randn(2, 2, 24), torch.randn(5, 16), torch.randn(2, 2)
    ks, ke = torch.zeros(2, dtype=torch.int32), torch.full((2,), 5, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="one head width"):
        ops.indexer_topk(q, k, None, w, ks, ke, 2)
    with pytest.raises(RuntimeError, match="k must have q's dtype"):
        ops.indexer_topk(q, torch.randn(5, 24).bfloat16(), None, w, ks, ke, 2)
    with pytest.raises(RuntimeError, match="float8_e4m3fn, bfloat16 or float32"):
        ops.indexer_topk(q.half(), torch.randn(5, 24).half(), None, w, ks, ke, 2)
    bad_ke = torch.tensor([5, 6], dtype=torch.int32)  # past the 5 keys
    with pytest.raises(RuntimeError, match="outside"):
        ops.indexer_topk(q, torch.randn(5, 24), None, w, ks, bad_ke, 2)


def test_opcheck_and_fake_kernel_at_other_widths():
    """The ops' schema, fake kernel and dispatch at widths 24 and 256 (torch.library.opcheck), and the
    fake kernel refusing an odd width as the CPU op does."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    ks, ke = request_windows([40, 9], [2, 1])
    o = torch.ops.indexcache
    for d in (24, 256):
        q, k, _, w = inputs(3, 49, 4, d, "bf16", gen)
        torch.library.opcheck(o.indexer_logits.default, (q, k, None, w, ks, ke, torch.empty(3, 49)))
        torch.library.opcheck(o.indexer_topk.default, (q, k, None, w, ks, ke, 5, torch.empty(4, 6, dtype=torch.int32)))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        w, ks, ke = torch.empty(3, 2), torch.empty(3, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="even"):
            o.indexer_topk(torch.empty(3, 2, 25), torch.empty(7, 25), None, w, ks, ke, 4,
                           torch.empty(3, 4, dtype=torch.int32))


@NO_CUDA
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_cuda_other_widths_equal_the_reference(dtype):
    """csrc/cuda/indexer_any_impl.cuh on the device: the scores at width 24 to the reference's bar,
    the fused selection exactly the top-k of the device's own scores."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    ks, ke = request_windows([30, 300], [3, 5])
    q, k, kscale, w = inputs(8, 330, 6, 24, dtype, gen)
    dev = [None if t is None else t.cuda() for t in (q, k, kscale, w, ks, ke)]
    logits = ops.indexer_logits(*dev).cpu()
    expect = ref.indexer_logits(q, k, kscale, w, ks, ke)
    fin = torch.isfinite(expect)
    assert torch.equal(torch.isinf(logits), torch.isinf(expect))
    assert ((logits[fin].double() - expect[fin].double()).norm() / expect[fin].double().norm()).item() < 1e-5
    got = ops.indexer_topk(*dev, 17).cpu()
    assert torch.equal(got, ref.topk_indices(logits, ks, ke, 17))
