"""ops.rows_matmul (a few rows through a weight: decode projections on the CPU) against its
definition (reference.rows_matmul, in float64 here) on every CPU path this machine runs, both weight
layouts, strided per-head views, every fp32 / bf16 mix, sizes with vector tails; its results at 1
and 2 threads bit-equal; every refused input. Then the model: decoding through it (parallel.linear's
few-rows dispatch, the absorbed MLA heads, the one-row MoE) gives the greedy tokens and logits of
the same model decoding through torch's matmul, on fresh random DeepSeek-V3.2 and GLM-5 models."""

import pytest
import torch

from indexcache import _C, ops, reference
from indexcache.models import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from indexcache.models.tiny import tiny_config
from indexcache.parallel import linear as plinear
from indexcache.runtime import generate

DTYPES = [torch.float32, torch.bfloat16]


def exact(x, w, w_nk):
    wf = w.double().transpose(-1, -2) if w_nk else w.double()
    return torch.matmul(x.double(), wf)


def bar(out_dtype, x, w, w_nk):
    """|error| allowed per element: fp32 sums of K products (a few ulps of the absolute sum), plus
    one rounding to bf16 when out is bf16."""
    absum = exact(x.abs(), w.abs(), w_nk)
    k = x.shape[-1]
    tol = absum * (k * 2.0 ** -23) + 1e-30
    if out_dtype == torch.bfloat16:
        tol = tol + exact(x, w, w_nk).abs() * 2.0 ** -8
    return tol


@pytest.mark.parametrize("w_nk", [True, False])
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 512, 256), (3, 70, 67), (8, 33, 129), (13, 1, 5), (1, 256, 4096)])
def test_matches_definition(cpu_isa, w_nk, x_dtype, w_dtype, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    w = torch.randn(*((n, k) if w_nk else (k, n)), generator=g).to(w_dtype)
    for out_dtype in DTYPES:
        out = torch.full((m, n), float("nan"), dtype=out_dtype)
        ops.rows_matmul(x, w, w_nk, out=out)
        want = exact(x, w, w_nk)
        assert torch.isfinite(out).all()
        assert ((out.double() - want).abs() <= bar(out_dtype, x, w, w_nk)).all()
        ref = reference.rows_matmul(x, w, w_nk, out_dtype)
        assert ref.dtype == out.dtype and ref.shape == out.shape


@pytest.mark.parametrize("w_nk", [True, False])
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_row_alone_equals_row_in_a_batch(cpu_isa, w_nk, x_dtype, w_dtype):
    """A row's sum order does not depend on the rows beside it: M rows in one call (the AVX-512 kernel
    passes over each weight row with up to 8 of them, then the rest) equal each row through the op
    alone, bit for bit; sizes with vector tails (K = 200: 32- and 16-lane steps)."""
    g = torch.Generator().manual_seed(11)
    for m in (2, 5, 8, 11):
        x = torch.randn(m, 200, generator=g).to(x_dtype)
        w = torch.randn(*((300, 200) if w_nk else (200, 300)), generator=g).to(w_dtype)
        out = torch.full((m, 300), float("nan"), dtype=x_dtype)
        ops.rows_matmul(x, w, w_nk, out=out)
        for i in range(m):
            assert torch.equal(out[i:i + 1], ops.rows_matmul(x[i:i + 1], w, w_nk)), (m, i)


@pytest.mark.parametrize("w_nk", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_views(cpu_isa, w_nk, dtype):
    """The absorbed-MLA forms: x a transposed view [H, N, K] of [N, H, K] rows, w a slice of a
    wider per-head weight, out a transposed view into a wider buffer (the rest left alone)."""
    g = torch.Generator().manual_seed(7)
    n, h, k, nout = 3, 4, 40, 24
    x = torch.randn(n, h, k + 8, generator=g).to(dtype)[..., :k]       # [N, H, K], last dim contiguous
    wide = torch.randn(h, 2 * nout if w_nk else 2 * k, k if w_nk else nout, generator=g).to(dtype)
    w = wide[:, :nout] if w_nk else wide[:, :k]
    buf = torch.full((n, h, nout + 5), float("nan"), dtype=dtype)
    ops.rows_matmul(x.transpose(0, 1), w, w_nk, out=buf[..., :nout].transpose(0, 1))
    want = exact(x.transpose(0, 1), w, w_nk).transpose(0, 1)
    got = buf[..., :nout]
    assert ((got.double() - want).abs() <= bar(dtype, x.transpose(0, 1), w, w_nk).transpose(0, 1)).all()
    assert torch.isnan(buf[..., nout:]).all()


def test_thread_count_does_not_change_results():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 512, generator=g).bfloat16()
    w = torch.randn(8192, 512, generator=g).bfloat16()   # above the one-thread work bound
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.rows_matmul(x, w, True, out_dtype=torch.float32)
        torch.set_num_threads(2)
        two = ops.rows_matmul(x, w, True, out_dtype=torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


# One decode row through the bench checkpoint's projections (N, K; bench/bench_rows_matmul.py) and
# its absorbed-MLA heads (G, K, N): the shapes a step runs at, below and above the one-thread bound.
DECODE_SHAPES = [(4096, 256), (256, 512), (576, 512), (2048, 512), (50260, 512)]
HEAD_SHAPES = [(16, 64, 512), (16, 512, 64)]


def _at_threads(n, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("n,k", DECODE_SHAPES)
def test_decode_rows_at_one_and_two_threads(cpu_isa, w_dtype, n, k):
    """Bit-equal at 1 and 2 threads on every path, and within the fp32 bar of reference.rows_matmul."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).to(w_dtype)

    def call():
        out = torch.full((1, n), float("nan"))
        return ops.rows_matmul(x, w, True, out=out)
    one, two = _at_threads(1, call), _at_threads(2, call)
    assert torch.equal(one, two)
    ref = reference.rows_matmul(x, w, True, torch.float32)
    assert ((one.double() - ref.double()).abs() <= 2 * bar(torch.float32, x, w, True)).all()


@pytest.mark.parametrize("g_,k,n", HEAD_SHAPES)
def test_decode_heads_at_one_and_two_threads(cpu_isa, g_, k, n):
    """The absorbed heads' [H, 1, K] x [H, K, N] (w [K, N] per head), bf16 out."""
    gen = torch.Generator().manual_seed(k * n)
    x = torch.randn(g_, 1, k, generator=gen).bfloat16()
    w = torch.randn(g_, k, n, generator=gen).bfloat16()

    def call():
        out = torch.full((g_, 1, n), float("nan"), dtype=torch.bfloat16)
        return ops.rows_matmul(x, w, False, out=out)
    one, two = _at_threads(1, call), _at_threads(2, call)
    assert torch.equal(one, two)
    ref = reference.rows_matmul(x, w, False, torch.float32)
    assert ((one.double() - ref.double()).abs() <= 2 * bar(torch.bfloat16, x, w, False)).all()


def test_empty_sums_are_zero():
    out = torch.full((2, 3), float("nan"))
    ops.rows_matmul(torch.empty(2, 0), torch.empty(3, 0), True, out=out)
    assert torch.equal(out, torch.zeros(2, 3))


@pytest.mark.parametrize("args,msg", [
    ((torch.ones(2, 4, dtype=torch.int32), torch.ones(3, 4), True), "x must be float32 or bfloat16"),
    ((torch.ones(2, 4), torch.ones(3, 4, dtype=torch.float16), True), "w must be float32 or bfloat16"),
    ((torch.ones(4), torch.ones(3, 4), True), r"x must be \[M, K\] or \[G, M, K\]"),
    ((torch.ones(2, 4), torch.ones(1, 3, 4), True), "same number of dims"),
    ((torch.ones(2, 4), torch.ones(3, 5), True), "does not take x's K = 4"),
    ((torch.ones(2, 4), torch.ones(5, 3), False), "does not take x's K = 4"),
    ((torch.ones(2, 2, 4), torch.ones(3, 3, 4), True), "need the same G"),
    ((torch.ones(4, 2).t(), torch.ones(3, 4), True), "x's last dim must be contiguous"),
    ((torch.ones(2, 4), torch.ones(4, 3).t(), True), "w's last dim must be contiguous"),
])
def test_refusals(args, msg):
    """The op's own checks (an out of the right shape given, so only the named input is wrong)."""
    x, w, w_nk = args
    out = torch.empty(*x.shape[:-1], w.shape[-2] if w_nk else w.shape[-1]) if x.dim() >= 2 else torch.empty(3)
    with pytest.raises(RuntimeError, match=msg):
        torch.ops.indexcache.rows_matmul(x, w, w_nk, out)


def test_wrapper_refuses_mismatched_dims():
    with pytest.raises(ValueError, match="x \\[M, K\\] with w 2-D"):
        ops.rows_matmul(torch.ones(4), torch.ones(3, 4))
    with pytest.raises(ValueError, match="x \\[G, M, K\\] with w 3-D"):
        ops.rows_matmul(torch.ones(1, 2, 4), torch.ones(3, 4))


def test_out_shape_and_dtype_refused():
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    with pytest.raises(RuntimeError, match=r"out must be \[.., 2, 3\]"):
        ops.rows_matmul(x, w, True, out=torch.empty(2, 4))
    with pytest.raises(RuntimeError, match="out must be float32 or bfloat16"):
        ops.rows_matmul(x, w, True, out=torch.empty(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="out's last dim must be contiguous"):
        ops.rows_matmul(x, w, True, out=torch.empty(3, 2).t())


def test_linear_dispatch():
    """parallel.linear: decode rows take the op (when this CPU has its kernel), more rows or a
    gradient to record take F.linear; both give x W^T."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 32, generator=g)
    for rows in (1, plinear.FEW_ROWS, plinear.FEW_ROWS + 1):
        x = torch.randn(rows, 32, generator=g)
        torch.testing.assert_close(plinear.linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    fast = _C._cpu_isa("rows_matmul", "fp32") in ("avx512bf16", "avx2")  # the vectorised kernels
    assert plinear.few_rows(torch.ones(1, 32), w) == fast
    assert not plinear.few_rows(torch.ones(plinear.FEW_ROWS + 1, 32), w)
    assert not plinear.few_rows(torch.ones(1, 32, requires_grad=True), w)
    y = plinear.linear(torch.ones(1, 32, requires_grad=True), w)
    assert y.requires_grad  # autograd went through F.linear


# GLM-5 at the production latent widths (512 + 64, index heads of 128: the native kernels run)
GLM5 = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            kv_lora_rank=512, q_lora_rank=48, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=24, index_topk=16,
            index_head_dim=128, index_n_heads=4, first_k_dense_replace=1, max_position_embeddings=1024,
            routed_scaling_factor=2.5, n_group=1, topk_group=1)


def models(seed: int, dtype):
    v32 = DeepseekV32ForCausalLM.from_config(tiny_config(num_hidden_layers=3, num_nextn_predict_layers=0),
                                             dtype=dtype, seed=seed)
    transformers = pytest.importorskip("transformers")
    glm = GlmMoeDsaForCausalLM.from_config(transformers.GlmMoeDsaConfig(**GLM5).to_dict(), dtype=dtype, seed=seed)
    return [v32.eval(), glm.eval()]


def decode(model, prompts, n, monkeypatch, few: int):
    monkeypatch.setattr(plinear, "FEW_ROWS", few)
    res = generate(model, prompts, n, stop_tokens=[], decode_step="eager", decode_threads=1)
    return res.tokens


def step_logits(model, prompt, monkeypatch, few: int):
    """fp32 logits of one decode row after ``prompt`` (prefill through torch's GEMM either way)."""
    from indexcache.models.state import BatchMeta
    monkeypatch.setattr(plinear, "FEW_ROWS", few)
    cache = model.allocate_cache(4)
    cache.manager.allocate(0, len(prompt) + 1)
    with torch.no_grad():
        meta = BatchMeta.paged_batch(cache, [0], [0], [len(prompt) - 1])
        model.forward_tokens(torch.tensor(prompt[:-1]), meta, cache)
        meta = BatchMeta.paged_batch(cache, [0], [len(prompt) - 1], [1])
        return model.compute_logits(model.forward_tokens(torch.tensor(prompt[-1:]), meta, cache))


@pytest.mark.parametrize("seed", [11, 12])
def test_decode_tokens_equal_torch_matmul_fp32(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    for model in models(seed, torch.float32):
        prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in (40, 90)]
        fast = decode(model, prompts, 12, monkeypatch, 8)
        slow = decode(model, prompts, 12, monkeypatch, 0)
        assert fast == slow
        fast = decode(model, prompts[:1], 12, monkeypatch, 8)   # one request: the one-row MoE
        slow = decode(model, prompts[:1], 12, monkeypatch, 0)
        assert fast == slow
        a, b = step_logits(model, prompts[1], monkeypatch, 8), step_logits(model, prompts[1], monkeypatch, 0)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


@pytest.mark.parametrize("seed", [21, 22])
def test_decode_logits_close_to_torch_matmul_bf16(monkeypatch, seed):
    g = torch.Generator().manual_seed(seed)
    for model in models(seed, torch.bfloat16):
        prompt = torch.randint(0, model.args.vocab_size, (70,), generator=g).tolist()
        a, b = step_logits(model, prompt, monkeypatch, 8), step_logits(model, prompt, monkeypatch, 0)
        assert torch.isfinite(a).all()
        # bf16 activations round at every projection either way; the two differ by those roundings.
        # How far apart two correct bf16 runs land depends on torch's GEMM: on an AMX Xeon (oneDNN's
        # tile kernels) seed 21's V3.2 model is 0.0245 apart while torch's own bf16 run is 0.033 from
        # the same weights in fp32 (2026-12-03); a wrong row or weight moves the logits by O(1).
        assert (a - b).norm() <= 4e-2 * b.norm()
