"""bf16 products on a CPU without a native bf16 GEMM (parallel.linear.widen_16bit): prompt-row
projections and the absorbed MLA einsums run as fp32 GEMMs of the widened operands, rounded once to
bf16. Checked against float64 sums of the same bf16 values, on every CPU (the rule is forced both
ways), with ragged weight blocks; the rule itself (dtype, device, gradient) and the model path."""

import pytest
import torch
import torch.nn.functional as F

from indexcache import _C
from indexcache.models import DeepseekV32ForCausalLM
from indexcache.models.blocks.mla import absorb_queries, absorbed_values
from indexcache.models.tiny import tiny_config
from indexcache.parallel import linear as plinear


def bf16_bar(ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|error| allowed: one bf16 rounding of the result (2^-8 relative) plus fp32 sums' error."""
    sums = (x.double().abs() @ w.double().abs().T) * (x.shape[-1] * 2.0 ** -23)
    return ref.abs() * 2.0 ** -8 + sums + 1e-30


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(plinear, "_native_bf16_gemm", lambda: False)


def test_rule_follows_the_cpu_features():
    f = _C._cpu_features()
    native = bool(f["avx512bf16"] or f["amx_bf16"] or f["brgemm_bf16"])
    assert plinear._native_bf16_gemm() is native
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    assert plinear.widen_16bit(x, x) is (not native)


def test_rule_declines_other_dtypes_and_gradients(no_native):
    b = torch.randn(16, 32, dtype=torch.bfloat16)
    assert plinear.widen_16bit(b, b)
    assert not plinear.widen_16bit(b.float(), b)
    assert not plinear.widen_16bit(b.half(), b.half())
    g = b.clone().requires_grad_()
    assert not plinear.widen_16bit(g, b)
    with torch.no_grad():
        assert plinear.widen_16bit(g, b)
    assert not plinear.widen_16bit(b.to("meta"), b.to("meta"))


@pytest.mark.parametrize("rows", [9, 37, 300])
@pytest.mark.parametrize("blocks", [False, True])
def test_linear_widened_matches_float64(no_native, monkeypatch, rows, blocks):
    g = torch.Generator().manual_seed(rows * 131 + blocks)
    k, n = 96, 150
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    if blocks:  # weight blocks as large as x's fp32 copy: 9 and 37 rows (ragged against 150), 300 (one)
        monkeypatch.setattr(plinear, "WIDEN_BLOCK_BYTES", 1)
    out = plinear.linear(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    ref = x.double() @ w.double().T
    assert ((out.double() - ref).abs() <= bf16_bar(ref, x, w)).all()
    if not blocks or rows >= n:  # one block: exactly one widened F.linear, rounded once
        assert torch.equal(out, F.linear(x.float(), w.float()).to(torch.bfloat16))


def test_linear_batched_rows(no_native):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 20, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    out = plinear.linear(x, w)
    assert out.shape == (3, 20, 40)
    assert torch.equal(out, F.linear(x.float(), w.float()).to(torch.bfloat16))


def test_native_cpu_keeps_torchs_bf16_gemm(monkeypatch):
    monkeypatch.setattr(plinear, "_native_bf16_gemm", lambda: True)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(33, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    assert not plinear.widen_16bit(x, w)
    assert torch.equal(plinear.linear(x, w), F.linear(x, w))


def test_absorbed_einsums_widened(no_native):
    g = torch.Generator().manual_seed(7)
    t, h, nope, latent, rope = 20, 4, 32, 64, 16
    q_nope = torch.randn(t, h, nope, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(t, h, rope, generator=g).to(torch.bfloat16)
    w_uk = torch.randn(h, nope, latent, generator=g).to(torch.bfloat16)
    q = absorb_queries(q_nope, q_pe, w_uk)
    ref = torch.einsum("thd,hdc->thc", q_nope.double(), w_uk.double())
    bar = torch.einsum("thd,hdc->thc", q_nope.double().abs(), w_uk.double().abs()) * (nope * 2.0 ** -23)
    assert q.dtype == torch.bfloat16 and torch.equal(q[..., latent:], q_pe)
    assert ((q[..., :latent].double() - ref).abs() <= ref.abs() * 2.0 ** -8 + bar + 1e-30).all()
    out = torch.full_like(q, float("nan"))
    absorb_queries(q_nope, q_pe, w_uk, out=out)
    assert torch.equal(out, q)
    lat = torch.randn(t, h, latent, generator=g).to(torch.bfloat16)
    w_uv = torch.randn(h, nope, latent, generator=g).to(torch.bfloat16)
    o = absorbed_values(lat, w_uv)
    ref = torch.einsum("thc,hdc->thd", lat.double(), w_uv.double())
    bar = torch.einsum("thc,hdc->thd", lat.double().abs(), w_uv.double().abs()) * (latent * 2.0 ** -23)
    assert o.dtype == torch.bfloat16 and ((o.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + bar + 1e-30).all()


def test_bf16_model_prefill_widened_against_fp32_model(monkeypatch):
    """A bf16 model's prompt logits with the widened products stay as close to the fp32 model's
    (same weights rounded to bf16) as with torch's own bf16 GEMM."""
    cfg = tiny_config(num_hidden_layers=2, vocab_size=300)
    m32 = DeepseekV32ForCausalLM.from_config(cfg, dtype=torch.float32, seed=1).eval()
    m16 = DeepseekV32ForCausalLM.from_config(cfg, dtype=torch.bfloat16, seed=1).eval()
    m32.load_state_dict({k: v.float() for k, v in m16.state_dict().items()})
    ids = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = m32(ids).float()
        errs = {}
        for native in (False, True):
            monkeypatch.setattr(plinear, "_native_bf16_gemm", lambda native=native: native)
            errs[native] = ((m16(ids).float() - ref).abs().median() / ref.abs().median()).item()
    assert errs[False] < 3e-2, errs
    assert errs[False] < 2 * errs[True] + 1e-3, errs
