"""block_sparse_attention in bf16 on the blas path's AMX tiles (csrc/cpu/block_sparse_amx.h):
which path runs it, and the shapes its 16-vector x 32-key tiles cut unevenly, against
reference.py on every CPU path this machine has (so the avx512bf16 / portable kernels check the
same cases): partial blocks, rows selecting different blocks, KV groups of 1, 4 and 16 heads, rows
whose position ends inside a block at every tile offset, an inf / NaN value past some rows'
positions inside a tile the others read; outputs poisoned, determinism across groupings and
thread counts."""

import math

import pytest
import torch

import indexcache._C as _C
from indexcache import ops
from indexcache import reference as ref

from test_block_sparse import bf16_p_reference, make_attention
from test_ops import rel_err


def amx_here():
    f = _C._cpu_features()
    return f["amx_bf16"] and f["avx512bf16"] and _C._cpu_paths()["blas"] == ""


def test_blas_path_runs_block_sparse_bf16_where_amx_is():
    """On a CPU with AMX-BF16 (tile state granted) `auto` and `blas` take the AMX kernel for bf16
    attention; fp32 attention goes on to avx512bf16's 16-lane kernel, block_topk to avx512bf16; elsewhere blas
    has no block-sparse kernel."""
    kernels = set(_C._cpu_kernels()["blas"])
    if not amx_here():
        assert "block_sparse_attention/bf16" not in kernels
        assert _C._cpu_isa("block_sparse_attention", "bf16") != "blas"
        return
    assert "block_sparse_attention/bf16" in kernels and "block_sparse_attention/fp32" not in kernels
    assert not {"block_topk/bf16", "block_topk/fp32"} & kernels
    assert _C._cpu_isa("block_sparse_attention", "bf16") == "blas"
    assert _C._cpu_isa("block_sparse_attention", "fp32") == "avx512bf16"
    assert _C._cpu_isa("block_topk", "bf16") == "avx512bf16"
    _C._set_cpu_isa("avx512bf16")
    try:
        assert _C._cpu_isa("block_sparse_attention", "bf16") == "avx512bf16"
    finally:
        _C._set_cpu_isa("auto")


def run_checked(q, kc, vc, table, req, pos, blocks, block_size, scale, bar=4e-4):
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], q.shape[1]), math.nan)
    ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, scale, out=(out, lse))
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    finite = torch.isfinite(e_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[~finite] == -math.inf).all() and (out[~finite] == 0).all()
    torch.testing.assert_close(lse[finite], e_lse[finite], rtol=1e-5, atol=1e-5)
    assert rel_err(out.float(), e_out.float()) < bar
    return out, lse


@pytest.mark.parametrize("g", [1, 4, 16])
@pytest.mark.parametrize("d,block_size", [(128, 128), (64, 40), (96, 64), (40, 16), (128, 77)])
def test_attention_bf16_tile_edges(cpu_isa, g, d, block_size):
    """Rows of two requests, each row's position at a different offset inside its last block (so a
    tile's vectors read 0..block_size keys there, past and short of every 32-key tile), 3..6
    selected blocks per row drawn apart (rows share some blocks, not others), -1 and duplicate ids;
    P kept to ~fp32 accuracy (the bar: bf16_p_reference's rounded P is far outside it)."""
    h_kv = 2 if g < 16 else 1
    lens = [9 * block_size - 5, 3 * block_size + 2]
    q, kc, vc, table, req, pos, _ = make_attention(torch.bfloat16, lens, g * h_kv, h_kv, d, 16, block_size, 6,
                                                   block_size + 3, seed=g * d + block_size)
    gen = torch.Generator().manual_seed(block_size)
    nb = lens[0] // block_size + 1
    topk = 3 + g % 4
    blocks = torch.stack([torch.randperm(nb, generator=gen)[:topk] for _ in range(q.shape[0] * h_kv)]).int()
    blocks = blocks.view(q.shape[0], h_kv, topk)
    # every row also selects its own (causal tail) block, some twice, some rows none at all
    blocks[:, :, 0] = (pos // block_size).int().view(-1, 1)
    blocks[::5, :, 1] = blocks[::5, :, 0]
    blocks[3::11] = -1
    out, lse = run_checked(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5)
    if block_size >= 64:
        rounded = rel_err(bf16_p_reference(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5).float(),
                          ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size,
                                                     d ** -0.5)[0].float())
        assert rounded > 1.2e-3, "the bar would not tell P rounded to bf16 from P kept"
    # each row alone (other tile partners, other groupings) and one thread: bit for bit the same
    for t in (0, 1, block_size, q.shape[0] - 1):
        o1, l1 = ops.block_sparse_attention(q[t:t + 1], kc, vc, table, req[t:t + 1], pos[t:t + 1], blocks[t:t + 1],
                                            block_size, d ** -0.5)
        assert torch.equal(o1[0], out[t]) and torch.equal(l1[0], lse[t]), t
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o2, l2 = ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, block_size, d ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_attention_bf16_value_past_position_inside_a_shared_key_tile(cpu_isa, bad):
    """Rows of one request ending at keys 40, 70, 100 and 127 of block 2 (128 keys) share its value
    tile (4 heads each: one 16-vector tile); a non-finite value at key 80 reaches only the rows at
    keys 100 and 127, though the rows at 40 and 70 share 32-key tiles with them."""
    q, kc, vc, table, req, pos, _ = make_attention(torch.bfloat16, [512], 16, 4, 128, 16, 128, 3, 1, seed=9, dup=False)
    pos = torch.tensor([296, 326, 356, 383], dtype=torch.int32)
    req = torch.zeros(4, dtype=torch.int32)
    q = torch.randn(4, 16, 128).bfloat16()
    blocks = torch.tensor([0, 2, -1], dtype=torch.int32).repeat(4, 4, 1)
    vc[table[0, 336 // 16], 336 % 16, 2, 7] = bad  # key 256 + 80, KV head 2, column 7
    out, lse = ops.block_sparse_attention(q, kc, vc, table, req, pos, blocks, 128, 0.1)
    e_out, e_lse = ref.block_sparse_attention(q, kc, vc, table, req, pos, blocks, 128, 0.1)
    assert torch.isfinite(out[:2]).all() and torch.isfinite(out[:, :8]).all()
    assert not torch.isfinite(out[2:, 8:12, 7]).any()
    assert torch.equal(torch.isfinite(out), torch.isfinite(e_out))
    fin = torch.isfinite(e_out)
    assert rel_err(out[fin].float(), e_out[fin].float()) < 4e-4
    torch.testing.assert_close(lse, e_lse, rtol=1e-5, atol=1e-5)
