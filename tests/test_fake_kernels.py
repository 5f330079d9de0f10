"""The fake kernels (python/indexcache/fake_kernels.py) check dtypes and shapes at trace time.

For every op: a valid call traces under FakeTensorMode (and its outputs have the real op's
shapes and dtypes), and each wrong dtype or shape fails there, with no kernel run; the real
kernel rejects the same arguments (csrc/checks.h), so the fake is never stricter than the op.
torch.compile with a wrong shape fails while tracing (a dynamo error, not the kernel's).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from indexcache import ops

from test_ops import causal_windows, make_indexer_inputs, make_mla

o = torch.ops.indexcache
I32 = torch.int32


def _i32(*vals):
    return torch.tensor(vals, dtype=I32)


def _indexer_cases():
    q, k, k_scale, w = make_indexer_inputs(3, 40, 8, "cpu", "bf16")
    qf, kf, ksf, wf = make_indexer_inputs(3, 40, 8, "cpu", "fp8")
    ks, ke = causal_windows(3, 40, "cpu")
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    table, lens = torch.tensor([[0, 1]], dtype=I32), _i32(70)
    qp, wp = qf[:2].contiguous(), wf[:2].contiguous()
    topk_buf = torch.empty(5, 6, dtype=I32)
    return [
        (o.fill_topk_buffer_, (torch.empty(4, 8, dtype=I32), 3),
         [(0, torch.empty(4, 8), "topk buffer must be torch.int32"), (1, 5, r"num_rows=5 must be in \[0, 4\]")]),
        (o.quantize_fp8, (torch.randn(2, 128), 1e-4, False),
         [(0, torch.randn(2, 100), "last dim must be a multiple of 128"), (0, torch.randn(2, 128).half(), "x must be")]),
        (o.index_k_cache_insert, (torch.randn(3, 128), torch.tensor([0, 5, -1]), cache, False),
         [(0, torch.randn(3, 64), r"k must be \[n, 128\]"), (1, _i32(0, 5, -1), "slot_mapping must be torch.int64"),
          (1, torch.tensor([0, 5]), "slot_mapping has 2 entries for 3 rows"),
          (2, torch.zeros(2, 100, dtype=torch.uint8), "block_size \\* 132 bytes")]),
        (o.indexer_logits, (q, k, k_scale, w, ks, ke, torch.empty(3, 40)),
         [(1, k.float(), "k must be torch.bfloat16"), (3, w[:2].contiguous(), r"weights must be \[s_q, h\] = \[3, 8\]"),
          (5, ke[:2].contiguous(), "ke has 2 entries for 3 rows"), (6, torch.empty(3, 39), "columns but the keys need 40")]),
        (o.indexer_logits, (qf, kf, ksf, wf, ks, ke, torch.empty(3, 40)),
         [(2, None, r"fp8 k needs k_scale"), (2, ksf[:5].contiguous(), r"k_scale must be \[40\]")]),
        (o.topk_indices, (torch.randn(3, 40), ks, ke, 4, torch.empty(3, 4, dtype=I32)),
         [(0, torch.randn(3, 40).double(), "logits must be torch.float32"), (3, 5, "topk=5 exceeds"),
          (4, torch.empty(2, 4, dtype=I32), "3 tokens exceed the topk buffer's 2 rows")]),
        (o.indexer_topk, (qf, kf, ksf, wf, ks, ke, 4, topk_buf),
         [(0, qf[..., :64].contiguous(), "need one head width d"), (6, 0, "topk must be >= 1")]),
        (o.indexer_logits_paged, (qp, wp, cache, table, lens, 2, torch.empty(2, 70)),
         [(0, qp.float(), "q must be torch.float8_e4m3fn"), (5, 3, "expected batch \\* next_n = 1 \\* 3"),
          (4, _i32(70, 3), "seq_lens has 2 entries for 1 rows")]),
        (o.indexer_topk_paged, (qp, wp, cache, table, lens, 2, 8, torch.empty(2, 8, dtype=I32)),
         [(3, table[0].contiguous(), "block_table must have 2 dims"), (5, 0, "next_n must be >= 1")]),
    ]


def _mla_cases():
    mcache, idx = make_mla("cpu", "bf16", 2, 4, 8, blocks=1)
    qm = torch.randn(2, 4, 576).bfloat16()
    out, lse = torch.empty(2, 4, 512, dtype=torch.bfloat16), torch.empty(2, 4)
    q = torch.randn(3, 2, 16)
    k = torch.randn(10, 16)
    ks, ke = torch.zeros(3, dtype=I32), _i32(4, 8, 10)
    pcache = torch.randn(3, 8, 16)
    qa = torch.randn(4, 4, 16)
    kv = torch.randn(3, 8, 2, 16)
    return [
        (o.positions_to_slots, (torch.tensor([[1, -1]], dtype=I32), torch.zeros(1, dtype=I32), torch.tensor([[1]], dtype=I32),
                                64, 2, torch.empty(1, 2, dtype=I32)),
         [(0, torch.tensor([[1, -1]]), "positions must be torch.int32"), (3, 0, "block_size must be >= 1"),
          (5, torch.empty(2, 1, dtype=I32), "slots must have positions' shape")]),
        (o.mla_kv_cache_insert, (torch.randn(2, 512), torch.randn(2, 64), torch.tensor([0, 3]), mcache.clone()),
         [(1, torch.randn(2, 32), r"k_pe must be \[2, 64\]"), (1, torch.randn(2, 64).bfloat16(), "k_pe must be torch.float32"),
          (3, torch.zeros(1, 64, 600, dtype=torch.uint8), "rows of 656 bytes"),
          (3, torch.zeros(1, 64, 520), "must fill the MLA cache's rows")]),
        (o.sparse_mla, (qm, mcache, idx, 0.1, 512, out, lse, torch.randn(4), None),
         [(0, torch.randn(2, 4, 320).bfloat16(), r"\(absorbed DSA\)"), (2, idx.long(), "indices must be torch.int32"),
          (5, torch.empty(2, 4, 256, dtype=torch.bfloat16), r"out must be \[2, 4, 512\]"),
          (6, torch.empty(2, 5), r"lse must be \[2, 4\]"), (4, 100, "d_v must be a multiple of 64"),
          (7, torch.randn(5), r"sinks must be \[h_q\] = \[4\]"), (8, idx[:1].contiguous(), "extra_indices has 1 rows for 2")]),
        (o.block_topk, (q, k, ks, ke, 4, 1, torch.empty(3, 2, 2, dtype=I32)),
         [(1, torch.randn(10, 8), "k must be \\[s_kv, d\\] with q's d = 16"), (6, torch.empty(3, 1, 2, dtype=I32), "out must be"),
          (5, -1, "local_blocks must be >= 0")]),
        (o.block_topk_paged, (q[:2].contiguous(), pcache, torch.tensor([[0, 2]], dtype=I32), _i32(12), 2, 4, 1,
                              torch.empty(2, 2, 3, dtype=I32)),
         [(1, pcache.bfloat16(), "k_cache must be torch.float32"), (4, 1, "q has 2 rows; expected batch \\* next_n = 1 \\* 1")]),
        (o.block_sparse_attention, (qa, kv, kv.clone(), torch.tensor([[0, 1, 2]], dtype=I32), torch.zeros(4, dtype=I32),
                                    _i32(0, 1, 2, 3), torch.zeros(4, 2, 2, dtype=I32), 8, 0.25, torch.empty_like(qa),
                                    torch.empty(4, 4)),
         [(2, kv[:2].clone(), "v_cache must have k_cache's shape"), (0, torch.randn(4, 3, 16), "multiple of the cache's 2"),
          (6, torch.zeros(4, 1, 2, dtype=I32), r"blocks must be \[s_q, h_kv, topk\]"),
          (10, torch.empty(4, 3), r"lse must be \[s_q, h_q\] = \[4, 4\]")]),
    ]


def _delta_rule_cases():
    T, h_k, h_v, d_k, d_v = 7, 2, 4, 8, 4
    q, k, v = torch.randn(T, h_k, d_k), torch.randn(T, h_k, d_k), torch.randn(T, h_v, d_v)
    g, beta, state = -torch.rand(T, h_v, d_k), torch.rand(T, h_v), torch.zeros(3, h_v, d_k, d_v)
    cu, si = _i32(0, 3, 7), _i32(2, 0)
    return [
        (o.delta_rule, (q, k, v, g, beta, state, cu, si, 0.5, torch.empty(T, h_v, d_v)),
         [(1, k.bfloat16(), "k must be torch.float32"), (2, torch.randn(T, 3, d_v), r"multiple of q and k's"),
          (3, torch.randn(T, h_v, 5), r"g must be \[T, h_v\] = \[7, 4\] or"), (4, torch.rand(T, 1), "beta must be"),
          (5, torch.zeros(3, h_v, d_k, 5), r"state must be \[n_slots, h_v, d_k, d_v\]"),
          (7, _i32(0), "state_indices must be a contiguous 1-d tensor of batch = 2"),
          (9, torch.empty(T, h_v, 5), "out must have v's shape")]),
    ]


def _rows_matmul_cases():
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(5, 8).bfloat16()
    return [
        (o.rows_matmul, (x, w, True, torch.empty(2, 5)),
         [(0, x.int(), "x must be"), (1, torch.randn(5, 7), "does not take x's K = 8"),
          (1, torch.randn(1, 5, 8), "same number of dims"), (3, torch.empty(2, 6), r"out must be \[.., 2, 5\]")]),
        (o.rows_matmul, (torch.randn(3, 2, 8), torch.randn(3, 8, 4), False, torch.empty(3, 2, 4)),
         [(1, torch.randn(3, 5, 4), "does not take x's K = 8"), (3, torch.empty(3, 2, 5), "out must be")]),
    ]


def _swiglu_rows_cases():
    x, g, d = torch.randn(1, 8).bfloat16(), torch.randn(6, 8).bfloat16(), torch.randn(8, 6).bfloat16()
    return [
        (o.swiglu_rows, (x, [g, g], [g, g], [d, d], [0.5, 1.0], torch.empty(1, 8)),
         [(0, x.half(), "x must be"), (1, [g, torch.randn(6, 7)], r"gate_w\[1\] and up_w\[1\] must be"),
          (3, [d, torch.randn(8, 5)], r"down_w\[1\] must be"), (4, [0.5], "one entry per expert"),
          (5, torch.empty(1, 8).bfloat16(), "out must be float32"), (5, torch.empty(2, 8), "out must be")]),
        (o.moe_rows, (x, [g, g], [g, g], [d, d], torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]]), 0, 2, 1,
                      torch.empty(1, 8)),
         [(0, x.half(), "x must be"), (1, [g, torch.randn(6, 7)], r"gate_w\[1\] and up_w\[1\] must be"),
          (4, torch.tensor([1, 0]), "topk_ids must be"), (5, torch.tensor([[0.5]]), "topk_weights must be"),
          (4, torch.tensor([[1.0, 0.0]]), "topk_ids must be"), (8, 3, "num_shared must lie in"),
          (9, torch.empty(1, 8).bfloat16(), "out must be float32")]),
    ]


def _norm_rope_cases():
    x, w = torch.randn(3, 8).bfloat16(), torch.randn(8)
    q, c = torch.randn(3, 2, 8), torch.randn(3, 4)
    return [
        (o.rms_norm, (x, w, 1e-6, torch.empty(3, 8).bfloat16()),
         [(0, x.half(), "x must be"), (0, torch.randn(8), "x must have 2 dims"),
          (1, torch.randn(7), "w must have x's last dim"), (3, torch.empty(3, 7), "out must have x's shape")]),
        (o.rope, (q, c, c, True, torch.empty(3, 2, 8)),
         [(0, torch.randn(3, 8), "x must have 3 dims"), (0, torch.randn(3, 2, 7), "must be even"),
          (1, c.double(), "cos must be"), (2, torch.randn(3, 3), r"cos and sin must be \[N, R / 2\]"),
          (4, torch.empty(3, 2, 6), "out must have x's shape")]),
    ]


def _kpool_pool_cases():
    raw, pool, ape = torch.randn(6, 16, 16), torch.zeros(6, 4, 8), torch.randn(4, 8)
    table, lens = torch.arange(6, dtype=torch.int32).view(2, 3), _i32(5, 9)
    return [
        (o.kpool_pool_paged, (raw, pool, ape, table, lens, lens),
         [(0, raw.half(), "index_raw must be"), (0, torch.randn(6, 16, 12), "index_raw must be"),
          (2, torch.randn(3, 8), "must divide the block size"), (1, torch.zeros(6, 3, 8), "index_pool must be"),
          (3, table.long(), "block_table must be"), (4, _i32(0), "ctx_lens and q_lens must be")]),
    ]


CASES = [*_indexer_cases(), *_mla_cases(), *_delta_rule_cases(), *_rows_matmul_cases(), *_swiglu_rows_cases(),
         *_norm_rope_cases(),
         *_kpool_pool_cases()]


def _fake_call(op, args):
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                [mode.from_tensor(t) for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor) else a
                for a in args]
        return op(*fake)


def _replaced(args, i, value):
    args = list(args)
    args[i] = value
    return tuple(args)


def test_every_op_is_covered():
    """Every op of the library has a case here but the error word, whose fake has no argument to
    check (tests/test_cuda_checks.py traces it)."""
    library = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("indexcache::")}
    assert {c[0]._qualified_op_name for c in CASES} | {"indexcache::cuda_error_word"} == library


@pytest.mark.parametrize("op,args,bad", CASES, ids=[c[0]._qualified_op_name.split("::")[1] + f"-{i}" for i, c in enumerate(CASES)])
def test_fake_accepts_the_valid_call_and_rejects_each_bad_one(op, args, bad):
    got = _fake_call(op, args)
    if op is o.quantize_fp8:
        want = op(*args)
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    else:
        assert got is None
    for i, value, msg in bad:
        wrong = _replaced(args, i, value)
        with pytest.raises(RuntimeError, match=msg):
            _fake_call(op, wrong)
        with pytest.raises(RuntimeError):  # the kernel rejects it too: the fake is not stricter
            op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in wrong])


def test_torch_compile_rejects_a_wrong_shape_while_tracing():
    """A wrong shape meets the fake at trace time: dynamo's error, before any kernel runs."""
    mcache, idx = make_mla("cpu", "bf16", 2, 4, 8, blocks=1)

    def attend(q, out):
        return ops.sparse_mla(q, mcache, idx, 0.1, out=out)

    q = torch.randn(2, 4, 576).bfloat16()
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=r"out must be \[2, 4, 512\]"):
        torch.compile(attend, fullgraph=True, backend="eager")(q, torch.empty(2, 4, 256, dtype=torch.bfloat16))
    torch._dynamo.reset()
