"""Every op against reference.py (DESIGN.md §8): fresh random inputs, poisoned outputs,
every element checked, determinism, opcheck, error paths. Parametrized over device."""

import math

import pytest
import torch

import indexcache._C as _C
from indexcache import ops
from indexcache import reference as ref

POISON_I = -7777
POISON_F = float("nan")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def make_indexer_inputs(s_q, s_kv, h, device, dtype):
    q = torch.randn(s_q, h, 128, device=device) * 2 + 0.1
    k = torch.randn(s_kv, 128, device=device) + 0.05
    w = torch.randn(s_q, h, device=device)
    if dtype == "fp8":
        qv, qs = ref.quantize_fp8(q.cpu(), ref.INDEX_Q_EPS)
        kv, ks_ = ref.quantize_fp8(k.cpu(), ref.INDEX_K_EPS)
        return qv.to(device), kv.to(device), ks_[:, 0].to(device), ref.indexer_weights(w, qs[..., 0].to(device))
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return q.to(dt), k.to(dt), None, ref.indexer_weights(w)


def causal_windows(s_q, s_kv, device):
    # A flattened batch of two requests: keys [0, a) then [a, s_kv); queries at their ends.
    a = s_kv // 2
    ks, ke = [], []
    for t in range(s_q):
        if t % 2 == 0:
            ks.append(0)
            ke.append(max(1, a - (s_q - t)))
        else:
            ks.append(a)
            ke.append(max(a + 1, s_kv - (s_q - t)))
    return (torch.tensor(ks, dtype=torch.int32, device=device), torch.tensor(ke, dtype=torch.int32, device=device))


# ------------------------------------------------------------------ quantization and caches

@pytest.mark.parametrize("shape", [(1, 128), (9, 4, 128), (3, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_fp8(device, cpu_isa, shape, dtype, hadamard):
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 100).to(dtype).to(device)
    v, s = ops.quantize_fp8(x, ref.INDEX_Q_EPS, hadamard)
    rv, rs = ref.quantize_fp8(x.cpu(), ref.INDEX_Q_EPS, hadamard)
    assert v.dtype == torch.float8_e4m3fn and s.shape == rs.shape
    assert torch.equal(v.cpu().view(torch.uint8), rv.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)
    # Scales are powers of two and values stay within e4m3's range.
    assert torch.equal(torch.frexp(s.cpu())[0], torch.full_like(s.cpu(), 0.5))
    assert v.float().abs().max() <= 448


def test_ue8m0_scale_exact_at_powers_of_two():
    amax = torch.tensor([448.0, 448.0 * 2**-3, 448.0 * 2**-3 * (1 + 2**-23), 1e-12])
    s = ref.ue8m0_scale(amax, 1e-4)
    assert s.tolist() == [1.0, 2**-3, 2**-2, 2.0 ** math.ceil(math.log2(1e-4 / 448))]


def test_index_k_cache_insert(device, cpu_isa):
    n, blocks, bs = 150, 5, 64
    k = torch.randn(n, 128, device=device)
    slots = torch.randperm(blocks * bs)[:n].to(device)
    slots[::7] = -1
    cache = torch.randint(0, 255, (blocks, bs * 132), dtype=torch.uint8, device=device)
    expect = cache.cpu().clone()
    ops.index_k_cache_insert(k, slots, cache)
    ref.index_k_cache_insert(k.cpu(), slots.cpu(), expect)
    assert torch.equal(cache.cpu(), expect)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_mla_kv_cache_insert(device, cache_dtype):
    n, blocks, bs = 70, 3, 32
    kv_c, k_pe = torch.randn(n, 512, device=device), torch.randn(n, 64, device=device)
    slots = torch.randperm(blocks * bs)[:n].to(device)
    slots[3] = -1
    width = 656 if cache_dtype == torch.uint8 else 576
    cache = torch.full((blocks, bs, width), 3, dtype=cache_dtype, device=device)
    expect = cache.cpu().clone()
    ops.mla_kv_cache_insert(kv_c, k_pe, slots, cache)
    ref.mla_kv_cache_insert(kv_c.cpu(), k_pe.cpu(), slots.cpu(), expect)
    assert torch.equal(cache.cpu().view(torch.uint8), expect.view(torch.uint8))


def test_positions_to_slots(device):
    n, k, batch, bs = 12, 40, 3, 16
    table = torch.randperm(30, dtype=torch.int32).reshape(batch, 10).to(device)
    pos = torch.randint(0, 160, (n, k), dtype=torch.int32, device=device)
    pos[:, ::5] = -1
    req = torch.randint(0, batch, (n,), dtype=torch.int32, device=device)
    out = torch.full_like(pos, POISON_I)
    ops.positions_to_slots(pos, req, table, bs, 30, out=out)
    assert torch.equal(out.cpu(), ref.positions_to_slots(pos.cpu(), req.cpu(), table.cpu(), bs))


# ------------------------------------------------------------------ indexer logits

@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("s_q,s_kv,h", [(1, 1, 64), (7, 300, 64), (16, 1000, 12), (3, 33, 5)])
def test_indexer_logits(device, cpu_isa, dtype, s_q, s_kv, h):
    q, k, k_scale, w = make_indexer_inputs(s_q, s_kv, h, device, dtype)
    ks, ke = causal_windows(s_q, s_kv, device)
    out = torch.full((s_q, s_kv), POISON_F, device=device)
    ops.indexer_logits(q, k, k_scale, w, ks, ke, out=out)
    expect = ref.indexer_logits(q.cpu(), k.cpu(), None if k_scale is None else k_scale.cpu(), w.cpu(), ks.cpu(), ke.cpu())
    got = out.cpu()
    assert not got.isnan().any()
    assert torch.equal(torch.isinf(got), torch.isinf(expect))  # the -inf pattern exactly
    fin = torch.isfinite(expect)
    assert rel_err(got[fin], expect[fin]) < 1e-5  # same dequantized inputs: far below the 1e-3 bar


def test_indexer_logits_fp8_vs_fp32_reference(device):
    # The fp8 path against unquantized fp32 scores: the DESIGN.md §8 bar of 1e-3 is for the
    # kernel given the same inputs; quantization itself costs more, bounded here loosely.
    s_q, s_kv, h = 8, 500, 64
    q = torch.randn(s_q, h, 128)
    k = torch.randn(s_kv, 128)
    w = torch.randn(s_q, h)
    ks, ke = causal_windows(s_q, s_kv, "cpu")
    exact = ref.indexer_logits(q, k, None, ref.indexer_weights(w), ks, ke)
    qv, qs = ops.quantize_fp8(q.to(device), ref.INDEX_Q_EPS)
    kv, ksc = ops.quantize_fp8(k.to(device), ref.INDEX_K_EPS)
    got = ops.indexer_logits(qv, kv, ksc[:, 0].contiguous(), ref.indexer_weights(w.to(device), qs[..., 0]), ks.to(device), ke.to(device)).cpu()
    fin = torch.isfinite(exact)
    assert rel_err(got[fin], exact[fin]) < 0.1


def test_indexer_logits_paged(device, cpu_isa):
    batch, next_n, h, bs, blocks = 3, 2, 64, 64, 12
    seq_lens = torch.tensor([5, 130, 64], dtype=torch.int32)
    table = torch.randperm(blocks, dtype=torch.int32)[: batch * 4].reshape(batch, 4)
    cache = torch.zeros(blocks, bs * 132, dtype=torch.uint8)
    for b in range(batch):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        slots = table[b, pos // bs].long() * bs + pos % bs
        ref.index_k_cache_insert(torch.randn(n, 128), slots, cache)
    qv, qs = ref.quantize_fp8(torch.randn(batch * next_n, h, 128), ref.INDEX_Q_EPS)
    w = ref.indexer_weights(torch.randn(batch * next_n, h), qs[..., 0])
    max_len = 140
    out = torch.full((batch * next_n, max_len), POISON_F, device=device)
    ops.indexer_logits_paged(qv.to(device), w.to(device), cache.to(device), table.to(device), seq_lens.to(device), next_n, max_len, out=out)
    expect = ref.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, max_len)
    got = out.cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(expect)) and not got.isnan().any()
    fin = torch.isfinite(expect)
    assert rel_err(got[fin], expect[fin]) < 1e-5
    # Window rule: row j of request b sees seq_len - next_n + j + 1 keys.
    assert torch.equal(torch.isfinite(got).sum(1), ref.decode_windows(seq_lens, next_n))


# ------------------------------------------------------------------ top-k

def distinct_logits(rows, n, device):
    # Tie-free: a random permutation of distinct values per row.
    return torch.stack([torch.randperm(n).float() * 0.5 - n / 7 for _ in range(rows)]).to(device)


@pytest.mark.parametrize("rows,n,topk", [(4, 10, 16), (3, 64, 64), (5, 1000, 64), (2, 5000, 2048), (6, 300, 1)])
def test_topk_tie_free_matches_torch_topk(device, rows, n, topk):
    logits = distinct_logits(rows, n, device)
    ks = torch.zeros(rows, dtype=torch.int32, device=device)
    ke = torch.full((rows,), n, dtype=torch.int32, device=device)
    out = torch.full((rows + 3, topk + 5), POISON_I, dtype=torch.int32, device=device)
    got = ops.topk_indices(logits, ks, ke, topk, out=out).cpu()
    k = min(topk, n)
    expect = torch.topk(logits.cpu(), k, dim=1).indices.sort(dim=1).values
    assert torch.equal(got[:, :k].long(), expect)
    assert (got[:, k:] == -1).all()  # the full buffer width is written
    assert (out[rows:].cpu() == POISON_I).all()  # rows past the batch are untouched
    assert torch.equal(got, ref.topk_indices(logits.cpu(), ks.cpu(), ke.cpu(), topk, topk + 5))


def test_topk_windows_and_ties(device):
    rows, n, topk = 40, 700, 50
    logits = torch.randint(-5, 5, (rows, n)).float().to(device)  # heavy ties
    logits[3] = -math.inf  # all -inf
    ks = torch.randint(0, n, (rows,), dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(0, 300, (rows,), dtype=torch.int32), torch.tensor(n, dtype=torch.int32))
    ks[3], ke[3] = 0, n
    ks[4], ke[4] = 10, 10  # empty window
    ks[5], ke[5] = 100, 100 + topk  # window == k
    ks, ke = ks.to(device), ke.to(device)
    got = ops.topk_indices(logits, ks, ke, topk).cpu()
    expect = ref.topk_indices(logits.cpu(), ks.cpu(), ke.cpu(), topk)
    assert torch.equal(got, expect)
    assert (got[4] == -1).all()
    assert torch.equal(got[5], torch.arange(topk, dtype=torch.int32))
    # Gathered values equal torch.topk's on tied rows.
    for r in range(rows):
        lo, hi = int(ks[r]), int(ke[r])
        k = min(topk, hi - lo)
        if k == 0:
            continue
        vals = logits[r, lo:hi].cpu()
        assert torch.equal(vals[got[r, :k].long()].sort().values, torch.topk(vals, k).values.sort().values)


@pytest.mark.parametrize("n", [65536, 262144])
def test_topk_long_rows(device, cpu_isa, n):
    rows, topk = 2, 2048
    logits = torch.randn(rows, n, device=device)
    ks = torch.zeros(rows, dtype=torch.int32, device=device)
    ke = torch.tensor([n, n - 12345], dtype=torch.int32, device=device)
    got = ops.topk_indices(logits, ks, ke, topk).cpu()
    for r in range(rows):
        expect = torch.topk(logits[r, : int(ke[r])].cpu(), topk).indices.sort().values
        assert torch.equal(got[r].long(), expect)


# ------------------------------------------------------------------ fused scoring + top-k

@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("s_q,s_kv,h,topk", [(6, 200, 64, 16), (9, 3000, 16, 256), (4, 50, 8, 64), (2, 9000, 4, 2048)])
def test_indexer_topk_fused(device, cpu_isa, dtype, s_q, s_kv, h, topk):
    q, k, k_scale, w = make_indexer_inputs(s_q, s_kv, h, device, dtype)
    ks, ke = causal_windows(s_q, s_kv, device)
    out = torch.full((s_q, topk), POISON_I, dtype=torch.int32, device=device)
    got = ops.indexer_topk(q, k, k_scale, w, ks, ke, topk, out=out).cpu()
    # Same scores as the plain op, so exactly its selection.
    logits = ops.indexer_logits(q, k, k_scale, w, ks, ke)
    assert torch.equal(got, ops.topk_indices(logits, ks, ke, topk).cpu())
    # And the reference's on its own (fp32) scores, compared as sets of gathered values.
    expect = ref.indexer_topk(q.cpu(), k.cpu(), None if k_scale is None else k_scale.cpu(), w.cpu(), ks.cpu(), ke.cpu(), topk)
    assert torch.equal((got >= 0).sum(1), (expect >= 0).sum(1))
    lg = logits.cpu()
    for r in range(s_q):
        m = int((got[r] >= 0).sum())
        a = lg[r, int(ks[r]) + got[r, :m].long()]
        b = lg[r, int(ks[r]) + expect[r, :m].long()]
        assert torch.allclose(a.sort().values, b.sort().values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("next_n", [2, 20])  # decode rows, and a prefill chunk scored as 20 rows
def test_indexer_topk_paged(device, cpu_isa, next_n):
    batch, h, bs, blocks, topk = 4, 64, 64, 40, 100
    seq_lens = torch.tensor([3, 101, 500, 640], dtype=torch.int32)
    table = torch.randperm(blocks, dtype=torch.int32)[: batch * 10].reshape(batch, 10)
    cache = torch.zeros(blocks, bs * 132, dtype=torch.uint8)
    for b in range(batch):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        ref.index_k_cache_insert(torch.randn(n, 128), table[b, pos // bs].long() * bs + pos % bs, cache)
    qv, qs = ref.quantize_fp8(torch.randn(batch * next_n, h, 128), ref.INDEX_Q_EPS)
    w = ref.indexer_weights(torch.randn(batch * next_n, h), qs[..., 0])
    args = [t.to(device) for t in (qv, w, cache, table, seq_lens)]
    out = torch.full((batch * next_n + 2, topk), POISON_I, dtype=torch.int32, device=device)
    got = ops.indexer_topk_paged(*args, next_n, topk, out=out).cpu()
    logits = ops.indexer_logits_paged(*args, next_n, 640)
    windows = ref.decode_windows(seq_lens, next_n).clamp(min=0).int()
    zeros = torch.zeros_like(windows)
    assert torch.equal(got, ops.topk_indices(logits, zeros.to(device), windows.to(device), topk).cpu())
    assert (out[batch * next_n:].cpu() == POISON_I).all()
    if next_n == 2:
        assert torch.equal(got[0], torch.tensor([0, 1] + [-1] * (topk - 2), dtype=torch.int32))  # window 2 < k


def test_fused_is_deterministic(device, cpu_isa):
    q, k, k_scale, w = make_indexer_inputs(5, 6000, 64, device, "fp8")
    ks, ke = causal_windows(5, 6000, device)
    runs = [ops.indexer_topk(q, k, k_scale, w, ks, ke, 512).cpu() for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    logits = [ops.indexer_logits(q, k, k_scale, w, ks, ke).cpu() for _ in range(2)]
    assert torch.equal(logits[0], logits[1])


# ------------------------------------------------------------------ sparse MLA

def make_mla(device, cache_kind, s_q, h, topk, blocks=6, bs=64):
    n = blocks * bs
    width = 656 if cache_kind == "fp8" else 576
    dt = {"fp8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}[cache_kind]
    cache = torch.zeros(blocks, bs, width, dtype=dt)
    ref.mla_kv_cache_insert(torch.randn(n, 512), torch.randn(n, 64), torch.arange(n), cache)
    idx = torch.randint(0, n, (s_q, topk), dtype=torch.int32)
    idx[:, ::3] = -1
    return cache.to(device), idx.to(device)


@pytest.mark.parametrize("cache_kind,q_dtype,bar", [("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2),
                                                     ("fp8", torch.bfloat16, 1e-2), ("bf16", torch.float32, 1e-5)])
@pytest.mark.parametrize("s_q,h,topk", [(3, 16, 64), (2, 128, 200), (4, 5, 7), (3, 8, 301)])
def test_sparse_mla(device, cpu_isa, cache_kind, q_dtype, bar, s_q, h, topk):
    cache, idx = make_mla(device, cache_kind, s_q, h, topk)
    idx[1 % s_q] = -1  # a row with no valid slot
    q = torch.randn(s_q, h, 576, device=device).to(q_dtype)
    out = torch.full((s_q, h, 512), POISON_F, dtype=q_dtype, device=device)
    lse = torch.full((s_q, h), POISON_F, device=device)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), scale)
    got, gl = out.cpu().float(), lse.cpu()
    assert torch.isfinite(got).all()
    assert (got[1 % s_q] == 0).all() and torch.isneginf(gl[1 % s_q]).all()
    assert rel_err(got, ro.float()) < bar
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(gl))
    # bf16 paths round fp8-dequantized keys to bf16, so lse carries ~1e-2 absolute error there.
    assert (gl[fin] - rl[fin]).abs().max() < (1e-4 if bar < 1e-2 else 2e-2)


def test_sparse_mla_every_fp8_code(device, cpu_isa):
    """fp8_ds_mla rows holding every finite e4m3 byte (subnormals, both zeros, +-448) under
    power-of-two scales from 2^-12 to 2^4: the kernels' dequantization must be exact, so fp32
    queries meet the fp32 bar (1e-5)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 254 finite codes
    n = 16
    cache = torch.zeros(1, n, 656, dtype=torch.uint8)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for r in range(n):
        cache[0, r, :512] = codes[torch.randint(0, codes.numel(), (512,), generator=g)]
        scales = torch.tensor([2.0 ** int(e) for e in torch.randint(-12, 5, (4,), generator=g)])
        cache[0, r, 512:528] = scales.view(torch.uint8)
        cache[0, r, 528:] = torch.randn(64, generator=g).bfloat16().view(torch.uint8)
    flat = cache.view(-1, 656)
    assert torch.isin(codes, flat[:, :512]).sum() > 200  # most codes present
    q = torch.randn(2, 8, 576) * 1e-4
    idx = torch.randperm(n, dtype=torch.int32).reshape(2, 8)
    out = torch.full((2, 8, 512), POISON_F, device=device)
    lse = torch.full((2, 8), POISON_F, device=device)
    ops.sparse_mla(q.to(device), cache.to(device), idx.to(device), 0.5, out=out, lse=lse)
    ro, rl = ref.sparse_mla(q, cache, idx, 0.5)
    assert rel_err(out.cpu(), ro) < 1e-5
    assert (lse.cpu() - rl).abs().max() < 1e-4


@pytest.mark.parametrize("s_q,h,topk", [(0, 16, 8), (2, 0, 8), (2, 3, 0)])
def test_sparse_mla_empty(device, cpu_isa, s_q, h, topk):
    # No rows, no heads or no selections: nothing to compute (an empty batch once divided by zero
    # on the avx2 path's split count, and zero heads on the others); no selections give zeros and
    # lse -inf. On CUDA: no grid is launched for no rows or no heads, and no selections are rows
    # with no valid slot.
    cache = torch.randn(1, 64, 576).bfloat16().to(device)
    q = torch.randn(s_q, h, 576).bfloat16().to(device)
    out = torch.full((s_q, h, 512), POISON_F, dtype=torch.bfloat16, device=device)
    lse = torch.full((s_q, h), POISON_F, device=device)
    ops.sparse_mla(q, cache, torch.zeros(s_q, topk, dtype=torch.int32, device=device), 0.1, out=out, lse=lse)
    assert (out.cpu() == 0).all() and torch.isneginf(lse.cpu()).all()


def test_sparse_mla_deterministic(device, cpu_isa):
    cache, idx = make_mla(device, "bf16", 3, 32, 128)
    q = torch.randn(3, 32, 576, device=device).bfloat16()
    a = ops.sparse_mla(q, cache, idx, 0.1)
    b = ops.sparse_mla(q, cache, idx, 0.1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
def test_sparse_mla_few_rows_split_keys(device, cpu_isa, cache_kind):
    # One or two query rows with many selections: the key range is split across threads and
    # the partial softmaxes merged; a NaN query head poisons only its own (row, head).
    s_q, h, topk = 2, 16, 1100
    cache, idx = make_mla(device, cache_kind, s_q, h, topk, blocks=20)
    idx[1, 700:] = -1
    q = torch.randn(s_q, h, 576, device=device).bfloat16()
    q[0, 3, 17] = float("nan")
    out = torch.full((s_q, h, 512), POISON_F, dtype=torch.bfloat16, device=device)
    lse = torch.full((s_q, h), POISON_F, device=device)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), scale)
    got, gl = out.cpu().float(), lse.cpu()
    assert got[0, 3].isnan().all() and gl[0, 3].isnan()
    keep = torch.ones(s_q, h, dtype=torch.bool)
    keep[0, 3] = False
    assert torch.isfinite(got[keep]).all() and torch.isfinite(gl[keep]).all()
    assert rel_err(got[keep], ro.float()[keep]) < 1e-2
    assert (gl[keep] - rl[keep]).abs().max() < 2e-2
    again = ops.sparse_mla(q, cache, idx, scale)
    assert torch.equal(again[0].view(torch.int16), out.view(torch.int16)) and torch.equal(again[1].isnan(), lse.isnan())


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h", [8, 21, 70])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_sparse_mla_fp32_heads_splits_threads(cpu_isa, d_qk, h, q_dtype, cache_dtype):
    """fp32 sparse MLA (q or cache fp32) with head counts that fill 8-head panels exactly, leave a
    partial panel, or need two head blocks; one or two rows whose 700 + 90 entries (indices, then
    extra_indices, -1 holes, a row half empty) get split and merged; sinks; one NaN query head.
    Against reference.py at the fp32 bar, and bit-identical on one thread and on two."""
    s_q, n = 2, 1500
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    cache = (torch.randn(n, 1, d_qk, generator=g) * 2).to(cache_dtype)
    idx = torch.randint(0, n, (s_q, 700), generator=g, dtype=torch.int32)
    idx[:, ::5] = -1
    idx[1, 350:] = -1
    extra = torch.randint(0, n, (s_q, 90), generator=g, dtype=torch.int32)
    extra[:, ::7] = -1
    q = torch.randn(s_q, h, d_qk, generator=g).to(q_dtype)
    q[0, h // 2, 3] = float("nan")
    sinks = make_sinks(h, "cpu")
    scale = d_qk ** -0.5
    out = torch.full((s_q, h, 512), POISON_F, dtype=q_dtype)
    lse = torch.full((s_q, h), POISON_F)
    ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse, sinks=sinks, extra_indices=extra)
    ro, rl = ref.sparse_mla(q, cache, idx, scale, sinks=sinks, extra_indices=extra)
    bad = torch.zeros(s_q, h, dtype=torch.bool)
    bad[0, h // 2] = True
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    got = out.float()
    assert torch.isfinite(got[~bad]).all() and torch.isfinite(lse[~bad]).all()
    assert rel_err(got[~bad], ro.float()[~bad]) < (1e-5 if q_dtype == torch.float32 else 1e-2)
    assert (lse[~bad] - rl[~bad]).abs().max() < 1e-4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.sparse_mla(q, cache, idx, scale, sinks=sinks, extra_indices=extra)
        torch.set_num_threads(2)
        two = ops.sparse_mla(q, cache, idx, scale, sinks=sinks, extra_indices=extra)
    finally:
        torch.set_num_threads(threads)
    for a in (one, two):
        assert torch.equal(a[0].view(torch.int16 if q_dtype == torch.bfloat16 else torch.int32),
                           out.view(torch.int16 if q_dtype == torch.bfloat16 else torch.int32))
        assert torch.equal(a[1].view(torch.int32), lse.view(torch.int32))


@pytest.mark.parametrize("h", [8, 16, 40])
def test_sparse_mla_bf16_keeps_probabilities_precise(cpu_isa, h):
    """bf16 q and cache: the output is the fp32 reference rounded to bf16, to within rare one-ulp
    flips (rel 5e-4; measured 2e-5 .. 8e-5), on the paths that keep P in fp32 (docs/ops.md);
    rounding P to bf16 puts ~2.2e-3 on every output (what the avx512bf16 path did before
    issue 31, and what the blas path's brgemm does: its bar is the §8 one). 8 / 16 / 40 heads:
    the quad-lane scores, one 16-head block, two 32-head blocks; -1 holes, an odd key count,
    sinks."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    s_q, n = 3, 900
    cache = torch.randn(n, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, n, (s_q, 301), generator=g, dtype=torch.int32)
    idx[:, ::4] = -1
    q = torch.randn(s_q, h, 576, generator=g).to(torch.bfloat16)
    sinks = make_sinks(h, "cpu")
    out = torch.full((s_q, h, 512), POISON_F, dtype=torch.bfloat16)
    lse = torch.full((s_q, h), POISON_F)
    ops.sparse_mla(q, cache, idx, 576 ** -0.5, out=out, lse=lse, sinks=sinks)
    ro, rl = ref.sparse_mla(q, cache, idx, 576 ** -0.5, sinks=sinks)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    bar = 1e-2 if _C._cpu_isa("sparse_mla", "bf16") == "blas" else 5e-4
    assert rel_err(out.float(), ro.float()) < bar
    assert (lse - rl).abs().max() < 1e-4


# ------------------------------------------------------------------ sparse MLA with attention sinks

def make_sinks(h, device, seed=None):
    """Sinks at the scale of the scores (DSA scale: |s| ~ 3), one far above them (its head's
    output nearly vanishes) and one far below (nearly no sink)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) if seed is None else seed)
    sinks = torch.randn(h, generator=g) * 3
    if h > 2:
        sinks[1], sinks[2] = 40.0, -60.0
    return sinks.to(device)


def test_sparse_mla_sinks_reference_by_hand():
    """reference.py against the formula written out for two keys and one head, and an empty
    row: out = Σ e^(s_i) v_i / (e^sink + Σ e^(s_i)), lse = log(e^sink + Σ e^(s_i)); empty: 0, sink."""
    cache = torch.zeros(1, 4, 576)
    cache[0, :, :] = torch.randn(4, 576)
    q = torch.randn(2, 1, 576)
    idx = torch.tensor([[2, -1, 0], [-1, -1, -1]], dtype=torch.int32)
    sink = torch.tensor([0.7])
    out, lse = ref.sparse_mla(q, cache, idx, 0.05, 512, sinks=sink)
    k = cache[0]
    s = torch.stack([(q[0, 0] * k[2]).sum(), (q[0, 0] * k[0]).sum()]).double() * 0.05
    den = math.exp(0.7) + s.exp().sum().item()
    expect = (s.exp()[0] * k[2, :512].double() + s.exp()[1] * k[0, :512].double()) / den
    assert torch.allclose(out[0, 0].double(), expect, rtol=1e-5, atol=1e-6)
    assert abs(lse[0, 0].item() - math.log(den)) < 1e-5
    assert (out[1] == 0).all() and lse[1, 0].item() == pytest.approx(0.7)
    # d lse / d sink = e^sink / denominator: the reference is differentiable in the sinks.
    sk = sink.clone().requires_grad_(True)
    ref.sparse_mla(q[:1], cache, idx[:1], 0.05, 512, sinks=sk)[1].sum().backward()
    assert sk.grad.item() == pytest.approx(math.exp(0.7) / den, rel=1e-5)


@pytest.mark.parametrize("cache_kind,q_dtype,bar", [("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2),
                                                     ("fp8", torch.bfloat16, 1e-2), ("bf16", torch.float32, 1e-5)])
@pytest.mark.parametrize("s_q,h,topk", [(3, 16, 64), (2, 128, 200), (4, 5, 7)])
def test_sparse_mla_sinks(device, cpu_isa, cache_kind, q_dtype, bar, s_q, h, topk):
    cache, idx = make_mla(device, cache_kind, s_q, h, topk)
    idx[1 % s_q] = -1  # a row with no valid slot: 0, and lse = the sink
    q = torch.randn(s_q, h, 576, device=device).to(q_dtype)
    sinks = make_sinks(h, device)
    out = torch.full((s_q, h, 512), POISON_F, dtype=q_dtype, device=device)
    lse = torch.full((s_q, h), POISON_F, device=device)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse, sinks=sinks)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), scale, sinks=sinks.cpu())
    got, gl = out.cpu().float(), lse.cpu()
    assert torch.isfinite(got).all() and torch.isfinite(gl).all()
    assert (got[1 % s_q] == 0).all() and torch.equal(gl[1 % s_q], sinks.cpu())
    assert rel_err(got, ro.float()) < bar
    assert (gl - rl).abs().max() < (1e-4 if bar < 1e-2 else 2e-2)
    # The sinks matter: without them the result is well outside the bar.
    plain = ops.sparse_mla(q, cache, idx, scale)[0].cpu().float()
    assert rel_err(plain, ro.float()) > 3 * bar
    again = ops.sparse_mla(q, cache, idx, scale, sinks=sinks)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


@pytest.mark.parametrize("cache_kind,q_dtype", [("bf16", torch.bfloat16), ("fp8", torch.bfloat16),
                                                ("fp32", torch.float32)])
@pytest.mark.parametrize("s_q,topk", [(3, 64), (2, 1100)])
def test_sparse_mla_minus_inf_sinks_are_no_sinks(device, cpu_isa, cache_kind, q_dtype, s_q, topk):
    """-inf sinks give the sink-free result to the bit on every path (the 2 x 1100 shape takes
    the key-split + merge paths on CPU), and so do the sinks of rows with no valid slot."""
    h = 20
    cache, idx = make_mla(device, cache_kind, s_q, h, topk, blocks=20)
    idx[1, topk // 2:] = -1
    q = torch.randn(s_q, h, 576, device=device).to(q_dtype)
    plain = ops.sparse_mla(q, cache, idx, 0.1)
    minus = ops.sparse_mla(q, cache, idx, 0.1, sinks=torch.full((h,), -math.inf, device=device))
    assert torch.equal(plain[0], minus[0]) and torch.equal(plain[1], minus[1])


@pytest.mark.parametrize("cache_kind,q_dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
@pytest.mark.parametrize("topk", [17, 1100])
def test_sparse_mla_huge_sink_takes_all_the_mass(device, cpu_isa, cache_kind, q_dtype, topk):
    """A sink far above every score (1e30) leaves each key exp(score - sink) = 0 in fp32: out is 0
    exactly and lse the sink, as the reference gives, on every path. The vector exp used to clamp
    at e^-87 (~1.6e-38), which left outputs ~1e-33 (hypothesis found it in test_fuzz)."""
    s_q, h = 2, 5
    cache, idx = make_mla(device, cache_kind, s_q, h, topk, blocks=20)
    q = torch.randn(s_q, h, 576, device=device).to(q_dtype)
    sinks = torch.tensor([1e30, 0.3, 1e30, -0.5, 1e30], device=device)
    out = torch.full((s_q, h, 512), POISON_F, dtype=q_dtype, device=device)
    lse = torch.full((s_q, h), POISON_F, device=device)
    ops.sparse_mla(q, cache, idx, 0.1, out=out, lse=lse, sinks=sinks)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), 0.1, sinks=sinks.cpu())
    huge = sinks.cpu() > 1e29
    got = out.cpu().float()
    assert (ro[:, huge] == 0).all() and (got[:, huge] == 0).all()
    assert torch.equal(lse.cpu()[:, huge], sinks.cpu()[huge].expand(s_q, -1))
    bar = 1e-5 if q_dtype == torch.float32 else 1e-2
    assert rel_err(got[:, ~huge], ro[:, ~huge].float()) < bar


@pytest.mark.parametrize("cache_kind", ["bf16", "fp8"])
def test_sparse_mla_sinks_few_rows_split_keys(device, cpu_isa, cache_kind):
    # The key-split paths merge partial softmaxes; the sink must join once, in the merge.
    s_q, h, topk = 2, 16, 1100
    cache, idx = make_mla(device, cache_kind, s_q, h, topk, blocks=20)
    idx[1, 700:] = -1
    q = torch.randn(s_q, h, 576, device=device).bfloat16()
    sinks = make_sinks(h, device)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    out, lse = ops.sparse_mla(q, cache, idx, scale, sinks=sinks)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), scale, sinks=sinks.cpu())
    assert torch.isfinite(out.float()).all()
    assert rel_err(out.cpu().float(), ro.float()) < 1e-2
    assert (lse.cpu() - rl).abs().max() < 2e-2


@pytest.mark.parametrize("cache_kind,q_dtype", [("bf16", torch.bfloat16), ("fp8", torch.bfloat16),
                                                ("fp32", torch.float32), ("bf16", torch.float32)])
@pytest.mark.parametrize("topk", [40, 1100])
def test_sparse_mla_nonfinite_sinks(device, cpu_isa, cache_kind, q_dtype, topk):
    """docs/ops.md's rows for sinks: NaN or +inf -> out and lse NaN on the head's rows with a
    valid slot; -inf -> as without a sink; rows with no valid slot -> out 0, lse = the sink
    (NaN, +inf or -inf). Other heads keep their finite results."""
    s_q, h = 3, 6
    cache, idx = make_mla(device, cache_kind, s_q, h, topk, blocks=20)
    idx[2] = -1
    q = torch.randn(s_q, h, 576, device=device).to(q_dtype)
    sinks = torch.tensor([0.5, math.nan, math.inf, -math.inf, -1.0, -math.nan], device=device)
    out = torch.full((s_q, h, 512), POISON_F, dtype=q_dtype, device=device)
    lse = torch.full((s_q, h), 1234.5, device=device)
    ops.sparse_mla(q, cache, idx, 0.1, out=out, lse=lse, sinks=sinks)
    ro, rl = ref.sparse_mla(q.cpu(), cache.cpu(), idx.cpu(), 0.1, sinks=sinks.cpu())
    got, gl = out.cpu().float(), lse.cpu()
    bad = torch.tensor([False, True, True, False, False, True])
    for r in (0, 1):
        assert torch.equal(torch.isnan(gl[r]), bad) and torch.equal(torch.isnan(rl[r]), bad)
        assert torch.isnan(got[r][bad]).all() and torch.isfinite(got[r][~bad]).all()
        assert torch.isnan(ro[r][bad].float()).all()
    assert (got[2] == 0).all() and (ro[2] == 0).all()
    for g in (gl[2], rl[2]):
        assert g[0] == 0.5 and g[4] == -1.0 and g[1].isnan() and g[5].isnan()
        assert g[2] == math.inf and g[3] == -math.inf
    keep = ~bad
    bar = 1e-5 if q_dtype == torch.float32 else 1e-2
    assert rel_err(got[:2][:, keep], ro[:2][:, keep].float()) < bar
    plain_o, plain_l = ops.sparse_mla(q, cache, idx, 0.1)
    assert torch.equal(out[:, 3], plain_o[:, 3]) and torch.equal(lse[:, 3], plain_l[:, 3])  # -inf sink: no sink


def test_sparse_mla_sinks_errors(device):
    """A bad sinks argument: the op's own message (csrc/checks.h), through the wrapper as through
    torch.ops, and nothing written."""
    mcache, idx = make_mla(device, "bf16", 2, 4, 8, blocks=1)
    qm = torch.randn(2, 4, 576, device=device).bfloat16()
    out = torch.full((2, 4, 512), POISON_F, dtype=torch.bfloat16, device=device)
    lse = torch.full((2, 4), POISON_F, device=device)
    bad = [
        (torch.zeros(4, dtype=torch.float64, device=device), "sinks must be Float"),
        (torch.zeros(4, dtype=torch.bfloat16, device=device), "sinks must be Float"),
        (torch.zeros(5, device=device), r"sinks must be \[h_q\] = \[4\]"),
        (torch.zeros(1, 4, device=device), "sinks must have 1 dims"),
        (torch.zeros(8, device=device)[::2], "sinks must be contiguous"),
    ]
    if device == "cpu" and torch.cuda.is_available():
        bad.append((torch.zeros(4, device="cuda"), "sinks and q must be on one device"))
    for sinks, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            ops.sparse_mla(qm, mcache, idx, 0.1, sinks=sinks, out=out, lse=lse)
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.indexcache.sparse_mla(qm, mcache, idx, 0.1, 512, out, lse, sinks)
        assert out.isnan().all() and lse.isnan().all()  # nothing written
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'Optional\[Tensor\]' for argument 'sinks'"):
        ops.sparse_mla(qm, mcache, idx, 0.1, sinks=[0.0] * 4)


def test_indexer_topk_paged_long_split(device, cpu_isa):
    # One decode row over a long request: the fused op splits its keys across threads and must
    # still select exactly what the plain op's logits give.
    h, bs, n, topk = 16, 64, 9000, 512
    blocks = (n + bs - 1) // bs
    table = torch.randperm(blocks, dtype=torch.int32).reshape(1, blocks)
    cache = torch.zeros(blocks, bs * 132, dtype=torch.uint8)
    pos = torch.arange(n)
    ref.index_k_cache_insert(torch.randn(n, 128), table[0, pos // bs].long() * bs + pos % bs, cache)
    qv, qs = ref.quantize_fp8(torch.randn(1, h, 128), ref.INDEX_Q_EPS)
    w = ref.indexer_weights(torch.randn(1, h), qs[..., 0])
    seq_lens = torch.tensor([n], dtype=torch.int32)
    args = [t.to(device) for t in (qv, w, cache, table, seq_lens)]
    got = ops.indexer_topk_paged(*args, 1, topk).cpu()
    logits = ops.indexer_logits_paged(*args, 1, n)
    zeros = torch.zeros(1, dtype=torch.int32, device=device)
    assert torch.equal(got, ops.topk_indices(logits, zeros, torch.full_like(zeros, n), topk).cpu())
    expect = ref.indexer_logits_paged(qv, w, cache, table, seq_lens, 1, n)
    assert torch.equal(torch.isinf(logits.cpu()), torch.isinf(expect))
    fin = torch.isfinite(expect)
    assert rel_err(logits.cpu()[fin], expect[fin]) < 1e-5


# ------------------------------------------------------------------ bad input

def test_errors(device):
    q, k, k_scale, w = make_indexer_inputs(4, 50, 8, device, "fp8")
    ks, ke = causal_windows(4, 50, device)
    with pytest.raises(RuntimeError, match="fp8 k needs k_scale"):
        ops.indexer_logits(q, k, None, w, ks, ke)
    with pytest.raises(RuntimeError, match="k must have q's dtype"):
        ops.indexer_logits(q, k.float(), k_scale, w, ks, ke)
    with pytest.raises(RuntimeError, match="weights must be"):
        ops.indexer_logits(q, k, k_scale, w[:, :3].contiguous(), ks, ke)
    with pytest.raises(RuntimeError, match="outside"):
        ops.indexer_logits(q, k, k_scale, w, ks, ke + 100)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.indexer_logits(q.transpose(0, 1), k, k_scale, w, ks, ke)
    with pytest.raises(RuntimeError, match="exceed the topk buffer's 2 rows"):
        ops.indexer_topk(q, k, k_scale, w, ks, ke, 8, out=torch.empty(2, 8, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="exceeds the topk buffer's width 8"):
        ops.indexer_topk(q, k, k_scale, w, ks, ke, 9, out=torch.empty(4, 8, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="topk must be >= 1"):
        ops.topk_indices(torch.zeros(4, 50, device=device), ks, ke, 0)
    with pytest.raises(RuntimeError, match="logits must be Float"):
        ops.topk_indices(torch.zeros(4, 50, device=device, dtype=torch.float64), ks, ke, 4)
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="slot_mapping holds slot 128 but the cache has 128 slots"):
        ops.index_k_cache_insert(torch.randn(1, 128, device=device), torch.tensor([128], device=device), cache)
    with pytest.raises(RuntimeError, match="slot_mapping must be Long"):
        ops.index_k_cache_insert(torch.randn(1, 128, device=device), torch.tensor([1], dtype=torch.int32, device=device), cache)
    with pytest.raises(RuntimeError, match="rows must hold block_size"):
        ops.index_k_cache_insert(torch.randn(1, 128, device=device), torch.tensor([1], device=device), torch.zeros(2, 100, dtype=torch.uint8, device=device))
    with pytest.raises(RuntimeError, match="last dim must be a multiple of 128"):
        ops.quantize_fp8(torch.randn(3, 100, device=device), 1e-4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.quantize_fp8(torch.randn(3, 128, device=device).half(), 1e-4)
    # Paged: a block id outside the cache, a sequence longer than its table.
    qv = q[:2].contiguous()
    with pytest.raises(RuntimeError, match="outside the cache's 2 blocks"):
        ops.indexer_logits_paged(qv, w[:2].contiguous(), cache, torch.tensor([[0, 5]], dtype=torch.int32, device=device),
                                 torch.tensor([100], dtype=torch.int32, device=device), 2, 100)
    with pytest.raises(RuntimeError, match="needs 3 blocks but block_table has 2 columns"):
        ops.indexer_topk_paged(qv, w[:2].contiguous(), cache, torch.tensor([[0, 1]], dtype=torch.int32, device=device),
                               torch.tensor([129], dtype=torch.int32, device=device), 2, 8)
    with pytest.raises(RuntimeError, match="expected batch \\* next_n"):
        ops.indexer_topk_paged(qv, w[:2].contiguous(), cache, torch.tensor([[0, 1]], dtype=torch.int32, device=device),
                               torch.tensor([10], dtype=torch.int32, device=device), 1, 8)
    # Slots.
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="needs block 2 but the block table has 2 columns"):
        ops.positions_to_slots(torch.tensor([[130]], dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device), table, 64, 2)
    with pytest.raises(RuntimeError, match="outside the block table's 1 requests"):
        ops.positions_to_slots(torch.tensor([[1]], dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device), table, 64, 2)
    with pytest.raises(RuntimeError, match="outside the cache's 1 blocks"):
        ops.positions_to_slots(torch.tensor([[70]], dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device), table, 64, 1)
    # Sparse MLA.
    mcache, idx = make_mla(device, "bf16", 2, 4, 8, blocks=1)
    qm = torch.randn(2, 4, 576, device=device).bfloat16()
    with pytest.raises(RuntimeError, match="indices holds slot 64 but the cache has 64 slots"):
        ops.sparse_mla(qm, mcache, torch.full((2, 8), 64, dtype=torch.int32, device=device), 0.1)
    with pytest.raises(RuntimeError, match="indices holds -2"):
        ops.sparse_mla(qm, mcache, torch.full((2, 8), -2, dtype=torch.int32, device=device), 0.1)
    with pytest.raises(RuntimeError, match="rows of d_qk = 512 values"):  # V4's width on a DSA cache
        ops.sparse_mla(qm[..., :512].contiguous(), mcache, idx, 0.1)
    with pytest.raises(RuntimeError, match="absorbed DSA"):
        torch.ops.indexcache.sparse_mla(qm[..., :320].contiguous(), mcache, idx, 0.1, 512,
                                        torch.empty(2, 4, 512, dtype=torch.bfloat16, device=device),
                                        torch.empty(2, 4, device=device))
    with pytest.raises(RuntimeError, match="rows of 656 bytes"):
        ops.sparse_mla(qm, torch.zeros(1, 64, 600, dtype=torch.uint8, device=device), idx, 0.1)
    with pytest.raises(RuntimeError, match="sm_scale must be a positive"):
        ops.sparse_mla(qm, mcache, idx, float("nan"))
    x = torch.randn(2, 128, device=device)
    for eps in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="eps must be finite and > 0"):
            ops.quantize_fp8(x, eps)


def test_empty_views_with_odd_strides(device):
    # Nothing can be read through a 0-row or one-column view, whatever its strides: accepted.
    ks = ke = torch.zeros(0, dtype=torch.int32, device=device)
    logits = torch.empty(0, 7, device=device).as_strided((0, 7), (1, 0))
    out = torch.full((0, 4), -5, dtype=torch.int32, device=device).as_strided((0, 4), (1, 3))
    assert ops.topk_indices(logits, ks, ke, 4, out=out).shape == (0, 4)
    col = torch.randn(3, 5, device=device)[:, 2:3].as_strided((3, 1), (5, 9))
    ks1, ke1 = torch.zeros(3, dtype=torch.int32, device=device), torch.ones(3, dtype=torch.int32, device=device)
    got = ops.topk_indices(col, ks1, ke1, 1)
    assert got.tolist() == [[0]] * 3
    with pytest.raises(RuntimeError, match="logits rows must be contiguous"):
        ops.topk_indices(torch.randn(5, 3, device=device).t(), ks1, ke1 + 1, 1)


def _cpuinfo_flags():
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return None
    return set(line.split(":", 1)[1].split()) if line else None


def test_cpu_features_match_cpuinfo():
    flags = _cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags line on this machine")
    f = _C._cpu_features()
    assert f["avx2_fma"] == ({"avx2", "fma", "f16c"} <= flags)
    assert f["avx512"] == ({"avx512f", "avx512bw"} <= flags)
    assert f["avx512bf16"] == ({"avx512f", "avx512bw", "avx512_bf16"} <= flags)
    paths = _C._cpu_paths()
    assert (paths["avx512bf16"] == "") == f["avx512bf16"]
    assert (paths["blas"] == "") == f["brgemm_bf16"]
    if not f["avx512"] and "amx_bf16" not in flags:
        # torch's bf16 brgemm needs a oneDNN ukernel: AVX-512 or AMX (DESIGN.md §9, AVX2-only CPUs)
        assert paths["blas"] and "brgemm" in paths["blas"]
    assert paths["portable"] == ""


def test_cpu_path_errors():
    with pytest.raises(ValueError, match="unknown CPU path 'avx9000'.*'portable'"):
        _C._set_cpu_isa("avx9000")
    before = _C._cpu_isa()
    for name, why in _C._cpu_paths().items():
        if why:
            with pytest.raises(ValueError, match=f"CPU path '{name}' cannot run here"):
                _C._set_cpu_isa(name)
            assert _C._cpu_isa() == before  # a refused request changes nothing
        else:
            _C._set_cpu_isa(name)
            assert _C._cpu_isa() == name
            _C._set_cpu_isa("auto")
    assert _C._cpu_isa() == before
    assert _C._cpu_paths()[_C._cpu_isa()] == ""  # auto never picks a path the CPU lacks


# The (op, dtype) pairs each path has a vectorised kernel of its own for (docs/ops.md, "CPU paths"),
# written out here as the spec that isa.cpp's table must match.
_ALL = {"indexer/fp32", "indexer/bf16", "indexer/fp8", "topk/fp32", "sparse_mla/fp32", "sparse_mla/bf16",
        "sparse_mla/fp8", "block_topk/fp32", "block_topk/bf16", "block_sparse_attention/fp32",
        "block_sparse_attention/bf16", "quantize/fp32", "quantize/bf16",
        "delta_rule/fp32", "delta_rule/bf16", "rows_matmul/fp32", "rows_matmul/bf16", "norm_rope/fp32", "norm_rope/bf16",
        "kpool_pool/fp32", "kpool_pool/bf16"}
_NO_AVX2 = {"norm_rope/fp32", "norm_rope/bf16", "kpool_pool/fp32", "kpool_pool/bf16"}
KERNELS = {"portable": _ALL, "avx2": _ALL - _NO_AVX2,
           "avx512bf16": _ALL,
           "blas": {"indexer/bf16", "indexer/fp8", "sparse_mla/bf16", "sparse_mla/fp8"}
           # bf16 block_sparse_attention on the AMX tiles (block_sparse_amx.cpp), where the CPU has them
           | ({"block_sparse_attention/bf16"} if _C._cpu_features()["amx_bf16"] and _C._cpu_features()["avx512bf16"] else set())}
FALLBACK = ["blas", "avx512bf16", "avx2", "portable"]


def _expected_dispatch(requested):
    """Each (op, dtype) on the first path from `requested` on, in FALLBACK order, that this CPU
    runs and that has a kernel for it."""
    runs = [p for p in FALLBACK[FALLBACK.index(requested):] if not _C._cpu_paths()[p]]
    return {key: next(p for p in runs if key in KERNELS[p]) for key in sorted(_ALL)}


def test_cpu_dispatch_per_op_and_dtype():
    assert {p: set(v) for p, v in _C._cpu_kernels().items()} == KERNELS
    auto = _C._cpu_isa()
    for name in ["auto", *[p for p, why in _C._cpu_paths().items() if not why]]:
        _C._set_cpu_isa(name)
        try:
            got = _C._cpu_dispatch()
            assert got == _expected_dispatch(auto if name == "auto" else name), name
            for key, path in got.items():
                op, dt = key.split("/")
                assert _C._cpu_isa(op, dt) == path
        finally:
            _C._set_cpu_isa("auto")
    got = _C._cpu_dispatch()
    if not _C._cpu_paths()["avx2"]:
        # no silent scalar loops: with AVX2 present, 'auto' runs no (op, dtype) on portable but
        # norm_rope and kpool_pool (no AVX2 kernels of their own: torch's norms and rotations
        # beyond a few rows, norms.fused_rows), and fp32 sparse MLA never on portable: its
        # own AVX-512 kernels where the CPU has AVX-512 BF16, else avx2's
        assert {k for k, p in got.items() if p == "portable"} <= _NO_AVX2
        assert got["sparse_mla/fp32"] == ("avx2" if _C._cpu_paths()["avx512bf16"] else "avx512bf16")
    assert _C._cpu_isa("sparse_mla") == got["sparse_mla/bf16"] and _C._cpu_isa("topk") == got["topk/fp32"]
    with pytest.raises(ValueError, match="CPU op 'topk' takes no dtype 'bf16'"):
        _C._cpu_isa("topk", "bf16")
    with pytest.raises(ValueError, match="unknown CPU op 'mla': choose one of indexer, topk, sparse_mla"):
        _C._cpu_isa("mla", "bf16")


@pytest.mark.parametrize("q_dtype,cache_kind", [(torch.float32, "fp32"), (torch.float32, "bf16"),
                                                (torch.bfloat16, "bf16"), (torch.bfloat16, "fp8")])
@pytest.mark.parametrize("heads", [8, 32])
def test_sparse_mla_runs_the_path_dispatch_names(q_dtype, cache_kind, heads):
    """The op really takes the path _cpu_isa reports, at either head count: 'auto' is bit-identical
    to that path forced (each path's kernels sum in their own order, so another path would almost
    surely differ in the last bits)."""
    dt = "fp32" if q_dtype == torch.float32 or cache_kind == "fp32" else cache_kind
    path = _C._cpu_isa("sparse_mla", dt)
    cache, idx = make_mla("cpu", cache_kind, 3, heads, 256)
    q = torch.randn(3, heads, 576).to(q_dtype)
    scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
    want = ops.sparse_mla(q, cache, idx, scale)
    _C._set_cpu_isa(path)
    try:
        got = ops.sparse_mla(q, cache, idx, scale)
    finally:
        _C._set_cpu_isa("auto")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ro, _ = ref.sparse_mla(q, cache, idx, scale)
    assert rel_err(want[0], ro.to(want[0].dtype)) < (1e-5 if q_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", [8, 32])
def test_indexer_runs_the_path_dispatch_names(dtype, heads):
    """As above for the indexer: 'auto' scores bit-identically to the path _cpu_isa names, forced,
    at either head count; and those scores are the reference's."""
    path = _C._cpu_isa("indexer", dtype)
    q, k, k_scale, w = make_indexer_inputs(12, 300, heads, "cpu", dtype)
    ks, ke = causal_windows(12, 300, "cpu")
    want = ops.indexer_logits(q, k, k_scale, w, ks, ke)
    _C._set_cpu_isa(path)
    try:
        got = ops.indexer_logits(q, k, k_scale, w, ks, ke)
    finally:
        _C._set_cpu_isa("auto")
    assert torch.equal(got, want)
    scores = ref.indexer_logits(q, k, k_scale, w, ks, ke)
    live = torch.isfinite(scores)
    assert torch.equal(live, torch.isfinite(want)) and rel_err(want[live], scores[live]) < 1e-5


@pytest.mark.parametrize("next_n", [1, 2, 8])
@pytest.mark.parametrize("heads", [1, 8, 32])
def test_paged_indexer_thin_calls_run_the_path_dispatch_names(next_n, heads):
    """A decode call holds next_n rows per request, its GEMM thinner than a prefill block's; it still
    runs the path _cpu_isa("indexer", "fp8") names, at any heads or rows ('auto' bit-identical to that
    path forced, and to the reference's scores). (Until 2026-12-06 'auto' sent calls under 16 rows x
    heads from blas to avx512bf16; docs/ops.md, "Thin calls".)"""
    path = _C._cpu_isa("indexer", "fp8")
    batch, bs = 2, 64
    seq_lens = torch.tensor([700, 1300], dtype=torch.int32)
    table = torch.randperm(48, dtype=torch.int32)[:42].reshape(batch, 21)
    cache = torch.zeros(48, bs * 132, dtype=torch.uint8)
    for b in range(batch):
        pos = torch.arange(int(seq_lens[b]))
        ref.index_k_cache_insert(torch.randn(len(pos), 128), table[b, pos // bs].long() * bs + pos % bs, cache)
    qv, qs = ref.quantize_fp8(torch.randn(batch * next_n, heads, 128), ref.INDEX_Q_EPS)
    w = ref.indexer_weights(torch.randn(batch * next_n, heads), qs[..., 0])
    args = (qv, w, cache, table, seq_lens, next_n)
    want = ops.indexer_logits_paged(*args, 1300)
    want_k = ops.indexer_topk_paged(*args, 256)
    _C._set_cpu_isa(path)
    try:
        got = ops.indexer_logits_paged(*args, 1300)
        got_k = ops.indexer_topk_paged(*args, 256)
    finally:
        _C._set_cpu_isa("auto")
    assert torch.equal(got, want) and torch.equal(got_k, want_k)
    scores = ref.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, 1300)
    live = torch.isfinite(scores)
    assert torch.equal(live, torch.isfinite(want)) and rel_err(want[live], scores[live]) < 1e-5


# ------------------------------------------------------------------ registration

def test_every_op_has_a_kernel_per_backend():
    """Every schema of csrc/torch_bindings.cpp has its CPU kernel (cuda_error_word is CUDA only)
    and, in a build with the CUDA kernels, its CUDA kernel (rows_matmul, swiglu_rows, moe_rows, rms_norm and rope
    are CPU only: the decode rows of a CPU step): the one registration block per backend (csrc/{cpu,cuda}/registration.*)
    misses none."""
    import indexcache

    names = sorted({str(op).split("::")[1].split(".")[0] for op in torch._C._dispatch_get_all_op_names()
                    if str(op).startswith("indexcache::")})
    assert {"sparse_mla", "indexer_topk", "topk_indices", "quantize_fp8", "fill_topk_buffer_"} <= set(names)
    assert {"block_topk", "block_topk_paged", "block_sparse_attention"} <= set(names)  # MiniMax-M3 (issue 20)
    assert "delta_rule" in names  # GLM-5.3-Flash / Qwen3.8-Flash-Next linear attention (issue 34)
    cuda = indexcache.build_info()["cuda_kernels"]
    for name in names:
        dump = torch._C._dispatch_dump(f"indexcache::{name}")
        if name != "cuda_error_word":
            assert "\nCPU: registered" in dump, f"{name} has no CPU kernel"
        if cuda and name not in ("rows_matmul", "swiglu_rows", "moe_rows", "rms_norm", "rope"):
            assert "\nCUDA: registered" in dump, f"{name} has no CUDA kernel"


def test_opcheck_all_ops():
    q, k, k_scale, w = make_indexer_inputs(3, 40, 8, "cpu", "bf16")
    ks, ke = causal_windows(3, 40, "cpu")
    qf, kf, ksf, wf = make_indexer_inputs(3, 40, 8, "cpu", "fp8")
    o = torch.ops.indexcache
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    mcache, idx = make_mla("cpu", "bf16", 2, 4, 8, blocks=1)
    cases = [
        (o.quantize_fp8.default, (torch.randn(2, 128), 1e-4, False)),
        (o.index_k_cache_insert.default, (torch.randn(3, 128), torch.tensor([0, 5, -1]), cache, False)),
        (o.indexer_logits.default, (q, k, k_scale, w, ks, ke, torch.empty(3, 40))),
        (o.indexer_logits.default, (qf, kf, ksf, wf, ks, ke, torch.empty(3, 40))),
        (o.topk_indices.default, (torch.randn(3, 40), ks, ke, 4, torch.empty(3, 4, dtype=torch.int32))),
        (o.indexer_topk.default, (qf, kf, ksf, wf, ks, ke, 4, torch.empty(5, 6, dtype=torch.int32))),
        (o.indexer_logits_paged.default, (qf[:2].contiguous(), wf[:2].contiguous(), cache,
                                          torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([70], dtype=torch.int32), 2, torch.empty(2, 70))),
        (o.indexer_topk_paged.default, (qf[:2].contiguous(), wf[:2].contiguous(), cache,
                                        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([70], dtype=torch.int32), 2, 8,
                                        torch.empty(2, 8, dtype=torch.int32))),
        (o.positions_to_slots.default, (torch.tensor([[1, -1]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                        torch.tensor([[1]], dtype=torch.int32), 64, 2, torch.empty(1, 2, dtype=torch.int32))),
        (o.mla_kv_cache_insert.default, (torch.randn(2, 512), torch.randn(2, 64), torch.tensor([0, 3]), mcache.clone())),
        (o.sparse_mla.default, (torch.randn(2, 4, 576).bfloat16(), mcache, idx, 0.1, 512,
                                torch.empty(2, 4, 512, dtype=torch.bfloat16), torch.empty(2, 4))),
        (o.sparse_mla.default, (torch.randn(2, 4, 576).bfloat16(), mcache, idx, 0.1, 512,
                                torch.empty(2, 4, 512, dtype=torch.bfloat16), torch.empty(2, 4), torch.randn(4))),
        (o.rows_matmul.default, (torch.randn(2, 8).bfloat16(), torch.randn(5, 8), True, torch.empty(2, 5))),
        (o.rows_matmul.default, (torch.randn(3, 2, 8), torch.randn(3, 8, 4).bfloat16(), False,
                                 torch.empty(3, 2, 4, dtype=torch.bfloat16))),
        (o.swiglu_rows.default, (torch.randn(2, 8).bfloat16(), [torch.randn(6, 8).bfloat16(), torch.randn(3, 8)],
                                 [torch.randn(6, 8).bfloat16(), torch.randn(3, 8)],
                                 [torch.randn(8, 6).bfloat16(), torch.randn(8, 3)], [0.5, -1.0], torch.empty(2, 8))),
        (o.moe_rows.default, (torch.randn(2, 8).bfloat16(), [torch.randn(6, 8).bfloat16(), torch.randn(3, 8)],
                              [torch.randn(6, 8).bfloat16(), torch.randn(3, 8)],
                              [torch.randn(8, 6).bfloat16(), torch.randn(8, 3)], torch.tensor([[1, 0], [0, 1]]),
                              torch.rand(2, 2), 0, 2, 1, torch.empty(2, 8))),
    ]
    for op, args in cases:
        has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
        # opcheck's schema checker cannot compare float8 tensors (no mul kernel for them on
        # CPU), so ops that take or return fp8 skip that one sub-test.
        utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
        if not has_fp8 and op is not o.quantize_fp8.default:
            utils = utils + ("test_schema",)
        torch.library.opcheck(op, args, test_utils=utils)


def test_torch_compile_attention_step():
    """A small decode attention step built from the ops compiles with fullgraph=True."""
    cache, _ = make_mla("cpu", "bf16", 1, 4, 8, blocks=2)
    logits_q, kf, ksf, wf = make_indexer_inputs(2, 128, 8, "cpu", "fp8")
    table = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    ks = torch.zeros(2, dtype=torch.int32)
    ke = torch.tensor([100, 128], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    buf = torch.empty(4, 16, dtype=torch.int32)

    def step(q_idx, k_idx, k_scale, w, q_mla, buf):
        ops.fill_topk_buffer_(buf, 2)
        pos = ops.indexer_topk(q_idx, k_idx, k_scale, w, ks, ke, 16, out=buf)
        slots = ops.positions_to_slots(pos, req, table, 64, 2)
        return ops.sparse_mla(q_mla, cache, slots, 0.1)

    q_mla = torch.randn(2, 4, 576).bfloat16()
    eager = step(logits_q, kf, ksf, wf, q_mla, buf.clone())
    compiled = torch.compile(step, fullgraph=True)(logits_q, kf, ksf, wf, q_mla, buf.clone())
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_torch_compile_sparse_mla_sinks():
    """sparse_mla with sinks (the wrapper's checks included) compiles with fullgraph=True."""
    cache, idx = make_mla("cpu", "bf16", 2, 4, 8, blocks=1)
    sinks = torch.randn(4)

    def attend(q, sinks):
        return ops.sparse_mla(q, cache, idx, 0.1, sinks=sinks)

    q = torch.randn(2, 4, 576).bfloat16()
    eager = attend(q, sinks)
    compiled = torch.compile(attend, fullgraph=True)(q, sinks)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_ops_visible_in_profiler():
    x = torch.randn(4, 128)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.quantize_fp8(x, 1e-4)
    assert any("indexcache::quantize_fp8" in e.name for e in prof.events())


@pytest.mark.parametrize("kind", ["ties", "adversarial_sample", "specials", "mostly_nan"])
def test_topk_long_rows_sampled_path(device, cpu_isa, kind):
    """Long rows take a sampled-floor fast path on CPU (an AVX-512 or AVX2 filter pass); ties and
    a sample that misleads the floor (so fewer than k survive and the full select runs) must
    still be exact."""
    n, topk = 50000, 1024
    if kind == "ties":
        logits = torch.randint(-3, 4, (2, n)).float()
    else:
        logits = torch.rand(2, n)
        logits += 10.0 * (torch.arange(n) % ((n - 16) // 31) < 16).float()  # exactly the sampled runs are large
    if kind in ("specials", "mostly_nan"):
        # NaN (any sign) ranks above +inf, -0 equals +0 (ties to the lower position), -inf last:
        # the filters' key transform and floor compare must agree with order_key.
        logits = torch.randn(2, n)
        pick = torch.rand(2, n)
        nan_share = 0.01 if kind == "specials" else 0.4
        logits[pick < nan_share] = float("nan")
        logits[(pick >= nan_share) & (pick < nan_share + 0.01)] = -float("nan")
        logits[(pick > 0.5) & (pick < 0.52)] = 0.0
        logits[(pick > 0.52) & (pick < 0.54)] = -0.0
        logits[(pick > 0.54) & (pick < 0.55)] = float("inf")
        logits[(pick > 0.55) & (pick < 0.56)] = -float("inf")
        if kind == "specials":
            logits[1] = logits[1].abs().neg() * 1e-3  # negatives, -0, -inf and sign-bit NaNs only
    logits = logits.to(device)
    ks = torch.zeros(2, dtype=torch.int32, device=device)
    ke = torch.full((2,), n, dtype=torch.int32, device=device)
    got = ops.topk_indices(logits, ks, ke, topk).cpu()
    assert torch.equal(got, ref.topk_indices(logits.cpu(), ks.cpu(), ke.cpu(), topk))


def test_fp8_rounding_ties_and_subnormals(device, cpu_isa):
    """Every e4m3 value, every midpoint between neighbours (ties to even) and points just
    beside them, with scale 1 (amax 448), match torch's own rounding bit for bit."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2
    vals = torch.cat([codes, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1)])
    vals = torch.cat([vals, -vals])
    pad = (-vals.numel()) % 128
    vals = torch.cat([vals, torch.full((pad,), 448.0)]).reshape(-1, 128)
    vals[:, 0] = 448.0  # every group's amax is 448, so the scale is exactly 1
    v, s = ops.quantize_fp8(vals.to(device), 1e-4)
    assert (s.cpu() == 1).all()
    assert torch.equal(v.cpu().view(torch.uint8), vals.to(torch.float8_e4m3fn).view(torch.uint8))
