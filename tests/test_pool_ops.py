"""GLM-5.3-Flash's paged key pooling (kpool_pool_paged: the pools completing in a step, from the
cache's ``k | gate`` rows into its pooled-key rows). reference.kpool_pool_paged against the model's
own pooling math (kpool_indexer.pooled_keys) applied request by request, position by position, on
fresh random caches with shuffled block tables: the pools completing in the step are written, every
other pool row stays as poisoned (NaN); bad inputs are ValueErrors."""

import pytest
import torch

from indexcache import reference
from indexcache.models.blocks.kpool_indexer import pooled_keys

NAN = float("nan")


def make_case(seed, p, d, bs, ctx, q, raw_dtype=torch.float32, pool_dtype=torch.float32, ape_dtype=torch.float32):
    """A cache with requests holding ctx[b] tokens and adding q[b], blocks shuffled over the table,
    the pool rows poisoned."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-(c + m) // bs) for c, m in zip(ctx, q)) + 1
    nb = len(ctx) * width + 2
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    table = perm[:len(ctx) * width].view(len(ctx), width).contiguous()
    raw = (torch.randn(nb, bs, 2 * d, generator=g) * 2).to(raw_dtype)
    pool = torch.full((nb, bs // p, d), NAN, dtype=pool_dtype)
    ape = torch.randn(p, d, generator=g).to(ape_dtype)
    lens = (torch.tensor(ctx, dtype=torch.int32), torch.tensor(q, dtype=torch.int32))
    return raw, pool, ape, table, *lens


def expected(raw, ape, table, ctx, q):
    """{(block, row): pooled key} of every pool completing in the step, one request and pool at a time."""
    p, d = ape.shape
    bs = raw.shape[1]
    want = {}
    for b, (c, m) in enumerate(zip(ctx.tolist(), q.tolist())):
        for j in range(c // p, (c + m) // p):
            rows = torch.stack([raw[table[b, t // bs], t % bs] for t in range(j * p, (j + 1) * p)]).float()
            key = pooled_keys(rows[:, :d], rows[:, d:], ape)[0]
            want[(int(table[b, j * p // bs]), (j * p % bs) // p)] = key
    return want


def check_written(pool, want, atol):
    """The expected rows hold their keys, every other row is still NaN."""
    untouched = torch.ones(pool.shape[:2], dtype=torch.bool)
    for (blk, row), key in want.items():
        assert torch.allclose(pool[blk, row].float(), key, atol=atol, rtol=atol), (blk, row)
        untouched[blk, row] = False
    assert torch.isnan(pool[untouched]).all()


# (P, d, block size, ctx_lens, q_lens): prefill from 0, decode steps completing a pool or not,
# chunks starting and ending mid-pool, pools spanning several blocks' rows, a request adding none
CASES = [
    (4, 8, 16, [0], [37]),
    (4, 8, 16, [3, 7, 15, 16], [1, 1, 1, 1]),
    (4, 16, 16, [5, 0, 30], [18, 3, 35]),
    (8, 24, 32, [0, 9], [70, 64]),
    (1, 8, 4, [2, 0], [3, 9]),
    (16, 32, 16, [0, 17], [48, 30]),
]


@pytest.mark.parametrize("p,d,bs,ctx,q", CASES)
def test_reference_matches_model_math(p, d, bs, ctx, q):
    raw, pool, ape, table, c, m = make_case(sum(ctx) * 31 + sum(q) + p, p, d, bs, ctx, q)
    want = expected(raw, ape, table, c, m)
    reference.kpool_pool_paged(raw, pool, ape, table, c, m)
    check_written(pool, want, 1e-5)


def test_reference_steps_build_the_whole_request():
    """Chunked prefill then decode: after each step the request's complete pools are all in the
    cache, the same keys as pooling it in one go."""
    p, d, bs, n = 4, 8, 16, 45
    raw, pool, ape, table, _, _ = make_case(3, p, d, bs, [0], [n])
    once = pool.clone()
    reference.kpool_pool_paged(raw, once, ape, table, torch.tensor([0], dtype=torch.int32),
                               torch.tensor([n], dtype=torch.int32))
    c = 0
    for step in [10, 3, 1, 1, 1, 1, 20, 8]:
        reference.kpool_pool_paged(raw, pool, ape, table, torch.tensor([c], dtype=torch.int32),
                                   torch.tensor([step], dtype=torch.int32))
        c += step
    assert torch.allclose(pool, once, equal_nan=True, atol=1e-6)


def bad_inputs():
    raw, pool, ape, table, c, m = make_case(0, 4, 8, 16, [0, 4], [9, 25])
    i32 = torch.int32
    return [
        ((raw, torch.full((raw.shape[0], 5, 8), NAN), torch.randn(3, 8), table, c, m), "must divide the block size"),
        ((raw, pool, ape.view(1, 4, 8), table, c, m), "ape must be"),
        ((raw, pool, torch.randn(4, 8).double(), table, c, m), "ape must be"),
        ((raw[..., :12], pool, ape, table, c, m), "index_raw must be"),
        ((raw.half(), pool, ape, table, c, m), "index_raw must be"),
        ((raw, pool[:, :3], ape, table, c, m), "index_pool must be"),
        ((raw, pool.double(), ape, table, c, m), "index_pool must be"),
        ((raw, pool.transpose(0, 1).contiguous().transpose(0, 1), ape, table, c, m), "must be contiguous"),
        ((raw, pool, ape, table.long(), c, m), "block_table must be int32"),
        ((raw, pool, ape, table[0], c, m), "block_table must be int32"),
        ((raw, pool, ape, table, c[:1], m), "ctx_lens must be int32"),
        ((raw, pool, ape, table, c, m.long()), "q_lens must be int32"),
        ((raw, pool, ape, table, torch.tensor([0, -4], dtype=i32), m), "must be >= 0"),
        ((raw, pool, ape, table[:, :1], c, m), "do not hold"),
        ((raw, pool, ape, torch.full_like(table, raw.shape[0]), c, m), "outside"),
    ]


@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_reference_refuses(case):
    args, match = bad_inputs()[case]
    with pytest.raises(ValueError, match=match):
        reference.kpool_pool_paged(*args)

