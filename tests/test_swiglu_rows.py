"""ops.swiglu_rows (a few rows through a weighted list of SwiGLU MLPs: a decode step's one-row MoE on
the CPU) against its definition (reference.swiglu_rows) and against a float64 evaluation, on every
CPU path this machine runs, fp32 / bf16 mixes, vector tails, strided rows; bit-equal at 1 and 2
threads; every refused input. Then the model: an MoE and a dense MLP through it give the outputs of
their own op-by-op forward (the fused path switched off)."""

import pytest
import torch
import torch.nn.functional as F

from indexcache import ops, reference
from indexcache.models.blocks import moe as moe_mod

DTYPES = [torch.float32, torch.bfloat16]


def experts_of(gen, d, widths, dtype, scale=0.2):
    return [tuple((torch.randn(*s, generator=gen) * scale).to(dtype) for s in ((i, d), (i, d), (d, i)))
            for i in widths]


def exact(x, experts, coef):
    """The sum in float64 from the rounded intermediates' float64 values: the definition's values
    without its fp32 summation (the bar below covers the roundings)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for (g, u, d), c in zip(experts, coef):
        a = F.silu(x.double() @ g.double().t()) * (x.double() @ u.double().t())
        out += c * (a @ d.double().t())
    return out


def bar(x, experts, coef):
    """|error| allowed: every intermediate rounded to x's dtype (2^-8 relative for bf16, a few fp32
    ulps otherwise) moves each down-projection term by that share of its absolute value."""
    rel = 2.0 ** -6 if x.dtype == torch.bfloat16 else 2.0 ** -16
    tol = torch.zeros(x.shape, dtype=torch.float64)
    for (g, u, d), c in zip(experts, coef):
        ga, ua = x.double().abs() @ g.double().abs().t(), x.double().abs() @ u.double().abs().t()
        tol += abs(c) * ((ga * ua + ga.abs() + ua.abs()) @ d.double().abs().t())
    return tol * rel + 1e-6


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("m,d,widths", [(1, 512, [256, 256, 256]), (3, 70, [33, 17]), (8, 129, [64]), (1, 16, [])])
def test_matches_definition(cpu_isa, x_dtype, w_dtype, m, d, widths):
    gen = torch.Generator().manual_seed(m * 1000 + d + len(widths))
    x = torch.randn(m, d, generator=gen).to(x_dtype)
    experts = experts_of(gen, d, widths, w_dtype)
    coef = torch.randn(len(widths), generator=gen).tolist()
    out = torch.full((m, d), float("nan"))
    ops.swiglu_rows(x, experts, coef, out=out)
    assert torch.isfinite(out).all()
    assert ((out.double() - exact(x, experts, coef)).abs() <= bar(x, experts, coef)).all()
    ref = reference.swiglu_rows(x, experts, coef)
    assert ((out.double() - ref.double()).abs() <= bar(x, experts, coef)).all()
    if not widths:
        assert torch.equal(out, torch.zeros(m, d))


def test_strided_rows_and_out_view(cpu_isa):
    """x rows and out rows a view into wider buffers (last dims contiguous); the rest left alone."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 48, generator=gen).bfloat16()[:, :40]
    experts = experts_of(gen, 40, [24, 8], torch.bfloat16)
    buf = torch.full((3, 45), float("nan"))
    ops.swiglu_rows(x, experts, [0.7, -0.2], out=buf[:, :40])
    ref = reference.swiglu_rows(x.contiguous(), experts, [0.7, -0.2])
    assert ((buf[:, :40].double() - ref.double()).abs() <= bar(x, experts, [0.7, -0.2])).all()
    assert torch.isnan(buf[:, 40:]).all()


def test_thread_count_does_not_change_results():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 1024, generator=gen).bfloat16()
    experts = experts_of(gen, 1024, [4096, 512], torch.bfloat16, 0.05)   # above rows_matmul's one-thread bound
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.swiglu_rows(x, experts, [0.25, 1.0])
        torch.set_num_threads(2)
        two = ops.swiglu_rows(x, experts, [0.25, 1.0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _good():
    x, g, d = torch.ones(1, 8), torch.ones(6, 8), torch.ones(8, 6)
    return x, [g], [g], [d], [1.0], torch.empty(1, 8)


@pytest.mark.parametrize("i,value,msg", [
    (0, torch.ones(1, 8, dtype=torch.int32), "x must be float32 or bfloat16"),
    (0, torch.ones(8), r"x must be \[M, D\]"),
    (0, torch.ones(8, 2).t()[:1], "x's last dim must be contiguous"),
    (1, [torch.ones(6, 8, dtype=torch.float16)], r"gate_w\[0\] must be float32 or bfloat16"),
    (1, [torch.ones(6, 7)], r"gate_w\[0\] and up_w\[0\] must be \[I, 8\]"),
    (2, [torch.ones(5, 8)], r"gate_w\[0\] and up_w\[0\] must be \[I, 8\]"),
    (2, [torch.ones(6, 8), torch.ones(6, 8)], "one entry per expert"),
    (3, [torch.ones(8, 5)], r"down_w\[0\] must be \[8, 6\]"),
    (3, [torch.ones(8, 6, 1)], r"down_w\[0\] must be 2-D"),
    (3, [torch.ones(6, 8).t()], r"down_w\[0\]'s last dim must be contiguous"),
    (4, [1.0, 2.0], "one entry per expert"),
    (5, torch.empty(1, 8).bfloat16(), "out must be float32"),
    (5, torch.empty(2, 8), r"out must be \[1, 8\]"),
    (5, torch.empty(8, 2).t()[:1], "out's last dim must be contiguous"),
])
def test_refusals(i, value, msg):
    args = list(_good())
    args[i] = value
    with pytest.raises(RuntimeError, match=msg):
        torch.ops.indexcache.swiglu_rows(*args)


def test_out_aliasing_x_refused():
    x = torch.ones(1, 8)
    with pytest.raises(RuntimeError, match="out must not share memory with x"):
        torch.ops.indexcache.swiglu_rows(x, [torch.ones(6, 8)], [torch.ones(6, 8)], [torch.ones(8, 6)], [1.0], x)


def test_wrapper_refusals():
    x, g, d = torch.ones(1, 8), torch.ones(6, 8), torch.ones(8, 6)
    with pytest.raises(ValueError, match="one coef per expert"):
        ops.swiglu_rows(x, [(g, g, d)], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"\(gate, up, down\) triple"):
        ops.swiglu_rows(x, [(g, g)], [1.0])


GLM5 = dict(vocab_size=64, hidden_size=96, intermediate_size=160, moe_intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4,
            index_head_dim=16, index_n_heads=2, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1,
            topk_group=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_blocks_equal_their_op_by_op_forward(monkeypatch, dtype):
    """A GLM-5 MoE (routed experts plus the shared one) and its dense MLP at one row through the op,
    against the same blocks with the fused path switched off: the same experts, order and roundings."""
    transformers = pytest.importorskip("transformers")
    from indexcache.models import GlmMoeDsaForCausalLM
    model = GlmMoeDsaForCausalLM.from_config(transformers.GlmMoeDsaConfig(**GLM5).to_dict(), dtype=dtype, seed=3)
    blocks = [m for m in model.modules() if isinstance(m, (moe_mod.MoE, moe_mod.MLP))]
    assert any(isinstance(b, moe_mod.MoE) for b in blocks)
    gen = torch.Generator().manual_seed(5)
    calls = []
    real = ops.swiglu_rows
    monkeypatch.setattr(ops, "swiglu_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        for trial in range(4):
            x = torch.randn(1, GLM5["hidden_size"], generator=gen).to(dtype)
            for b in blocks:
                n = len(calls)
                fused = b(x)
                assert len(calls) == n + 1, "the decode row did not take ops.swiglu_rows"
                with monkeypatch.context() as mp:
                    mp.setattr(moe_mod, "swiglu_sum", lambda *a: None)
                    plain = b(x)
                assert fused.dtype == plain.dtype == dtype
                # the same roundings: fp32 within a few ulps (torch's vectorised exp against libm's in
                # silu), bf16 equal but for an odd rounding flipped by that ulp
                diff = (fused.float() - plain.float()).abs()
                scale = plain.float().abs().max().item()
                if dtype == torch.float32:
                    assert diff.max().item() <= 1e-5 * scale
                else:
                    assert (diff > 0).float().mean().item() <= 0.05 and diff.max().item() <= 2 ** -6 * scale


# ------------------------------------------------------------------ moe_rows: the routing as tensors

def per_row(fn, x, experts, ids, w, first, shared):
    """fn (exact or bar) row by row in float64 over the row's chosen experts of [first, first +
    len(experts)) in any order (the sum's value, not its order), each times its weight, plus the
    shared ones."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        chosen = [(experts[int(e) - first], float(w[m, j])) for j, e in enumerate(ids[m].tolist())
                  if first <= e < first + len(experts)] + [(s, 1.0) for s in shared]
        out[m] = fn(x[m:m + 1], [e for e, _ in chosen], [c for _, c in chosen])[0]
    return out


def by_hand(x, experts, ids, w, first, shared):
    return per_row(exact, x, experts, ids, w, first, shared)


def bound(x, experts, ids, w, first, shared):
    return per_row(bar, x, experts, ids, w, first, shared)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("m,d,n_local,first,n_experts,k,n_shared", [
    (1, 256, 8, 0, 8, 2, 1),     # a decode row: 8 experts, top-2, one shared (the bench's GLM-5)
    (3, 70, 5, 4, 12, 3, 0),     # expert parallel: this rank holds [4, 9) of 12, no shared
    (8, 33, 4, 0, 4, 4, 2),      # every expert chosen, two shared
])
def test_moe_rows_matches_definition(cpu_isa, x_dtype, m, d, n_local, first, n_experts, k, n_shared):
    gen = torch.Generator().manual_seed(m * 100 + d + first)
    x = torch.randn(m, d, generator=gen).to(x_dtype)
    experts = experts_of(gen, d, [24 + 3 * e for e in range(n_local)], x_dtype)
    shared = experts_of(gen, d, [40] * n_shared, x_dtype)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(m)])
    w = torch.rand(m, k, generator=gen) + 0.1
    out = torch.full((m, d), float("nan"))
    ops.moe_rows(x, experts, ids, w, first, n_experts, shared, out=out)
    assert torch.isfinite(out).all()
    tol = bound(x, experts, ids, w, first, shared)
    assert ((out.double() - by_hand(x, experts, ids, w, first, shared)).abs() <= tol).all()
    ref = reference.moe_rows(x, experts, ids, w, first, n_experts, shared)
    assert torch.equal(out, ref) or ((out.double() - ref.double()).abs() <= tol).all()
    # int32 ids and bf16 weights (a bf16 router's): the same experts, the weights widened
    again = ops.moe_rows(x, experts, ids.int(), w.bfloat16(), first, n_experts, shared)
    ref16 = reference.moe_rows(x, experts, ids, w.bfloat16().float(), first, n_experts, shared)
    assert ((again.double() - ref16.double()).abs() <= tol).all()


def test_moe_rows_is_swiglu_rows_in_ascending_id():
    """One row: bit-equal to ops.swiglu_rows over the row's experts sorted by id, then the shared one
    (the eager one-row path, MoE._one_row_fused)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 64, generator=gen).bfloat16()
    experts = experts_of(gen, 64, [32] * 6, torch.bfloat16)
    shared = experts_of(gen, 64, [48], torch.bfloat16)
    ids, w = torch.tensor([[5, 1, 3]]), torch.tensor([[0.5, 0.3, 0.2]])
    got = ops.moe_rows(x, experts, ids, w, 0, 6, shared)
    want = ops.swiglu_rows(x, [experts[1], experts[3], experts[5]] + shared, [0.3, 0.2, 0.5, 1.0])
    assert torch.equal(got, want)


def _moe_good():
    x, g, d = torch.ones(1, 8), torch.ones(6, 8), torch.ones(8, 6)
    return x, [g, g], [g, g], [d, d], torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]), 0, 2, 0, torch.empty(1, 8)


@pytest.mark.parametrize("i,value,msg", [
    (4, torch.tensor([[0, 2]]), r"expert 2 outside \[0, num_experts 2\)"),
    (4, torch.tensor([[-1, 0]]), r"expert -1 outside"),
    (4, torch.tensor([[0, 1]]).float(), "topk_ids must be int64 or int32"),
    (4, torch.tensor([0, 1]), r"topk_ids must be \[1, k\]"),
    (5, torch.tensor([[0.5]]), "topk_weights must be"),
    (5, torch.tensor([[1, 1]]), "topk_weights must be float32 or bfloat16"),
    (6, 1, r"this rank's experts \[1, 3\) must lie in \[0, num_experts 2\)"),
    (8, 3, r"num_shared must lie in \[0, 2\]"),
    (3, [torch.ones(8, 6)], "one entry per expert"),
    (9, torch.empty(1, 8).bfloat16(), "out must be float32"),
])
def test_moe_rows_refusals(i, value, msg):
    args = list(_moe_good())
    args[i] = value
    with pytest.raises(RuntimeError, match=msg):
        torch.ops.indexcache.moe_rows(*args)
    with pytest.raises(ValueError, match="triple"):
        ops.moe_rows(torch.ones(1, 8), [(torch.ones(6, 8),)], torch.tensor([[0]]), torch.ones(1, 1), 0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_moe_sync_free_rows_equal_routed(dtype):
    """The MoE's sync-free decode rows (MoE._rows_fused: the static and compiled steps) against its
    routed form (host-side routing), 1 to 5 rows; the masked form is not taken."""
    transformers = pytest.importorskip("transformers")
    from indexcache.models import GlmMoeDsaForCausalLM
    model = GlmMoeDsaForCausalLM.from_config(transformers.GlmMoeDsaConfig(**GLM5).to_dict(), dtype=dtype, seed=4)
    moe = next(m for m in model.modules() if isinstance(m, moe_mod.MoE))
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for rows in (1, 2, 5):
            x = torch.randn(rows, GLM5["hidden_size"], generator=gen).to(dtype)
            idx, w = moe.gate(x)
            fused = moe._rows_fused(x, idx, w)
            assert fused is not None, "the sync-free rows did not take ops.moe_rows"
            want = moe._routed(x, idx, w) + moe.shared_experts(x).float()
            tol = (2 ** -6 if dtype == torch.bfloat16 else 1e-5) * want.abs().max().item()
            assert (fused - want).abs().max().item() <= tol, rows
