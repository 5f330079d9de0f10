"""block_sparse_attention's lane kernel (csrc/cpu/block_sparse_lanes.h: query vectors across the lanes,
8 on the avx2 path, 16 on the avx512bf16 path for fp32 and for bf16 with odd d) against reference.py on
every CPU path this machine has (DESIGN.md §8): fresh random inputs, poisoned outputs, every element
checked, deterministic. The shapes aim at the kernel's edges: query vectors per block just under, at and
over 8, 16 and 32 lanes (the one-vector tail, the two-vector panels), keys per block around its key
panels (6 / 12, tails of 12 / 24), d that is not a multiple of 16 (the tiles' zero columns, the copy
between calls), rows whose position ends inside a selected block at different keys (a panel's vectors
with different key counts), ragged selections (-1 holes, duplicates, future blocks, rows with none)."""

import math

import pytest
import torch

import indexcache._C as _C
from indexcache import ops
from indexcache import reference as ref

from test_block_sparse import assert_rows_alone_and_one_thread_equal, make_paged
from test_ops import rel_err


def lane_case(dtype, lens, h_q, h_kv, d, block_size, topk, rows_per, seed):
    """Paged K/V of the requests' lengths, the last rows_per positions of each request as query rows
    (every row's last block is causal: it ends at the row), ragged block selections."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, h_kv, d, generator=g).to(dtype) for n in lens]
    kc, table = make_paged(keys, 8, seed=seed)
    vals = torch.randn(kc.shape, generator=g).to(dtype)
    req, pos = [], []
    for b, n in enumerate(lens):
        for j in range(min(rows_per, n)):
            req.append(b)
            pos.append(n - 1 - j * 3 % n)  # positions a few keys apart: they end inside blocks at different keys
    req, pos = torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)
    s_q, nb = len(req), max(lens) // block_size + 2
    q = torch.randn(s_q, h_q, d, generator=g).to(dtype)
    # Every row picks its own block first (the causal edge), then blocks at random: duplicates,
    # -1 holes and blocks past the row (read nothing) included; some rows select nothing.
    blocks = torch.randint(-1, nb, (s_q, h_kv, topk), generator=g, dtype=torch.int32)
    blocks[:, :, 0] = (pos // block_size).view(-1, 1)
    if topk > 2:
        blocks[1::4, :, 2] = blocks[1::4, :, 1]
    blocks[3::11] = -1
    return q, kc, vals, table, req, pos, blocks


def run_poisoned(q, kc, vc, table, req, pos, blocks, block_size, scale):
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], q.shape[1]), math.nan)
    ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, scale, out=(out, lse))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    return out, lse


# (h_q, h_kv, d, block_size, topk, rows_per): rows_per x (h_q / h_kv) query vectors select a block
# at most; the lens below make many rows share each block.
LANE_SHAPES = [
    (1, 1, 128, 16, 4, 7),     # 1 vector per row: 7 vectors a block, under 8 lanes
    (8, 1, 128, 12, 3, 2),     # 16 vectors: one 16-lane vector exactly; 12 keys: one key panel
    (17, 1, 64, 13, 5, 1),     # 17 vectors: a second, nearly empty vector of lanes; 13 keys
    (4, 2, 48, 25, 6, 16),     # up to 32 vectors: two vectors of lanes; d 48: not a multiple of 32
    (3, 1, 40, 24, 4, 11),     # 33 vectors: 32 + a one-vector tail; d 40: not a multiple of 16
    (10, 2, 96, 7, 9, 9),      # 45 vectors; 7 keys: under one key panel
    (48, 3, 16, 40, 5, 3),     # 16 heads a group: 48 vectors; d 16; 40 keys: 24 + 16, 12 x 3 + 4
    (6, 6, 128, 128, 3, 5),    # one head a group, MiniMax-M3's block; 5 vectors
    (2, 1, 200, 1, 12, 30),    # blocks of one key; d 200
]


@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("h_q,h_kv,d,block_size,topk,rows_per", LANE_SHAPES)
def test_lane_kernel_edges(cpu_isa, dtype, bar, h_q, h_kv, d, block_size, topk, rows_per):
    lens = [9 * block_size + 5, 3 * block_size + 1]
    q, kc, vc, table, req, pos, blocks = lane_case(dtype, lens, h_q, h_kv, d, block_size, topk, rows_per,
                                                   seed=h_q * 131 + d * 7 + block_size)
    scale = d ** -0.5
    out, lse = run_poisoned(q, kc, vc, table, req, pos, blocks, block_size, scale)
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, scale)
    assert rel_err(out.float(), e_out.float()) < bar
    finite = torch.isfinite(e_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[~finite] == -math.inf).all() and (out[~finite] == 0).all()
    torch.testing.assert_close(lse[finite], e_lse[finite], rtol=1e-5, atol=1e-5)
    again = ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, scale)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


def lane_paths():
    """The CPU paths that run the lane kernel for fp32 here (each runs it at its own width)."""
    paths = []
    for name in ("avx2", "avx512bf16"):
        if not _C._cpu_paths()[name]:
            _C._set_cpu_isa(name)
            try:
                if _C._cpu_isa("block_sparse_attention", "fp32") == name:
                    paths.append(name)
            finally:
                _C._set_cpu_isa("auto")
    return paths


@pytest.mark.parametrize("h_q,h_kv,d,block_size,topk,rows_per", LANE_SHAPES)
def test_lane_widths_give_the_same_bits(h_q, h_kv, d, block_size, topk, rows_per):
    """Each query vector's arithmetic in the lane kernel is the same sequence at 8 and 16 lanes (dot
    over d ascending, sums over keys ascending, the same exp): the avx2 and avx512bf16 paths' fp32
    results are equal bit for bit, whatever lanes and panels a vector shares at either width."""
    paths = lane_paths()
    if len(paths) < 2:
        pytest.skip(f"cpu path 'avx512bf16': the lane kernel runs at one width here ({paths})")
    lens = [9 * block_size + 5, 3 * block_size + 1]
    args = lane_case(torch.float32, lens, h_q, h_kv, d, block_size, topk, rows_per, seed=h_q + d + block_size)
    got = {}
    for name in paths:
        _C._set_cpu_isa(name)
        try:
            got[name] = run_poisoned(*args, block_size, 0.1)
        finally:
            _C._set_cpu_isa("auto")
    (o8, l8), (o16, l16) = got["avx2"], got["avx512bf16"]
    assert torch.equal(o8, o16) and torch.equal(l8, l16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lane_kernel_threads_and_grouping(cpu_isa, dtype):
    """Many rows of one request share blocks (vectors of several rows in one panel, the paced copy over
    long blocks): one thread, the default threads and each row alone give the same bits."""
    args = (*lane_case(dtype, [1500, 300], 24, 2, 128, 64, 8, 40, seed=7), 64, 0.09)
    out, lse = run_poisoned(*args)
    assert_rows_alone_and_one_thread_equal(args, out, lse, (0, 13, 39, args[0].shape[0] - 1))
