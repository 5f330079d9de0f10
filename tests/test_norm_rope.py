"""ops.rms_norm and ops.rope (a decode step's small ops, one CPU pass each) against their
definitions (reference.rms_norm / reference.rope, in float64 here) on every CPU path this machine
runs: every fp32 / bf16 mix, vector tails, strided rows and heads, in place; the AVX-512 and portable
paths bit-identical, 1 and 2 threads bit-identical; every refusal. Then the model: decoding with the
fused ops gives the greedy tokens and logits of the same model through torch's ops."""

import pytest
import torch

from indexcache import _C, ops, reference
from indexcache.models import DeepseekV32ForCausalLM
from indexcache.models.blocks import norms
from indexcache.models.blocks import rope as rope_mod
from indexcache.models.tiny import tiny_config
from indexcache.runtime import generate

DTYPES = [torch.float32, torch.bfloat16]
ISAS = ["auto"] + [name for name, why in _C._cpu_paths().items() if not why]


def within(got, exact, out_dtype, scale):
    """fp32 arithmetic: a few ulps of ``scale`` (the size of the terms), plus one bf16 rounding."""
    tol = scale * 2.0 ** -20 + 1e-30
    if out_dtype == torch.bfloat16:
        tol = tol + exact.abs() * 2.0 ** -8
    err = (got.double() - exact).abs()
    assert bool((err <= tol).all()), float((err / tol).max())


def rms_exact(x, w, eps):
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("n,d", [(1, 1), (1, 15), (3, 16), (2, 17), (5, 512), (37, 100), (300, 512)])
@pytest.mark.parametrize("xd", DTYPES)
@pytest.mark.parametrize("wd", DTYPES)
def test_rms_norm_matches_definition(cpu_isa, n, d, xd, wd):
    g = torch.Generator().manual_seed(n * 1000 + d)
    wide = torch.randn(n, d + 5, generator=g).to(xd)
    x = wide[:, 2:2 + d]  # rows d + 5 apart
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(wd)
    for od in DTYPES:
        out = torch.full((n, d), float("nan"), dtype=od)
        ops.rms_norm(x, w, 1e-6, out=out)
        exact = rms_exact(x, w, 1e-6)
        within(out, exact, od, (exact.abs() + 1e-3) * 4)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.dtype == xd and got.shape == x.shape
    torch.testing.assert_close(got.float(), reference.rms_norm(x, w, 1e-6).float(), rtol=1e-5 if xd == torch.float32
                               else 1e-2, atol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("h,r", [(1, 2), (3, 6), (16, 64), (2, 34), (4, 128), (1, 30)])
@pytest.mark.parametrize("xd", DTYPES)
def test_rope_matches_definition(cpu_isa, interleaved, h, r, xd):
    n = 7
    g = torch.Generator().manual_seed(h * 100 + r)
    wide = torch.randn(n, h, r + 64, generator=g).to(xd)
    x = wide[..., 64:]  # q_pe's layout: the rope part of each head's [nope | rope]
    ang = torch.rand(n, r // 2, generator=g) * 20
    cos, sin = ang.cos() * 1.3, ang.sin() * 1.3
    exact = reference.rope(x.double(), cos.double(), sin.double(), interleaved)
    scale = x.double().abs().amax(-1, keepdim=True) * 1.3 * 4
    for od in DTYPES:
        out = torch.full((n, h, r), float("nan"), dtype=od)
        ops.rope(x, cos, sin, interleaved, out=out)
        within(out, exact, od, scale)
    flat = ops.rope(x[:, 0], cos, sin, interleaved)  # [N, R]
    assert flat.dtype == xd and torch.equal(flat, ops.rope(x, cos, sin, interleaved)[:, 0])
    inplace = x.clone()
    ops.rope(inplace, cos, sin, interleaved, out=inplace)
    assert torch.equal(inplace, ops.rope(x, cos, sin, interleaved))
    torch.testing.assert_close(ops.rope(x, cos, sin, interleaved).float(),
                               reference.rope(x, cos, sin, interleaved).float(), rtol=1e-5, atol=1e-5)


def test_paths_and_threads_bit_identical():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(400, 700, generator=g).bfloat16()
    w = torch.randn(700, generator=g)
    q = torch.randn(300, 16, 64, generator=g)
    ang = torch.rand(300, 32, generator=g) * 9
    results = {}
    threads = torch.get_num_threads()
    try:
        for name in ISAS:
            _C._set_cpu_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                results[name, t] = (ops.rms_norm(x, w, 1e-5), ops.rope(q, ang.cos(), ang.sin(), True),
                                    ops.rope(q, ang.cos(), ang.sin(), False))
    finally:
        _C._set_cpu_isa("auto")
        torch.set_num_threads(threads)
    first = next(iter(results.values()))
    for key, res in results.items():
        assert all(torch.equal(a, b) for a, b in zip(res, first)), key


def test_empty_rows():
    """No rows (a rank or a batch with nothing to do): empty results, not a refusal."""
    for interleaved in (True, False):
        assert ops.rope(torch.empty(0, 4, 64), torch.empty(0, 32), torch.empty(0, 32), interleaved).shape == (0, 4, 64)
    assert ops.rms_norm(torch.empty(0, 16).bfloat16(), torch.ones(16), 1e-6).shape == (0, 16)


def test_refusals():
    x, w = torch.randn(3, 8), torch.randn(8)
    o = torch.ops.indexcache
    with pytest.raises(RuntimeError, match="x must have 2 dims"):
        o.rms_norm(torch.randn(8), w, 1e-6, torch.empty(8))
    with pytest.raises(RuntimeError, match="w must have x's last dim"):
        o.rms_norm(x, torch.randn(7), 1e-6, torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="out must have x's shape"):
        o.rms_norm(x, w, 1e-6, torch.empty(3, 7))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        o.rms_norm(x.half(), w, 1e-6, torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="last dim must be contiguous"):
        o.rms_norm(torch.randn(8, 3).t(), w, 1e-6, torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="eps must be finite"):
        o.rms_norm(x, w, float("nan"), torch.empty(3, 8))
    with pytest.raises(ValueError, match="rms_norm takes x"):
        ops.rms_norm(x, torch.randn(2, 4), 1e-6)
    q, c = torch.randn(3, 2, 8), torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="must be even"):
        o.rope(torch.randn(3, 2, 7), torch.randn(3, 3), torch.randn(3, 3), True, torch.empty(3, 2, 7))
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[N, R / 2\]"):
        o.rope(q, torch.randn(3, 3), torch.randn(3, 3), True, torch.empty(3, 2, 8))
    with pytest.raises(RuntimeError, match="cos must be Float"):
        o.rope(q, c.double(), c, True, torch.empty(3, 2, 8))
    with pytest.raises(RuntimeError, match="sin must be contiguous"):
        o.rope(q, c, torch.randn(4, 3).t(), True, torch.empty(3, 2, 8))
    with pytest.raises(RuntimeError, match="out may be x itself"):
        o.rope(q, c, c, True, q.as_strided((3, 2, 8), (8, 8, 1)))
    with pytest.raises(ValueError, match="rope takes x"):
        ops.rope(torch.randn(8), c, c, True)


def test_opcheck():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 40, generator=g).bfloat16(), torch.randn(40, generator=g)
    q, ang = torch.randn(4, 3, 16, generator=g), torch.rand(4, 8, generator=g)
    torch.library.opcheck(torch.ops.indexcache.rms_norm.default, (x, w, 1e-6, torch.empty(4, 40).bfloat16()))
    torch.library.opcheck(torch.ops.indexcache.rope.default, (q, ang.cos(), ang.sin(), True, torch.empty(4, 3, 16)))


def torch_ops_only(monkeypatch):
    monkeypatch.setattr(norms, "fused_rows", lambda *a: False)
    monkeypatch.setattr(rope_mod, "fused_rows", lambda *a: False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_decodes_as_through_torch_ops(monkeypatch, dtype):
    model = DeepseekV32ForCausalLM.from_config(tiny_config(num_hidden_layers=3, num_nextn_predict_layers=0),
                                               dtype=dtype, seed=31).eval()
    g = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in (20, 45)]
    ids = torch.tensor([prompts[1]])
    fused = generate(model, prompts, 10, stop_tokens=[], decode_step="eager", decode_threads=1).tokens
    logits = model(ids)
    with monkeypatch.context() as m:
        torch_ops_only(m)
        plain = generate(model, prompts, 10, stop_tokens=[], decode_step="eager", decode_threads=1).tokens
        want = model(ids)
    assert fused == plain
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(logits, want, rtol=tol, atol=tol * want.abs().max().item())
