"""Edge cases of the CPU indexer's tiling (32-key tiles; the avx2 path's 6- and 4-head register
blocks over 16-key halves, 8-channel transposes; the AVX-512 path's 8-head blocks), on every CPU
path against reference.py: head counts that are no multiple of a block, key counts that are no
multiple of a tile or of 8, one query row, causal tails that end inside a tile, widths whose
channels are no multiple of 8, and results independent of the thread count. Fresh random inputs,
poisoned outputs."""

import pytest
import torch

from indexcache import ops
from indexcache import reference as ref
from test_indexer_widths import inputs

POISON_I = -7777


def causal_tails(s_q, s_kv):
    """Row t sees keys [0, s_kv - s_q + t + 1): every row's window ends at another key lane."""
    ke = torch.arange(s_kv - s_q + 1, s_kv + 1, dtype=torch.int32).clamp(min=1)
    return torch.zeros(s_q, dtype=torch.int32), ke


def check_logits(q, k, ksc, w, ks, ke):
    s_q, s_kv = q.shape[0], k.shape[0]
    out = torch.full((s_q, s_kv), float("nan"))
    ops.indexer_logits(q, k, ksc, w, ks, ke, out=out)
    expect = ref.indexer_logits(q, k, ksc, w, ks, ke)
    assert torch.equal(torch.isneginf(out), torch.isneginf(expect))  # the -inf pattern exactly
    fin = torch.isfinite(expect)
    assert torch.isfinite(out[fin]).all()
    # Per element, against the size of its terms (cancellation-proof): far inside DESIGN §8's 1e-3.
    mag = ref.indexer_logits(q.float().abs(), k.float().abs(), None if ksc is None else ksc.abs(), w.abs(), ks, ke)
    assert ((out[fin] - expect[fin]).abs() <= 1e-5 * mag[fin] + 1e-6).all()
    return out


def check_topk(q, k, ksc, w, ks, ke, topk, logits):
    s_q = q.shape[0]
    out = torch.full((s_q, topk), POISON_I, dtype=torch.int32)
    got = ops.indexer_topk(q, k, ksc, w, ks, ke, topk, out=out)
    assert (got != POISON_I).all()
    # The kernel's own scores' exact selection, and the reference's as sets of scores.
    assert torch.equal(got, ref.topk_indices(logits, ks, ke, topk, topk))
    expect = ref.indexer_topk(q, k, ksc, w, ks, ke, topk)
    assert torch.equal((got >= 0).sum(1), (expect >= 0).sum(1))
    for r in range(s_q):
        m = int((got[r] >= 0).sum())
        a = logits[r, int(ks[r]) + got[r, :m].long()].sort().values
        b = logits[r, int(ks[r]) + expect[r, :m].long()].sort().values
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("h", [1, 2, 3, 5, 6, 7, 8, 9, 10, 14, 22])
def test_heads_not_a_multiple_of_the_block(cpu_isa, dtype, h):
    gen = torch.Generator().manual_seed(1000 + h)
    s_q, s_kv = 9, 77  # 9 rows: a full row block of 8 and one more; 77 keys: 2 tiles and 13
    q, k, ksc, w = inputs(s_q, s_kv, h, 128, dtype, gen)
    ks, ke = causal_tails(s_q, s_kv)
    logits = check_logits(q, k, ksc, w, ks, ke)
    check_topk(q, k, ksc, w, ks, ke, 40, logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("s_kv", [1, 7, 8, 9, 31, 32, 33, 41, 63, 65, 100])
def test_key_counts_not_a_multiple_of_the_tile(cpu_isa, dtype, s_kv):
    gen = torch.Generator().manual_seed(2000 + s_kv)
    q, k, ksc, w = inputs(3, s_kv, 8, 64, dtype, gen)
    ks = torch.tensor([0, s_kv // 3, 0], dtype=torch.int32)
    ke = torch.tensor([s_kv, s_kv, max(1, s_kv - 5)], dtype=torch.int32)
    logits = check_logits(q, k, ksc, w, ks, ke)
    check_topk(q, k, ksc, w, ks, ke, max(1, s_kv // 4), logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("h", [1, 8, 16, 64])
def test_one_row(cpu_isa, dtype, h):
    gen = torch.Generator().manual_seed(3000 + h)
    q, k, ksc, w = inputs(1, 1000, h, 128, dtype, gen)
    ks, ke = torch.tensor([3], dtype=torch.int32), torch.tensor([997], dtype=torch.int32)
    logits = check_logits(q, k, ksc, w, ks, ke)
    check_topk(q, k, ksc, w, ks, ke, 100, logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("d", [6, 10, 40, 136])  # channels no multiple of 8 (a scalar pack), and of 32
def test_channels_not_a_multiple_of_8(cpu_isa, dtype, d):
    gen = torch.Generator().manual_seed(4000 + d)
    s_q, s_kv = 12, 150
    q, k, ksc, w = inputs(s_q, s_kv, 7, d, dtype, gen)
    ks, ke = causal_tails(s_q, s_kv)
    logits = check_logits(q, k, ksc, w, ks, ke)
    check_topk(q, k, ksc, w, ks, ke, 30, logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_paged_decode_tails(cpu_isa, dtype):
    # dtype only varies the seed: the paged cache is e4m3 with a scale per row.
    gen = torch.Generator().manual_seed({"fp32": 1, "bf16": 2, "fp8": 3}[dtype])
    batch, next_n, h, bs, topk = 3, 3, 10, 16, 20
    seq_lens = torch.tensor([5, 33, 70], dtype=torch.int32)
    table = torch.randperm(16, generator=gen, dtype=torch.int32)[:15].reshape(batch, 5)
    cache = torch.zeros(16, bs * 132, dtype=torch.uint8)
    for b in range(batch):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        ref.index_k_cache_insert(torch.randn(n, 128, generator=gen), table[b, pos // bs].long() * bs + pos % bs, cache)
    qv, qs = ref.quantize_fp8(torch.randn(batch * next_n, h, 128, generator=gen), ref.INDEX_Q_EPS)
    w = ref.indexer_weights(torch.randn(batch * next_n, h, generator=gen), qs[..., 0]).contiguous()
    logits = ops.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, 70)
    expect = ref.indexer_logits_paged(qv, w, cache, table, seq_lens, next_n, 70)
    assert torch.equal(torch.isneginf(logits), torch.isneginf(expect))
    fin = torch.isfinite(expect)
    assert torch.allclose(logits[fin], expect[fin], rtol=1e-5, atol=1e-5 * expect[fin].abs().max().item())
    got = ops.indexer_topk_paged(qv, w, cache, table, seq_lens, next_n, topk)
    windows = ref.decode_windows(seq_lens, next_n).clamp(min=0).int()
    assert torch.equal(got, ref.topk_indices(logits, torch.zeros_like(windows), windows, topk, topk))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_same_bits_on_any_thread_count(cpu_isa, dtype):
    gen = torch.Generator().manual_seed(5000)
    q, k, ksc, w = inputs(20, 9000, 14, 128, dtype, gen)
    ks, ke = causal_tails(20, 9000)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append((ops.indexer_logits(q, k, ksc, w, ks, ke), ops.indexer_topk(q, k, ksc, w, ks, ke, 512)))
    finally:
        torch.set_num_threads(before)
    for logits, sel in runs[1:]:
        assert torch.equal(logits.view(torch.int32), runs[0][0].view(torch.int32))
        assert torch.equal(sel, runs[0][1])
