"""GLM-5.3-Flash's paged key pooling (kpool_pool_paged: the pools completing in a step, from the
cache's ``k | gate`` rows into its pooled-key rows). reference.kpool_pool_paged against the model's
own pooling math (kpool_indexer.pooled_keys) applied request by request, position by position, on
fresh random caches with shuffled block tables: the pools completing in the step are written, every
other pool row stays as poisoned (NaN); bad inputs are ValueErrors. Then the op
(ops.kpool_pool_paged) against the reference on every CPU path, fp32 and bf16 caches / ape, its
results at 1 and 2 threads bit-equal, its refusals (the wrapper's ValueErrors, the kernel's own
checks called directly) and torch.library.opcheck."""

import pytest
import torch

from indexcache import ops, reference
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


DTYPE_MIXES = [(torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.bfloat16),
               (torch.float32, torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("raw_dtype,pool_dtype,ape_dtype", DTYPE_MIXES)
@pytest.mark.parametrize("p,d,bs,ctx,q", CASES + [(4, 128, 64, [0, 130, 7], [300, 2, 200]), (2, 19, 8, [1], [40])])
def test_op_matches_reference(cpu_isa, raw_dtype, pool_dtype, ape_dtype, p, d, bs, ctx, q):
    args = make_case(sum(ctx) * 7 + sum(q) + d, p, d, bs, ctx, q, raw_dtype, pool_dtype, ape_dtype)
    raw, pool, ape, table, c, m = args
    want = pool.clone()
    reference.kpool_pool_paged(raw, want, ape, table, c, m)
    ops.kpool_pool_paged(*args)
    assert torch.equal(torch.isnan(pool), torch.isnan(want))  # the same rows written, the rest untouched
    tol = 1e-5 if pool_dtype == torch.float32 else 2 ** -7
    live = ~torch.isnan(want)
    assert torch.allclose(pool[live].float(), want[live].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_op_non_finite_logits_are_nan_like_the_softmax(cpu_isa, bad):
    """A NaN or +inf gate logit makes its pool's channel NaN (torch's softmax: inf - inf); a NaN key
    too; the other channels and pools stay finite."""
    raw, pool, ape, table, c, m = make_case(9, 4, 40, 16, [0], [32])
    d = 40
    blk0, blk1 = int(table[0, 0]), int(table[0, 1])
    raw[blk0, 5, d + 3] = bad      # pool 1 (positions 4-7), gate of channel 3
    raw[blk1, 2, 17] = float("nan")  # pool 4 (positions 16-19: block 1's first pool), key channel 17
    want = pool.clone()
    reference.kpool_pool_paged(raw, want, ape, table, c, m)
    ops.kpool_pool_paged(raw, pool, ape, table, c, m)
    assert torch.isnan(want[blk0, 1, 3]) and torch.isnan(want[blk1, 0, 17])
    assert torch.equal(torch.isnan(pool), torch.isnan(want))
    assert torch.isnan(pool[table[0, :2].long()]).sum() == 2


@pytest.mark.parametrize("p,d,bs,ctx,q", [CASES[2], (16, 136, 64, [0, 100], [300, 60])])
def test_op_on_each_device(device, p, d, bs, ctx, q):
    """The op on ``device`` (the CUDA kernel where a GPU is) against the reference on the CPU, bf16
    cache; on CUDA a pool whose block id is out of range is skipped and counted, not raised."""
    args = make_case(d + p, p, d, bs, ctx, q, torch.bfloat16, torch.float32, torch.float32)
    want = args[1].clone()
    reference.kpool_pool_paged(*args[:1], want, *args[2:])
    moved = [t.to(device) for t in args]
    ops.kpool_pool_paged(*moved)
    got = moved[1].cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.allclose(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5)
    if device == "cuda":
        ops.reset_cuda_error_count()
        moved[3][0, 0] = moved[0].shape[0]
        ops.kpool_pool_paged(*moved)
        assert ops.cuda_error_count() == min(bs // p, (ctx[0] + q[0]) // p) - ctx[0] // p


def test_op_thread_count_does_not_change_results():
    raw, pool, ape, table, c, m = make_case(5, 4, 128, 64, [0, 0, 40], [512, 300, 600])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pool.clone()
        ops.kpool_pool_paged(raw, one, ape, table, c, m)
        torch.set_num_threads(2)
        two = pool.clone()
        ops.kpool_pool_paged(raw, two, ape, table, c, m)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.isnan(one), torch.isnan(two)) and torch.equal(one.nan_to_num(), two.nan_to_num())
    assert (~torch.isnan(one)).any()


@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_op_refuses(case):
    args, match = bad_inputs()[case]
    if match in ("must be >= 0", "do not hold", "outside"):  # data checks: the kernel's
        with pytest.raises(RuntimeError, match=match):
            ops.kpool_pool_paged(*args)
    else:
        with pytest.raises(ValueError, match=match):
            ops.kpool_pool_paged(*args)


@pytest.mark.parametrize("change,match", [
    (lambda a: (a[0], a[1], a[2].view(1, 4, 8), *a[3:]), "ape must have 2 dims"),
    (lambda a: (a[0].half(), *a[1:]), "index_raw must be float32 or bfloat16"),
    (lambda a: (a[0][..., :12].contiguous(), *a[1:]), "index_raw must be"),
    (lambda a: (a[0][:, :10].contiguous(), *a[1:]), "must divide the block size"),
    (lambda a: (a[0], a[1][:, :3].contiguous(), *a[2:]), "index_pool must be"),
    (lambda a: (a[0], a[1].transpose(0, 1).contiguous().transpose(0, 1), *a[2:]), "index_pool must be contiguous"),
    (lambda a: (*a[:3], a[3].long(), *a[4:]), "block_table must be Int"),
    (lambda a: (*a[:4], a[4][:1], a[5]), "ctx_lens and q_lens must be"),
])
def test_kernel_checks(change, match):
    """The kernel's own TORCH_CHECKs, called without the wrapper."""
    args = change(make_case(1, 4, 8, 16, [0, 4], [9, 5]))
    with pytest.raises(RuntimeError, match=match):
        torch.ops.indexcache.kpool_pool_paged(*args)


def test_opcheck():
    raw, pool, ape, table, c, m = make_case(2, 4, 8, 16, [0, 4], [9, 5])
    pool.zero_()
    torch.library.opcheck(torch.ops.indexcache.kpool_pool_paged.default, (raw, pool, ape, table, c, m))
