"""MiniMax-M3's block-sparse ops (DESIGN.md §5, §6, §8): reference.py against transformers'
MiniMax-M3 indexer and attention, then the CPU kernels against reference.py on every CPU path
this machine has (fresh random inputs, poisoned outputs, every element checked, determinism),
error paths, opcheck and a property-based fuzz case."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import indexcache._C as _C
from indexcache import ops
from indexcache import reference as ref

from test_ops import rel_err

POISON_I = -7777


# ------------------------------------------------------------------ helpers

def rows_of(ks, ke):
    return [(int(a), int(b)) for a, b in zip(ks, ke)]


def selection_scores(q, keys, pos, sel, block_size, local_blocks):
    """Reference block scores (forced blocks +inf) of the selected ids of one row, sorted."""
    sc = ref.block_scores(q.unsqueeze(0), keys, torch.tensor([pos]), block_size)[0]  # [h, nb]
    qb = pos // block_size
    for j in range(local_blocks):
        sc[:, max(qb - j, 0)] = math.inf
    out = []
    for h in range(sel.shape[0]):
        ids = sel[h][sel[h] >= 0].long()
        out.append(torch.sort(sc[h, ids]).values)
    return out


def assert_blocks_equal(got, expect, row_inputs, block_size, local_blocks):
    """Equal ids, or (a near-tie reordered by fp32 summation order) equal reference scores."""
    assert got.shape == expect.shape and got.dtype == torch.int32
    assert not (got == POISON_I).any(), "an output element was not written"
    diff = (got != expect).any(dim=-1).any(dim=-1).nonzero().flatten().tolist()
    assert len(diff) <= max(1, got.shape[0] // 20), f"{len(diff)} of {got.shape[0]} rows differ"
    for t in diff:
        q, keys, pos = row_inputs(t)
        a = selection_scores(q, keys, pos, got[t], block_size, local_blocks)
        b = selection_scores(q, keys, pos, expect[t], block_size, local_blocks)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, equal_nan=True)


def windows(lens, s_q_per):
    """Flattened requests of the given lengths; the last s_q_per tokens of each are queries."""
    ks, ke, start = [], [], 0
    for n in lens:
        for j in range(min(s_q_per, n)):
            ks.append(start)
            ke.append(start + n - min(s_q_per, n) + j + 1)
        start += n
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32), start


def make_paged(keys_per_req, page_size, extra_pages=3, seed=0):
    """Scatter each request's rows [n, ...] into a paged cache with shuffled, non-contiguous pages."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [(k.shape[0] + page_size - 1) // page_size for k in keys_per_req]
    max_pages = max(pages_per + [1])
    total = sum(pages_per) + extra_pages
    perm = torch.randperm(total, generator=g)
    tail = keys_per_req[0].shape[1:]
    cache = torch.randn(total, page_size, *tail, generator=g).to(keys_per_req[0].dtype)
    table = torch.full((len(keys_per_req), max_pages), 0, dtype=torch.int32)
    used = 0
    for b, k in enumerate(keys_per_req):
        for j in range(pages_per[b]):
            pg = int(perm[used])
            used += 1
            table[b, j] = pg
            rows = k[j * page_size:(j + 1) * page_size]
            cache[pg, :rows.shape[0]] = rows
    # unused trailing table entries point at real pages too (never read past seq_len)
    return cache, table


# ------------------------------------------------------------------ reference vs transformers

def _tf():
    M = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    C = pytest.importorskip("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl")
    return M, C


def _tf_config(C, block_size, topk, local):
    return C.MiniMaxM3VLTextConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3,
                                   head_dim=16, index_n_heads=3, index_head_dim=32, index_block_size=block_size,
                                   index_topk_blocks=topk, index_local_blocks=local,
                                   layer_types=["minimax_m3_sparse"], rms_norm_eps=1e-6)


@pytest.mark.parametrize("block_size,topk,local,seq", [(4, 3, 1, 37), (8, 4, 2, 64), (4, 20, 1, 30), (5, 2, 0, 41)])
def test_reference_block_topk_matches_transformers(block_size, topk, local, seq):
    M, C = _tf()
    torch.manual_seed(seq * 7 + topk)
    cfg = _tf_config(C, block_size, topk, local)
    ix = M.MiniMaxM3VLIndexer(cfg, 0).float()
    for p in ix.parameters():
        torch.nn.init.normal_(p, std=0.3)
    batch = 2
    x = torch.randn(batch, seq, cfg.hidden_size)
    cos, sin = torch.randn(batch, seq, 32).cos(), torch.randn(batch, seq, 32).sin()
    pos_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    with torch.no_grad():
        got = ix(x, (cos, sin), None, pos_ids)  # [B, H, S, min(topk, nb)], descending score order
        q = ix.q_norm(ix.q_proj(x).view(batch, seq, -1, 32)).transpose(1, 2)
        k = ix.k_norm(ix.k_proj(x).view(batch, seq, 1, 32)).transpose(1, 2)
        q, k = M.apply_rotary_pos_emb(q, k, cos, sin)
    for b in range(batch):
        ks = torch.zeros(seq, dtype=torch.int32)
        ke = torch.arange(1, seq + 1, dtype=torch.int32)
        mine = ref.block_topk(q[b].transpose(0, 1).contiguous(), k[b, 0], ks, ke, block_size, topk, local)
        theirs = got[b].permute(1, 0, 2)  # [S, H, topk']
        for t in range(seq):
            for h in range(cfg.index_n_heads):
                a = sorted(i for i in mine[t, h].tolist() if i >= 0)
                e = sorted(i for i in theirs[t, h].tolist() if i >= 0)
                assert a == e, (t, h, a, e)
                assert all(i == -1 for i in mine[t, h, len(a):].tolist())
                assert len(a) == min(topk, t // block_size + 1)


@pytest.mark.parametrize("block_size,topk,local,seq", [(4, 3, 1, 37), (8, 2, 2, 50)])
def test_reference_attention_matches_transformers(block_size, topk, local, seq):
    M, C = _tf()
    torch.manual_seed(seq + topk)
    cfg = _tf_config(C, block_size, topk, local)
    ix = M.MiniMaxM3VLIndexer(cfg, 0)
    batch, h_q, h_kv, d = 2, 6, 3, 16
    q = torch.randn(batch, h_q, seq, d)
    k = torch.randn(batch, h_kv, seq, d)
    v = torch.randn(batch, h_kv, seq, d)
    sel = torch.stack([ref.block_topk(torch.randn(seq, h_kv, 8), torch.randn(seq, 8), torch.zeros(seq, dtype=torch.int32),
                                      torch.arange(1, seq + 1, dtype=torch.int32), block_size, topk, local)
                       for _ in range(batch)])  # [B, S, h_kv, topk]
    pos_ids = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    mask = ix.build_block_mask(sel.permute(0, 2, 1, 3).long(), None, seq, torch.float32, torch.device("cpu"), pos_ids)

    class Stub(torch.nn.Module):
        num_key_value_groups = h_q // h_kv

    Stub.training = False
    theirs, _ = M.eager_attention_forward(Stub(), q, k, v, mask, scaling=d ** -0.5)  # [B, S, h_q, d]
    kc, table = make_paged([k[b].transpose(0, 1) for b in range(batch)], page_size=8)
    vc2 = torch.randn_like(kc)  # v at k's page placement
    for b in range(batch):
        for i in range(seq):
            vc2[table[b, i // 8], i % 8] = v[b, :, i]
    req = torch.arange(batch, dtype=torch.int32).repeat_interleave(seq)
    pos = torch.arange(seq, dtype=torch.int32).repeat(batch)
    out, lse = ref.block_sparse_attention(q.permute(0, 2, 1, 3).reshape(-1, h_q, d), kc, vc2, table, req, pos,
                                          sel.reshape(-1, h_kv, topk), block_size, d ** -0.5)
    assert rel_err(out, theirs.reshape(-1, h_q, d)) < 1e-5
    assert torch.isfinite(lse).all()


# ------------------------------------------------------------------ kernels vs reference

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,d,block_size,topk,local,lens", [
    (4, 128, 16, 4, 1, [200, 97]),
    (2, 64, 8, 16, 2, [70, 1, 33]),
    (1, 24, 5, 3, 0, [40, 12]),
    (4, 128, 128, 16, 1, [1500]),
])
def test_block_topk_prefill(cpu_isa, dtype, h, d, block_size, topk, local, lens):
    torch.manual_seed(hash((h, d, block_size, topk)) % 1000)
    ks, ke, s_kv = windows(lens, 24)
    q = torch.randn(ks.shape[0], h, d).to(dtype)
    k = (torch.randn(s_kv, d) + 0.1).to(dtype)
    expect = ref.block_topk(q, k, ks, ke, block_size, topk, local)
    out = torch.full((q.shape[0], h, topk), POISON_I, dtype=torch.int32)
    ops.block_topk(q, k, ks, ke, block_size, topk, local, out=out)

    def row(t):
        return q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)

    assert_blocks_equal(out, expect, row, block_size, local)
    again = ops.block_topk(q, k, ks, ke, block_size, topk, local)
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("next_n,page_size,block_size", [(1, 16, 16), (2, 8, 16), (3, 32, 8)])
def test_block_topk_paged(cpu_isa, dtype, next_n, page_size, block_size):
    torch.manual_seed(next_n * 100 + page_size)
    h, d, topk, local = 4, 128, 5, 1
    seq_lens = [150, 3, 64, 1]
    keys = [(torch.randn(n, d) + 0.1).to(dtype) for n in seq_lens]
    cache, table = make_paged(keys, page_size)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens) * next_n, h, d).to(dtype)
    expect = ref.block_topk_paged(q, cache, table, sl, next_n, block_size, topk, local)
    out = torch.full((q.shape[0], h, topk), POISON_I, dtype=torch.int32)
    ops.block_topk_paged(q, cache, table, sl, next_n, block_size, topk, local, out=out)
    win = ref.decode_windows(sl, next_n)

    def row(t):
        b, w = t // next_n, int(win[t])
        return q[t], keys[b][:w], w - 1

    assert_blocks_equal(out, expect, row, block_size, local)
    # rows with an empty window (seq_len 1 and next_n > 1) are all -1
    for t in range(q.shape[0]):
        if int(win[t]) <= 0:
            assert (out[t] == -1).all()


def make_attention(dtype, lens, h_q, h_kv, d, page_size, block_size, topk, rows_per, seed=0, dup=True):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, h_kv, d, generator=g).to(dtype) for n in lens]
    vals = [torch.randn(n, h_kv, d, generator=g).to(dtype) for n in lens]
    kc, table = make_paged(keys, page_size, seed=seed)
    vc = torch.randn(kc.shape, generator=g).to(dtype)
    for b, v in enumerate(vals):
        for i in range(v.shape[0]):
            vc[table[b, i // page_size], i % page_size] = v[i]
    req, pos = [], []
    for b, n in enumerate(lens):
        for j in range(min(rows_per, n)):
            req.append(b)
            pos.append(n - min(rows_per, n) + j)
    req = torch.tensor(req, dtype=torch.int32)
    pos = torch.tensor(pos, dtype=torch.int32)
    s_q = req.shape[0]
    q = torch.randn(s_q, h_q, d, generator=g).to(dtype)
    nb = max(lens) // block_size + 2
    blocks = torch.randint(-1, nb, (s_q, h_kv, topk), generator=g, dtype=torch.int32)
    if dup and topk > 1:
        blocks[::3, :, 1] = blocks[::3, :, 0]  # duplicates count once
    blocks[1::7] = -1  # rows with no block: out 0, lse -inf
    return q, kc, vc, table, req, pos, blocks


@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("h_q,h_kv,d,page_size,block_size,topk,rows_per", [
    (8, 2, 128, 16, 16, 4, 20),      # prefill-like: many rows per request
    (4, 4, 64, 8, 32, 3, 1),         # decode: one row per request
    (6, 1, 48, 32, 8, 16, 5),
    (16, 4, 128, 64, 128, 16, 2),    # MiniMax-M3's shapes (block 128, 16 blocks)
    (26, 2, 37, 8, 24, 5, 9),        # odd d, block and group not multiples of any vector width
    (2, 1, 128, 16, 64, 6, 40),      # 2 heads per KV group, many rows sharing blocks
])
def test_block_sparse_attention(cpu_isa, dtype, bar, h_q, h_kv, d, page_size, block_size, topk, rows_per):
    lens = [300, 17, 129] if block_size < 128 else [2100, 260]
    q, kc, vc, table, req, pos, blocks = make_attention(dtype, lens, h_q, h_kv, d, page_size, block_size, topk, rows_per,
                                                       seed=h_q * d + topk)
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], h_q), math.nan)
    ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5, out=(out, lse))
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    assert rel_err(out.float(), e_out.float()) < bar
    finite = torch.isfinite(e_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[~finite] == -math.inf).all() and (out[(~finite)] == 0).all()
    torch.testing.assert_close(lse[finite], e_lse[finite], rtol=1e-5, atol=1e-5)
    out2, lse2 = ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_alone_equal_rows_grouped(cpu_isa, dtype):
    # Rows of one request share block tiles in the kernel; a row's result must not depend on which
    # other rows (or how many threads) share them: each row alone, bit for bit, as in the batch.
    q, kc, vc, table, req, pos, blocks = make_attention(dtype, [700, 90], 16, 2, 64, 16, 32, 8, 30, seed=11)
    out, lse = ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, 32, 0.125)
    assert_rows_alone_and_one_thread_equal((q, kc, vc, table, req, pos, blocks, 32, 0.125), out, lse,
                                           (0, 7, 29, 31, q.shape[0] - 1))


def assert_rows_alone_and_one_thread_equal(args, out, lse, rows):
    """block_sparse_attention(*args) gave (out, lse); each of `rows` alone and the whole batch on one
    thread give the same bits."""
    q, kc, vc, table, req, pos, blocks, block_size, scale = args
    for t in rows:
        o1, l1 = ops.block_sparse_attention(q[t:t + 1], kc, vc, table, req[t:t + 1], pos[t:t + 1], blocks[t:t + 1],
                                            block_size, scale)
        assert torch.equal(o1[0], out[t]) and torch.equal(l1[0], lse[t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o2, l2 = ops.block_sparse_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


def test_attention_blocks_beyond_position_read_nothing(cpu_isa):
    # Block ids past the row's position (future blocks) add no key: same as -1.
    q, kc, vc, table, req, pos, blocks = make_attention(torch.float32, [100], 4, 2, 32, 16, 16, 4, 10, seed=5, dup=False)
    far = blocks.clone()
    far[:, :, -1] = 50
    a = ops.block_sparse_attention(q, kc, vc, table, req, pos, far, 16, 0.2)
    near = blocks.clone()
    near[:, :, -1] = -1
    b = ops.block_sparse_attention(q, kc, vc, table, req, pos, near, 16, 0.2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def bf16_p_reference(q, kc, vc, table, req, pos, blocks, block_size, scale):
    """The reference with each softmax weight rounded to bf16 before P·V (what a kernel that fed P to
    bf16 dot products unsplit would compute), out rounded to bf16: the error the bar below must catch."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    g = q.shape[1] // kc.shape[2]
    for t in range(q.shape[0]):
        keys, vals = ref.paged_rows(kc, table, int(req[t]), int(pos[t]) + 1).float(), \
            ref.paged_rows(vc, table, int(req[t]), int(pos[t]) + 1).float()
        kb = torch.arange(int(pos[t]) + 1) // block_size
        for kh in range(kc.shape[2]):
            sel = blocks[t, kh].long()
            allowed = (kb.view(-1, 1) == sel[sel >= 0].view(1, -1)).any(dim=-1)
            if bool(allowed.any()):
                s = q[t, kh * g:(kh + 1) * g].float() @ keys[allowed, kh].T * scale
                p = torch.exp(s - s.amax(-1, keepdim=True))
                out[t, kh * g:(kh + 1) * g] = (p.bfloat16().float() @ vals[allowed, kh]) / p.sum(-1, keepdim=True)
    return out.bfloat16()


@pytest.mark.parametrize("h_q,h_kv,d,block_size,rows_per", [
    (40, 2, 128, 25, 48),   # 20 heads per KV group: 16-vector query chunks split rows' heads; odd block
    (7, 1, 96, 7, 33),      # d/2 = 48 channel pairs: three 16-column transposes; odd block
    (10, 2, 40, 16, 30),    # d/2 = 20: one transpose and 4 columns element by element
    (3, 1, 64, 33, 70),     # 3 heads per group: panels of vectors of several rows
])
def test_attention_bf16_tiles_and_p_accuracy(cpu_isa, h_q, h_kv, d, block_size, rows_per):
    """bf16 with shapes the avx512bf16 tiles cut unevenly, many rows sharing each block (6 of 12
    blocks per row), rows whose position ends inside a block on an odd key. P keeps fp32 accuracy
    on every path (the avx512bf16 path splits it into two bf16 parts): out equals the reference up
    to rare flips of out's own bf16 rounding, far inside what rounding P to bf16 costs."""
    lens = [12 * block_size - 3, 5 * block_size + 1]
    q, kc, vc, table, req, pos, _ = make_attention(torch.bfloat16, lens, h_q, h_kv, d, 16, block_size, 6, rows_per,
                                                   seed=h_q + d)
    g = torch.Generator().manual_seed(d)
    nb = lens[0] // block_size + 1
    blocks = torch.stack([torch.randperm(nb, generator=g)[:6] for _ in range(q.shape[0] * h_kv)]).int()
    blocks = blocks.view(q.shape[0], h_kv, 6)
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], h_q), math.nan)
    ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5, out=(out, lse))
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    torch.testing.assert_close(lse, e_lse, rtol=1e-5, atol=1e-5)
    rounded_p = rel_err(bf16_p_reference(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5).float(),
                        e_out.float())
    bar = 4e-4  # measured: 5e-5 .. 1e-4 with P split (avx512bf16), 6e-7 .. 4e-5 with fp32 P; ~2e-3 rounded
    assert rounded_p > 3 * bar, "the bar would not tell P rounded to bf16 from P kept"
    assert rel_err(out.float(), e_out.float()) < bar
    assert torch.equal(ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5)[0], out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_attention_value_past_position_in_a_shared_block_is_not_read(cpu_isa, dtype, bad):
    """Rows of one request share block 2's value tile; a row whose position ends at key 20 (5 of
    the block's 8 keys: an odd count, so on the avx512bf16 path key 21 is the other half of its last
    key pair) never reads key 21: an inf or NaN there reaches only the rows at or past it."""
    q, kc, vc, table, req, pos, _ = make_attention(dtype, [64], 8, 2, 32, 4, 8, 3, 1, seed=3, dup=False)
    q = torch.randn(4, 8, 32).to(dtype)
    req = torch.zeros(4, dtype=torch.int32)
    pos = torch.tensor([20, 40, 23, 17], dtype=torch.int32)
    blocks = torch.tensor([0, 2, 3], dtype=torch.int32).repeat(4, 2, 1)
    vc[table[0, 21 // 4], 21 % 4, 1, 5] = bad  # key 21, KV head 1, column 5
    out, lse = ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, 8, 0.3)
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, 8, 0.3)
    assert torch.isfinite(out[[0, 3]]).all() and not torch.isfinite(out[[1, 2], 4:, 5]).any()
    assert torch.equal(torch.isfinite(out), torch.isfinite(e_out))
    fin = torch.isfinite(e_out)
    assert rel_err(out[fin].float(), e_out[fin].float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(lse, e_lse, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ errors, opcheck

def test_block_topk_errors():
    q = torch.randn(3, 2, 16)
    k = torch.randn(10, 16)
    ks = torch.zeros(3, dtype=torch.int32)
    ke = torch.tensor([4, 8, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q must be float32 or bfloat16"):
        ops.block_topk(q.half(), k, ks, ke, 4, 2, 1)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.block_topk(q, k.bfloat16(), ks, ke, 4, 2, 1)
    with pytest.raises(RuntimeError, match="k must be"):
        ops.block_topk(q, torch.randn(10, 8), ks, ke, 4, 2, 1)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.block_topk(q.transpose(0, 1).contiguous().transpose(0, 1), k, ks, ke, 4, 2, 1)
    with pytest.raises(RuntimeError, match="ks must be int32"):
        ops.block_topk(q, k, ks.long(), ke, 4, 2, 1)
    with pytest.raises(RuntimeError, match="outside the 10 keys"):
        ops.block_topk(q, k, ks, torch.tensor([4, 8, 11], dtype=torch.int32), 4, 2, 1)
    with pytest.raises(RuntimeError, match="block_size must be >= 1"):
        ops.block_topk(q, k, ks, ke, 0, 2, 1)
    with pytest.raises(RuntimeError, match="local_blocks must be >= 0"):
        ops.block_topk(q, k, ks, ke, 4, 2, -1)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.block_topk(q, k, ks, ke, 4, 2, 1, out=torch.empty(2, 2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_blocks"):
        ops.block_topk(q, k, ks, ke, 4, 2, 1, out=torch.empty(3, 2, 3, dtype=torch.int32))


def test_block_topk_paged_errors():
    q = torch.randn(2, 2, 16)
    cache = torch.randn(3, 8, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    sl = torch.tensor([12], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="batch \\* next_n"):
        ops.block_topk_paged(q, cache, table, sl, 1, 4, 2, 1)
    with pytest.raises(RuntimeError, match="seq_lens\\[0\\] = 17 is outside"):
        ops.block_topk_paged(q, cache, table, torch.tensor([17], dtype=torch.int32), 2, 4, 2, 1)
    with pytest.raises(RuntimeError, match="block_table\\[0, 1\\] = 5 is outside"):
        ops.block_topk_paged(q, cache, torch.tensor([[0, 5]], dtype=torch.int32), sl, 2, 4, 2, 1)
    with pytest.raises(RuntimeError, match="next_n must be >= 1"):
        ops.block_topk_paged(q, cache, table, sl, 0, 4, 2, 1)
    with pytest.raises(RuntimeError, match="k_cache must be"):
        ops.block_topk_paged(q, cache.bfloat16(), table, sl, 2, 4, 2, 1)


def test_block_sparse_attention_errors():
    q, kc, vc, table, req, pos, blocks = make_attention(torch.float32, [40, 20], 4, 2, 16, 8, 8, 3, 2)
    args = [q, kc, vc, table, req, pos, blocks, 8, 0.25]

    def call(i, v, match):
        a = list(args)
        a[i] = v
        with pytest.raises(RuntimeError, match=match):
            ops.block_sparse_attention(*a)

    call(0, q.half(), "q must be float32 or bfloat16")
    call(1, kc.bfloat16(), "k_cache must have q's dtype")
    call(2, vc[:, :4].contiguous(), "v_cache must have k_cache's shape")
    call(0, torch.randn(q.shape[0], 3, 16), "multiple of the cache's 2 KV heads")
    call(4, torch.full_like(req, 2), "req\\[0\\] = 2 is outside the 2 requests")
    call(5, torch.full_like(pos, 64), "pos\\[0\\] = 64 is outside")
    call(6, torch.full_like(blocks, -2), "only block ids >= 0 and -1")
    call(6, blocks[:, :1].contiguous(), "blocks must be \\[s_q, h_kv, topk\\]")
    call(3, torch.full_like(table, 99), "block_table\\[0, 0\\] = 99 is outside")
    call(7, 0, "block_size must be >= 1")
    for bad_scale in (0.0, -0.5, math.nan, math.inf, 1e300):
        call(8, bad_scale, "scale must be finite and > 0")
    call(1, kc.transpose(0, 1), "k_cache must be contiguous")
    with pytest.raises(RuntimeError, match="lse must be"):
        ops.block_sparse_attention(*args, out=(torch.empty_like(q), torch.empty(1, 4)))


def test_opcheck_block_sparse_ops():
    o = torch.ops.indexcache
    q = torch.randn(3, 2, 16)
    k = torch.randn(10, 16)
    ks = torch.zeros(3, dtype=torch.int32)
    ke = torch.tensor([4, 8, 10], dtype=torch.int32)
    cache = torch.randn(3, 8, 16)
    qa, kc, vc, table, req, pos, blocks = make_attention(torch.bfloat16, [40, 20], 4, 2, 16, 8, 8, 3, 2)
    cases = [
        (o.block_topk.default, (q, k, ks, ke, 4, 1, torch.empty(3, 2, 2, dtype=torch.int32))),
        (o.block_topk_paged.default, (q[:2].contiguous(), cache, torch.tensor([[0, 2]], dtype=torch.int32),
                                      torch.tensor([12], dtype=torch.int32), 2, 4, 1,
                                      torch.empty(2, 2, 3, dtype=torch.int32))),
        (o.block_sparse_attention.default, (qa, kc, vc, table, req, pos, blocks, 8, 0.25, torch.empty_like(qa),
                                            torch.empty(qa.shape[0], 4))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                                    "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------ property-based fuzz

isas = st.sampled_from(["auto"] + [p for p, why in _C._cpu_paths().items() if not why])


@settings(deadline=None, max_examples=max(10, settings.default.max_examples // 5))
@given(data=st.data(), isa=isas)
def test_fuzz_block_sparse(data, isa):
    seed = data.draw(st.integers(0, 2**31 - 1))
    torch.manual_seed(seed)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    d = data.draw(st.sampled_from([1, 8, 17, 64, 128]))
    block_size = data.draw(st.integers(1, 40))
    topk = data.draw(st.integers(1, 8))
    local = data.draw(st.integers(0, 3))
    h_kv = data.draw(st.integers(1, 3))
    g = data.draw(st.integers(1, 3))
    lens = data.draw(st.lists(st.integers(0, 120), min_size=1, max_size=3))
    _C._set_cpu_isa(isa)
    try:
        # block top-k, prefill
        ks, ke, s_kv = windows(lens, data.draw(st.integers(1, 6)))
        q = torch.randn(ks.shape[0], h_kv, d).to(dtype)
        k = torch.randn(max(s_kv, 1), d).to(dtype)
        out = torch.full((q.shape[0], h_kv, topk), POISON_I, dtype=torch.int32)
        ops.block_topk(q, k, ks, ke, block_size, topk, local, out=out)
        expect = ref.block_topk(q, k, ks, ke, block_size, topk, local)
        assert_blocks_equal(out, expect, lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)),
                            block_size, local)
        assert torch.equal(ops.block_topk(q, k, ks, ke, block_size, topk, local), out)
        # block-sparse attention over the selection
        lens_a = [max(n, 1) for n in lens]
        page = data.draw(st.sampled_from([1, 4, 16]))
        qa, kc, vc, table, req, pos, _ = make_attention(dtype, lens_a, h_kv * g, h_kv, d, page, block_size, topk, 4,
                                                        seed=seed)
        win_ks = torch.zeros_like(pos)
        sel = torch.cat([ref.block_topk(torch.randn(1, h_kv, 8), torch.randn(int(p) + 1, 8), win_ks[:1], (pos[i:i + 1] + 1),
                                        block_size, topk, local) for i, p in enumerate(pos)])
        o = torch.full_like(qa, math.nan)
        lse = torch.full((qa.shape[0], qa.shape[1]), math.nan)
        ops.block_sparse_attention(qa, kc, vc, table, req, pos, sel, block_size, d ** -0.5, out=(o, lse))
        e_o, e_lse = ref.block_sparse_attention(qa, kc, vc, table, req, pos, sel, block_size, d ** -0.5)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert rel_err(o.float(), e_o.float()) < (1e-5 if dtype == torch.float32 else 1e-2)
        torch.testing.assert_close(lse, e_lse, rtol=1e-5, atol=1e-5)
    finally:
        _C._set_cpu_isa("auto")


# ------------------------------------------------------------------ non-finite inputs (docs/ops.md)

TOPK_CASES = ["q_nan", "q_inf", "k_nan", "k_inf", "k_ninf"]
ATTN_CASES = ["q_nan", "q_inf", "k_nan", "k_inf", "k_unread_nan", "v_nan", "v_inf"]


def nonfinite_topk(case, dtype, paged):
    """Prefill or paged block_topk inputs with one kind of NaN / inf (the table's rows)."""
    g = torch.Generator().manual_seed(5)
    h, d = 3, 32
    lens = [37, 22]
    keys = [torch.randn(n, d, generator=g) for n in lens]
    rows = 2 * len(lens) if paged else 8
    q = torch.randn(rows, h, d, generator=g)
    if case == "q_nan":
        q[1, 2, 5] = math.nan
    elif case == "q_inf":
        q[2, 0, 3] = math.inf
    else:
        keys[0][[6, 13, 30], 7] = {"k_nan": math.nan, "k_inf": math.inf, "k_ninf": -math.inf}[case]
    keys = [k.to(dtype) for k in keys]
    return q.to(dtype), keys


def run_topk_both(case, dtype, device):
    """(got, expect, row_inputs) for the prefill and the paged op on one non-finite case."""
    bsz, topk, local = 4, 3, 1
    res = []
    q, keys = nonfinite_topk(case, dtype, False)
    ks, ke, _ = windows([k.shape[0] for k in keys], 4)
    k = torch.cat(keys)
    got = ops.block_topk(q.to(device), k.to(device), ks.to(device), ke.to(device), bsz, topk, local).cpu()
    res.append((got, ref.block_topk(q, k, ks, ke, bsz, topk, local),
                lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1))))
    qp, keys_p = nonfinite_topk(case, dtype, True)
    cache, table = make_paged(keys_p, 8)
    sl = torch.tensor([k.shape[0] for k in keys_p], dtype=torch.int32)
    got = ops.block_topk_paged(qp.to(device), cache.to(device), table.to(device), sl.to(device), 2, bsz, topk,
                               local).cpu()
    win = ref.decode_windows(sl, 2)
    res.append((got, ref.block_topk_paged(qp, cache, table, sl, 2, bsz, topk, local),
                lambda t: (qp[t], keys_p[t // 2][:int(win[t])], int(win[t]) - 1)))
    return res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TOPK_CASES)
def test_block_topk_non_finite(cpu_isa, dtype, case):
    """NaN block maxima rank above +inf (forced blocks included), a block whose visible scores
    are all -inf is never kept, +inf ties go to the lower id: the CPU equals the reference."""
    for got, expect, row in run_topk_both(case, dtype, "cpu"):
        assert_blocks_equal(got, expect, row, 4, 1)


def nonfinite_attention(case, dtype):
    q, kc, vc, table, req, pos, blocks = make_attention(torch.float32, [40, 25], 4, 2, 32, 8, 8, 3, 3, seed=21,
                                                       dup=False)
    blocks[:, :, 0] = 0  # every row reads block 0 of its request
    pg0 = int(table[0, 0])  # request 0's keys 0..7
    if case == "q_nan":
        q[1, 3, 4] = math.nan
    elif case == "q_inf":
        q[0, 0, 1] = math.inf
    elif case in ("k_nan", "k_inf"):
        kc[pg0, 2, 1, 9] = math.nan if case == "k_nan" else math.inf
    elif case == "k_unread_nan":
        kc[:, :, 0, 0] = math.nan  # KV head 0, which no row reads
        blocks[:, 0] = -1
    else:
        vc[pg0, 5, 0, 3] = math.nan if case == "v_nan" else math.inf
    return q.to(dtype), kc.to(dtype), vc.to(dtype), table, req, pos, blocks


def check_attention_non_finite(case, dtype, device):
    args = nonfinite_attention(case, dtype)
    e_out, e_lse = ref.block_sparse_attention(*args, 8, 0.2)
    out, lse = ops.block_sparse_attention(*[a.to(device) for a in args], 8, 0.2)
    out, lse = out.cpu().float(), lse.cpu()
    e_out = e_out.float()
    assert bool(torch.isnan(e_lse).any()) == (case in ("q_nan", "q_inf", "k_nan", "k_inf"))
    assert torch.equal(torch.isnan(lse), torch.isnan(e_lse))
    assert torch.equal(lse[torch.isinf(lse)], e_lse[torch.isinf(e_lse)])
    assert torch.equal(torch.isfinite(out), torch.isfinite(e_out))
    assert torch.equal(torch.isnan(out), torch.isnan(e_out)) or case == "v_inf"
    fin = torch.isfinite(e_out)
    assert rel_err(out[fin], e_out[fin]) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_block_sparse_attention_non_finite(cpu_isa, dtype, case):
    """A NaN / ±inf score of a key the head reads: all of out[t, h] and lse[t, h] NaN; a NaN /
    inf value row: non-finite out columns only; a row nobody reads: nothing."""
    check_attention_non_finite(case, dtype, "cpu")



def sprinkle(draw, x):
    """x with up to 3 entries set to NaN / ±inf, on half the draws."""
    if x.numel() == 0 or not draw(st.booleans()):
        return x
    flat = x.view(-1)
    for _ in range(draw(st.integers(1, 3))):
        flat[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([math.nan, -math.nan, math.inf, -math.inf]))
    return x


@settings(deadline=None, max_examples=max(10, settings.default.max_examples // 5))
@given(data=st.data(), isa=isas)
def test_fuzz_block_sparse_non_finite(data, isa):
    """The table's rules on random shapes: NaN / ±inf anywhere in q, keys and values."""
    draw = data.draw
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    d = draw(st.sampled_from([1, 8, 17, 64]))
    bsz, topk, local = draw(st.integers(1, 24)), draw(st.integers(1, 6)), draw(st.integers(0, 3))
    h_kv, grp = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(1, 90), min_size=1, max_size=2))
    _C._set_cpu_isa(isa)
    try:
        ks, ke, s_kv = windows(lens, draw(st.integers(1, 4)))
        q = sprinkle(draw, torch.randn(ks.shape[0], h_kv, d, generator=g)).to(dtype)
        k = sprinkle(draw, torch.randn(s_kv, d, generator=g)).to(dtype)
        assert_blocks_equal(ops.block_topk(q, k, ks, ke, bsz, topk, local), ref.block_topk(q, k, ks, ke, bsz, topk, local),
                            lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)), bsz, local)
        args = list(make_attention(dtype, lens, h_kv * grp, h_kv, d, draw(st.sampled_from([1, 4, 16])), bsz, topk,
                                   draw(st.integers(1, 4)), seed=seed))
        for i in range(3):
            args[i] = sprinkle(draw, args[i].float()).to(dtype)
        out, lse = ops.block_sparse_attention(*args, bsz, d ** -0.5)
        e_out, e_lse = ref.block_sparse_attention(*args, bsz, d ** -0.5)
        out, e_out = out.float(), e_out.float()
        assert torch.equal(torch.isnan(lse), torch.isnan(e_lse))
        assert torch.equal(lse[torch.isinf(lse)], e_lse[torch.isinf(e_lse)])
        assert torch.equal(torch.isfinite(out), torch.isfinite(e_out))
        fin = torch.isfinite(e_out)
        if fin.any():
            assert rel_err(out[fin], e_out[fin]) < (1e-5 if dtype == torch.float32 else 1e-2)
    finally:
        _C._set_cpu_isa("auto")

# ------------------------------------------------------------------ CUDA (bench/gpu_check.sh; skipped without a GPU)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,d,block_size,topk,local,lens,per", [
    (4, 128, 16, 4, 1, [200, 97], 24),
    (2, 64, 8, 16, 2, [70, 1, 33], 24),     # rows with fewer blocks than topk
    (8, 128, 128, 16, 1, [5000, 300], 32),  # MiniMax-M3's shapes
    (2, 32, 1, 8, 1, [9000], 4),            # 9000 block maxima per head: the global-scratch path
])
def test_block_topk_cuda(dtype, h, d, block_size, topk, local, lens, per):
    torch.manual_seed(h * 1000 + d + topk)
    ks, ke, s_kv = windows(lens, per)
    q = torch.randn(ks.shape[0], h, d).to(dtype)
    k = (torch.randn(s_kv, d) + 0.1).to(dtype)
    out = torch.full((q.shape[0], h, topk), POISON_I, dtype=torch.int32, device="cuda")
    ops.block_topk(q.cuda(), k.cuda(), ks.cuda(), ke.cuda(), block_size, topk, local, out=out)
    assert_blocks_equal(out.cpu(), ref.block_topk(q, k, ks, ke, block_size, topk, local),
                        lambda t: (q[t], k[int(ks[t]):int(ke[t])], int(ke[t] - ks[t] - 1)), block_size, local)
    again = ops.block_topk(q.cuda(), k.cuda(), ks.cuda(), ke.cuda(), block_size, topk, local)
    assert torch.equal(again, out)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("next_n", [1, 2, 3])
def test_block_topk_paged_cuda(dtype, next_n):
    torch.manual_seed(next_n)
    h, d, block_size, topk, local, page = 4, 128, 16, 5, 1, 16
    seq_lens = [1500, 3, 64, 1]
    keys = [(torch.randn(n, d) + 0.1).to(dtype) for n in seq_lens]
    cache, table = make_paged(keys, page)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens) * next_n, h, d).to(dtype)
    out = torch.full((q.shape[0], h, topk), POISON_I, dtype=torch.int32, device="cuda")
    ops.block_topk_paged(q.cuda(), cache.cuda(), table.cuda(), sl.cuda(), next_n, block_size, topk, local, out=out)
    win = ref.decode_windows(sl, next_n)
    assert_blocks_equal(out.cpu(), ref.block_topk_paged(q, cache, table, sl, next_n, block_size, topk, local),
                        lambda t: (q[t], keys[t // next_n][:int(win[t])], int(win[t]) - 1), block_size, local)


@needs_cuda
def test_block_topk_cuda_long_rows():
    """Decode rows over 256K keys (DESIGN.md §8), MiniMax-M3's shapes: 2048 block maxima per head."""
    torch.manual_seed(11)
    h, d, bsz, topk, n = 4, 128, 128, 16, 262144
    keys = [torch.randn(n, d).bfloat16()]
    cache, table = make_paged(keys, 64)
    sl = torch.tensor([n], dtype=torch.int32)
    q = torch.randn(2, h, d).bfloat16()
    got = ops.block_topk_paged(q.cuda(), cache.cuda(), table.cuda(), sl.cuda(), 2, bsz, topk, 1).cpu()
    assert_blocks_equal(got, ref.block_topk_paged(q, cache, table, sl, 2, bsz, topk, 1),
                        lambda t: (q[t], keys[0][:n - 1 + t], n - 2 + t), bsz, 1)

@needs_cuda
@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("h_q,h_kv,d,page_size,block_size,topk,rows_per", [
    (8, 2, 128, 16, 16, 4, 20),
    (6, 1, 48, 32, 8, 16, 5),
    (64, 8, 128, 64, 128, 16, 3),    # MiniMax-M3's shapes
])
def test_block_sparse_attention_cuda(dtype, bar, h_q, h_kv, d, page_size, block_size, topk, rows_per):
    lens = [300, 17, 129] if block_size < 128 else [2100, 260]
    args = make_attention(dtype, lens, h_q, h_kv, d, page_size, block_size, topk, rows_per, seed=h_q * d + topk)
    e_out, e_lse = ref.block_sparse_attention(*args, block_size, d ** -0.5)
    out = torch.full_like(args[0], math.nan, device="cuda")
    lse = torch.full((args[0].shape[0], h_q), math.nan, device="cuda")
    ops.block_sparse_attention(*[a.cuda() for a in args], block_size, d ** -0.5, out=(out, lse))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    assert rel_err(out.cpu().float(), e_out.float()) < bar
    finite = torch.isfinite(e_lse)
    assert torch.equal(finite, torch.isfinite(lse.cpu()))
    torch.testing.assert_close(lse.cpu()[finite], e_lse[finite], rtol=1e-5, atol=1e-5)
    out2, lse2 = ops.block_sparse_attention(*[a.cuda() for a in args], block_size, d ** -0.5)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TOPK_CASES)
def test_block_topk_non_finite_cuda(dtype, case):
    for got, expect, row in run_topk_both(case, dtype, "cuda"):
        assert_blocks_equal(got, expect, row, 4, 1)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_block_sparse_attention_non_finite_cuda(dtype, case):
    check_attention_non_finite(case, dtype, "cuda")


@needs_cuda
def test_block_sparse_cuda_errors(monkeypatch):
    """The CPU's messages for shapes, dtypes and devices; index values counted by default and the
    CPU's messages with INDEXCACHE_CHECK=1."""
    q = torch.randn(3, 2, 16, device="cuda")
    k = torch.randn(10, 16, device="cuda")
    ks = torch.zeros(3, dtype=torch.int32, device="cuda")
    ke = torch.tensor([4, 8, 11], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="q and every argument must be on one device"):
        ops.block_topk(q, k.cpu(), ks, ke, 4, 2, 1)
    with pytest.raises(RuntimeError, match="q must be float32 or bfloat16"):
        ops.block_topk(q.half(), k, ks, ke, 4, 2, 1)
    monkeypatch.setenv("INDEXCACHE_CHECK", "0")
    ops.reset_cuda_error_count()
    out = ops.block_topk(q, k, ks, ke, 4, 2, 1)
    assert ops.cuda_error_count() == 1 and (out[2] == -1).all()
    monkeypatch.setenv("INDEXCACHE_CHECK", "1")
    with pytest.raises(RuntimeError, match="outside the 10 keys"):
        ops.block_topk(q, k, ks, ke, 4, 2, 1)
    args = [a.cuda() for a in make_attention(torch.float32, [40, 20], 4, 2, 16, 8, 8, 3, 2)]
    bad = args[6].clone()
    bad[0, 0, 0] = -2
    with pytest.raises(RuntimeError, match="only block ids >= 0 and -1"):
        ops.block_sparse_attention(*args[:6], bad, 8, 0.25)
    monkeypatch.setenv("INDEXCACHE_CHECK", "0")
    ops.reset_cuda_error_count()
    ops.block_sparse_attention(*args[:6], bad, 8, 0.25)
    assert ops.cuda_error_count() == 1
    with pytest.raises(RuntimeError, match="scale must be finite and > 0"):
        ops.block_sparse_attention(*args, 8, math.nan)
