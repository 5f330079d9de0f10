"""sparse_mla generalised for DeepSeek-V4 (DESIGN.md §5 "other shapes", §6): one shared K=V head
of d_qk = 512 (value = the whole row) and `extra_indices`, a second slot list into the same cache
(V4's sliding window of raw entries beside the selected compressed entries). The reference is
checked by hand and against transformers' own V4 attention math; the kernels against the
reference on every CPU path, with poisoned outputs; the error paths name the problem."""

import math

import pytest
import torch

from indexcache import ops
from indexcache import reference as ref

from test_ops import POISON_F, make_sinks, rel_err

V4_SCALE = 512 ** -0.5  # DeepseekV4Attention.scaling = head_dim ** -0.5


def make_v4(device, dtype, s_q, topk, n_extra, blocks=6, bs=64, seed=None):
    """A V4-shaped case: a [blocks, bs, 1, 512] cache of random K=V rows (written through the
    reference insert as 448 + 64), compressed-entry indices with -1 holes and a window list with
    -1 holes (positions past the request's start)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) if seed is None else seed)
    n = blocks * bs
    cache = torch.zeros(blocks, bs, 1, 512, dtype=dtype)
    rows = torch.randn(n, 512, generator=g) + 0.05
    ref.mla_kv_cache_insert(rows[:, :448], rows[:, 448:], torch.arange(n), cache)
    idx = torch.randint(0, n, (s_q, topk), dtype=torch.int32, generator=g)
    idx[:, ::3] = -1
    extra = torch.randint(0, n, (s_q, n_extra), dtype=torch.int32, generator=g)
    if n_extra:
        extra[:, :: 5] = -1
    return cache.to(device), idx.to(device), extra.to(device)


# ------------------------------------------------------------------ the reference

def test_reference_v4_by_hand():
    """d_qk 512, two lists: out = Σ_i e^(s_i) row_i / (e^sink + Σ_i e^(s_i)) over the valid
    entries of both lists (a slot listed in both counts twice), value = the whole row."""
    cache = torch.randn(1, 8, 1, 512)
    k = cache.reshape(8, 512)
    q = torch.randn(2, 1, 512)
    idx = torch.tensor([[3, -1], [-1, -1]], dtype=torch.int32)
    extra = torch.tensor([[5, 3, -1], [-1, -1, -1]], dtype=torch.int32)
    sink = torch.tensor([0.3])
    out, lse = ref.sparse_mla(q, cache, idx, 0.04, 512, sinks=sink, extra_indices=extra)
    slots = [3, 5, 3]
    s = torch.stack([(q[0, 0].double() * k[j].double()).sum() for j in slots]) * 0.04
    den = math.exp(0.3) + s.exp().sum().item()
    expect = sum(s.exp()[i] * k[j].double() for i, j in enumerate(slots)) / den
    assert torch.allclose(out[0, 0].double(), expect, rtol=1e-5, atol=1e-6)
    assert abs(lse[0, 0].item() - math.log(den)) < 1e-5
    assert (out[1] == 0).all() and lse[1, 0].item() == pytest.approx(0.3)
    # Without extra_indices it is the one-list op; with the lists swapped the same set.
    one = ref.sparse_mla(q, cache, torch.cat((idx, extra), 1), 0.04, 512, sinks=sink)
    assert torch.equal(one[0], out) and torch.equal(one[1], lse)


def _transformers_eager():
    mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    return mod.eager_attention_forward


def _v4_attention_by_transformers(q, cache, idx, extra, sinks, scale):
    """transformers' V4 attention (eager_attention_forward: the sink as one more logit, K = V,
    one KV head repeated over the query heads) per query row over the concatenation of its
    window rows and its selected compressed rows, built here from the slot lists."""
    eager = _transformers_eager()
    flat = cache.reshape(-1, cache.shape[-1]).float()
    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1]
    module.sinks = torch.nn.Parameter(sinks.clone(), requires_grad=False)
    module.eval()
    outs = []
    for t in range(q.shape[0]):
        window = [int(s) for s in extra[t] if s >= 0]
        selected = [int(s) for s in idx[t] if s >= 0]
        kv = torch.cat((flat[window], flat[selected]), 0)[None, None]  # [1, 1, n, 512]
        query = q[t].float()[None, :, None, :]  # [1, h, 1, 512]
        o, _ = eager(module, query, kv, kv, None, scaling=scale)  # [1, 1, h, 512]
        outs.append(o[0, 0])
    return torch.stack(outs)


def test_reference_equals_transformers_v4_attention():
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    cache, idx, extra = make_v4("cpu", torch.float32, 5, 40, 16)
    q = torch.randn(5, 8, 512)
    sinks = make_sinks(8, "cpu")
    got, _ = ref.sparse_mla(q, cache, idx, V4_SCALE, 512, sinks=sinks, extra_indices=extra)
    want = _v4_attention_by_transformers(q, cache, idx, extra, sinks, V4_SCALE)
    assert rel_err(got, want) < 1e-5


# ------------------------------------------------------------------ cache insert (V4 rows)

@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_mla_kv_cache_insert_v4_rows(device, cache_dtype):
    n, blocks, bs = 50, 3, 32
    rows = torch.randn(n, 512, device=device)
    slots = torch.randperm(blocks * bs)[:n].to(device)
    slots[4] = -1
    cache = torch.full((blocks, bs, 1, 512), 3, dtype=cache_dtype, device=device)
    expect = cache.cpu().clone()
    ops.mla_kv_cache_insert(rows[:, :448].contiguous(), rows[:, 448:].contiguous(), slots, cache)
    ref.mla_kv_cache_insert(rows[:, :448].cpu(), rows[:, 448:].cpu(), slots.cpu(), expect)
    assert torch.equal(cache.cpu(), expect)
    flat = cache.cpu().reshape(-1, 512).float()
    keep = slots.cpu() >= 0
    assert torch.equal(flat[slots.cpu()[keep]], rows.cpu()[keep].to(cache_dtype).float())


def test_mla_kv_cache_insert_v4_errors(device):
    cache = torch.zeros(2, 16, 1, 512, device=device)
    slots = torch.arange(4, device=device)
    with pytest.raises(RuntimeError, match=r"kv_c must be \[n, 448\] for cache rows of 512"):
        ops.mla_kv_cache_insert(torch.randn(4, 512, device=device), torch.randn(4, 64, device=device), slots, cache)
    with pytest.raises(RuntimeError, match="kv_c must be \\[n, 512\\] for an fp8_ds_mla cache"):
        ops.mla_kv_cache_insert(torch.randn(4, 448, device=device), torch.randn(4, 64, device=device), slots,
                                torch.zeros(2, 16, 656, dtype=torch.uint8, device=device))
    with pytest.raises(RuntimeError, match="rows of 576 \\(DSA\\) or 512 \\(DeepSeek-V4\\)"):
        ops.mla_kv_cache_insert(torch.randn(4, 448, device=device), torch.randn(4, 64, device=device), slots,
                                torch.zeros(2, 16, 1, 520, device=device))


# ------------------------------------------------------------------ argument errors

def test_v4_shape_errors(device):
    cache, idx, extra = make_v4(device, torch.bfloat16, 2, 8, 4, blocks=1)
    q = torch.randn(2, 4, 512, device=device).bfloat16()
    out = torch.full((2, 4, 512), POISON_F, dtype=torch.bfloat16, device=device)
    lse = torch.full((2, 4), POISON_F, device=device)
    c576 = torch.zeros(1, 64, 576, dtype=torch.bfloat16, device=device)
    fp8 = torch.zeros(1, 64, 656, dtype=torch.uint8, device=device)
    bad = [  # (q, cache, extra, the op's message: csrc/checks.h)
        (torch.randn(2, 4, 256, device=device).bfloat16(), cache, None, r"\(absorbed DSA\) or .* \(DeepSeek-V4\)"),
        (q, c576, None, "rows of d_qk = 512"),
        (torch.randn(2, 4, 576, device=device).bfloat16(), cache, None, "rows of d_qk = 576"),
        (q, fp8, None, "576-wide rows, but q has d_qk 512"),
        (q, cache, extra.long(), "extra_indices must be Int"),
        (q, cache, extra[:1].contiguous(), "extra_indices has 1 rows for 2 queries"),
        (q, cache, extra.reshape(-1), "extra_indices must have 2 dims"),
        (q, cache, torch.zeros(4, 2, dtype=torch.int32, device=device).t(), "extra_indices must be contiguous"),
    ]
    if device == "cpu" and torch.cuda.is_available():
        bad.append((q, cache, extra.cuda(), "extra_indices and q must be on one device"))
    for qq, cc, ee, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            ops.sparse_mla(qq, cc, idx, 0.1, extra_indices=ee)
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.sparse_mla(qq, cc, idx, 0.1, 512, out, lse, None, ee)
        assert out.isnan().all() and lse.isnan().all()  # nothing written
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'Optional\[Tensor\]' for argument 'extra_indices'"):
        ops.sparse_mla(q, cache, idx, 0.1, extra_indices=[[0]] * 2)


def test_v4_extra_indices_out_of_range(device, monkeypatch):
    """The CPU op raises on an out-of-range extra_indices entry, and so does CUDA with
    INDEXCACHE_CHECK=1; by default CUDA drops each such entry (as -1) and counts it."""
    cache, idx, extra = make_v4(device, torch.bfloat16, 2, 8, 4, blocks=1)
    q = torch.randn(2, 4, 512, device=device).bfloat16()
    if device == "cuda":
        monkeypatch.setenv("INDEXCACHE_CHECK", "1")
    with pytest.raises(RuntimeError, match="extra_indices holds slot 64 but the cache has 64 slots"):
        ops.sparse_mla(q, cache, idx, 0.1, extra_indices=torch.full_like(extra, 64))
    with pytest.raises(RuntimeError, match="extra_indices holds -2"):
        ops.sparse_mla(q, cache, idx, 0.1, extra_indices=torch.full_like(extra, -2))
    if device != "cuda":
        return
    monkeypatch.delenv("INDEXCACHE_CHECK")
    want = ops.sparse_mla(q, cache, idx, 0.1, extra_indices=torch.full_like(extra, -1))
    for bad in (64, -2):
        ops.reset_cuda_error_count()
        got = ops.sparse_mla(q, cache, idx, 0.1, extra_indices=torch.full_like(extra, bad))
        assert ops.cuda_error_count() == extra.numel()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------ the kernels

CASES = [("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2), ("bf16", torch.float32, 1e-5)]
SHAPES = [(3, 16, 64, 24), (2, 64, 200, 128), (4, 5, 7, 3), (2, 8, 40, 0)]


def _run(q, cache, idx, extra, sinks, scale=V4_SCALE):
    out = torch.full((q.shape[0], q.shape[1], 512), POISON_F, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:2], POISON_F, device=q.device)
    ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse, sinks=sinks, extra_indices=extra)
    return out, lse


@pytest.mark.parametrize("cache_kind,q_dtype,bar", CASES)
@pytest.mark.parametrize("s_q,h,topk,n_extra", SHAPES)
@pytest.mark.parametrize("with_extra,with_sinks", [(True, True), (True, False), (False, True), (False, False)])
def test_sparse_mla_v4(device, cpu_isa, cache_kind, q_dtype, bar, s_q, h, topk, n_extra, with_extra, with_sinks):
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[cache_kind]
    cache, idx, extra = make_v4(device, dt, s_q, topk, n_extra)
    idx[1 % s_q] = -1
    extra[1 % s_q] = -1  # a row with no valid slot in either list
    if s_q > 2:
        idx[2] = -1  # window entries only
    extra = extra if with_extra else None
    q = (torch.randn(s_q, h, 512) + 0.02).to(q_dtype).to(device)
    sinks = make_sinks(h, device) if with_sinks else None
    out, lse = _run(q, cache, idx, extra, sinks)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), V4_SCALE, 512,
                            sinks=None if sinks is None else sinks.cpu(), extra_indices=None if extra is None else extra.cpu())
    got, gl = out.cpu().float(), lse.cpu()
    assert torch.isfinite(got).all() and not gl.isnan().any()
    assert (got[1 % s_q] == 0).all()
    if sinks is None:
        assert torch.isneginf(gl[1 % s_q]).all()
    else:
        assert torch.equal(gl[1 % s_q], sinks.cpu())
    assert rel_err(got, ro.float()) < bar
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(gl))
    assert (gl[fin] - rl[fin]).abs().max() < (1e-4 if bar < 1e-2 else 2e-2)
    again = _run(q, cache, idx, extra, sinks)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_sparse_mla_v4_decode_split_keys(device, cpu_isa, q_dtype, cache_dtype):
    """V4-Flash decode: one or two rows, 512 compressed + 128 window entries, 64 heads: the
    combined list is split across threads and merged (the sink once, in the merge); a NaN in one
    query head poisons only its own (row, head)."""
    s_q, h = 2, 64
    cache, idx, extra = make_v4(device, cache_dtype, s_q, 512, 128, blocks=20)
    q = torch.randn(s_q, h, 512).to(q_dtype).to(device)
    q[1, 5, 100] = float("nan")
    sinks = make_sinks(h, device)
    out, lse = _run(q, cache, idx, extra, sinks)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), V4_SCALE, 512, sinks=sinks.cpu(), extra_indices=extra.cpu())
    got, gl = out.cpu().float(), lse.cpu()
    assert got[1, 5].isnan().all() and gl[1, 5].isnan()
    keep = torch.ones(s_q, h, dtype=torch.bool)
    keep[1, 5] = False
    bar = 1e-5 if q_dtype == torch.float32 else 1e-2
    assert torch.isfinite(got[keep]).all()
    assert rel_err(got[keep], ro.float()[keep]) < bar
    assert (gl[keep] - rl[keep]).abs().max() < (1e-4 if bar < 1e-2 else 2e-2)


@pytest.mark.parametrize("cache_kind,q_dtype", [("fp8", torch.bfloat16), ("bf16", torch.bfloat16),
                                                ("fp32", torch.float32)])
def test_sparse_mla_576_with_extra_indices(device, cpu_isa, cache_kind, q_dtype):
    """The DSA form takes extra_indices too, and equals the op on the concatenated list to the bit."""
    from test_ops import make_mla

    cache, idx = make_mla(device, cache_kind, 3, 16, 50)
    n = cache.shape[0] * cache.shape[1]
    extra = torch.randint(0, n, (3, 30), dtype=torch.int32).to(device)
    extra[:, ::4] = -1
    q = torch.randn(3, 16, 576).to(q_dtype).to(device)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    out = torch.full((3, 16, 512), POISON_F, dtype=q_dtype, device=device)
    lse = torch.full((3, 16), POISON_F, device=device)
    ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse, extra_indices=extra)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), scale, extra_indices=extra.cpu())
    assert rel_err(out.cpu().float(), ro.float()) < (1e-5 if q_dtype == torch.float32 else 1e-2)
    assert (lse.cpu() - rl).abs().max() < 2e-2
    one = ops.sparse_mla(q, cache, torch.cat((idx, extra), 1).contiguous(), scale)
    assert torch.equal(one[0], out) and torch.equal(one[1], lse)


def test_sparse_mla_v4_equals_transformers(device, cpu_isa):
    """The op (every CPU path) equals transformers' V4 attention math in fp32 to 1e-5."""
    cache, idx, extra = make_v4(device, torch.float32, 4, 60, 20)
    q = torch.randn(4, 16, 512).to(device)
    sinks = make_sinks(16, device)
    out, _ = _run(q, cache, idx, extra, sinks)
    want = _v4_attention_by_transformers(q.cpu(), cache.cpu(), idx.cpu(), extra.cpu(), sinks.cpu(), V4_SCALE)
    assert rel_err(out.cpu(), want) < 1e-5


def test_sparse_mla_v4_opcheck():
    cache, idx, extra = make_v4("cpu", torch.bfloat16, 2, 8, 4, blocks=1)
    q = torch.randn(2, 4, 512).bfloat16()
    o = torch.ops.indexcache.sparse_mla.default
    utils = ("test_schema", "test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    for args in [(q, cache, idx, 0.1, 512, torch.empty(2, 4, 512, dtype=torch.bfloat16), torch.empty(2, 4), None, extra),
                 (q, cache, idx, 0.1, 512, torch.empty(2, 4, 512, dtype=torch.bfloat16), torch.empty(2, 4),
                  torch.randn(4), extra)]:
        torch.library.opcheck(o, args, test_utils=utils)
    rows = torch.randn(3, 512)
    torch.library.opcheck(torch.ops.indexcache.mla_kv_cache_insert.default,
                          (rows[:, :448].contiguous(), rows[:, 448:].contiguous(), torch.tensor([0, 5, -1]), cache.clone()),
                          test_utils=utils)


def test_torch_compile_sparse_mla_v4():
    """The V4 call (window + selected, sinks; the wrapper's checks included) compiles with fullgraph=True."""
    cache, idx, extra = make_v4("cpu", torch.bfloat16, 2, 8, 4, blocks=1)
    sinks = torch.randn(4)

    def attend(q, sinks):
        return ops.sparse_mla(q, cache, idx, V4_SCALE, sinks=sinks, extra_indices=extra)

    q = torch.randn(2, 4, 512).bfloat16()
    eager = attend(q, sinks)
    compiled = torch.compile(attend, fullgraph=True)(q, sinks)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
