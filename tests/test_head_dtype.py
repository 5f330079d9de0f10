"""The LM heads' storage dtype (formats.FP32_HEADS, parallel.vocab.head_dtype): a bf16 model holds
them bf16 when its checkpoint stores them bf16, anything else fp32; logits are fp32 sums either way.

Checked against float64 sums of the same bf16 values (decode rows through ops.rows_matmul, prompt
rows through the block-widening F.linear), against the same model with its head widened to fp32
(what every model held before), greedy tokens included, and across save / load."""

import pytest
import torch

from indexcache.models import DeepseekV32ForCausalLM
from indexcache.models.tiny import tiny_config
from indexcache.parallel import head_dtype
from indexcache.parallel import linear as plinear
from indexcache.runtime import generate

CFG = tiny_config(num_hidden_layers=3, num_nextn_predict_layers=1, vocab_size=700)


def model(dtype, seed=0):
    return DeepseekV32ForCausalLM.from_config(CFG, dtype=dtype, seed=seed).eval()


def heads(m):
    return [m.lm_head.weight] + [layer.shared_head.head.weight for layer in m.mtp_layers]


def sum_bar(x, w):
    """|error| allowed per logit: fp32 sums of K products, a few ulps of the absolute sum."""
    return (x.double().abs() @ w.double().abs().T) * (x.shape[-1] * 2.0 ** -23) + 1e-30


def test_head_dtype_rule():
    assert head_dtype(torch.bfloat16) == torch.bfloat16
    assert head_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    for stored in (torch.float32, torch.float16):
        assert head_dtype(torch.bfloat16, stored) == torch.float32
    for dt in (torch.float32, torch.float16):
        assert head_dtype(dt) == torch.float32 and head_dtype(dt, torch.bfloat16) == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_built_heads_and_fp32_params(dtype):
    m = model(dtype)
    assert m.dtype == dtype and len(heads(m)) == 2
    assert all(h.dtype == head_dtype(dtype) for h in heads(m))
    layer = m.model.layers[0]
    assert layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert m.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert m.model.layers[0].self_attn.q_a_proj.weight.dtype == dtype


def test_loaded_heads_follow_the_checkpoint(tmp_path):
    bf = model(torch.bfloat16, seed=3)
    bf.save_pretrained(tmp_path / "bf16")
    back = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    for a, b in zip(heads(back), heads(bf)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    f32 = model(torch.float32, seed=3)
    f32.save_pretrained(tmp_path / "f32")  # heads written in the model dtype: fp32
    back = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16)
    assert back.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    for a, b in zip(heads(back), heads(f32)):
        assert a.dtype == torch.float32 and torch.equal(a, b)  # not rounded through bf16
    back = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    assert all(h.dtype == torch.float32 for h in heads(back))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_bf16_head_logits_are_fp32_sums(monkeypatch, rows):
    monkeypatch.setattr(plinear, "WIDEN_BLOCK_BYTES", 97 * CFG["hidden_size"] * 4)  # ragged blocks of 97 rows
    m = model(torch.bfloat16, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    h = torch.randn(rows, CFG["hidden_size"], generator=g).bfloat16()
    got = m.compute_logits(h)
    w = m.lm_head.weight
    assert got.dtype == torch.float32 and got.shape == (rows, CFG["vocab_size"])
    err = (got.double() - h.double() @ w.double().T).abs()
    assert bool((err <= sum_bar(h, w)).all()), float(err.max())


def test_linear_widens_in_blocks(monkeypatch):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 12, 64, generator=g).bfloat16()
    w = torch.randn(300, 64, generator=g).bfloat16()
    want = x.double() @ w.double().T
    for block_rows in (1, 7, 64, 299, 300, 1000):
        monkeypatch.setattr(plinear, "WIDEN_BLOCK_BYTES", block_rows * 64 * 4)
        got = plinear.linear(x, w, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == (2, 12, 300)
        assert bool(((got.double() - want).abs() <= sum_bar(x, w)).all()), block_rows
    wg = w.float().requires_grad_(False)
    xg = x.float().requires_grad_(True)
    y = plinear.linear(xg, w, out_dtype=torch.float32)  # autograd: widened whole
    y.sum().backward()
    torch.testing.assert_close(xg.grad, wg.sum(0).expand_as(xg), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("seed", [21, 22])
def test_bf16_head_decodes_as_the_fp32_head(seed):
    """The same bf16 model with its head widened to fp32 (exactly the same values): the same greedy
    tokens, decode and prompt logits equal up to summation order."""
    a, b = model(torch.bfloat16, seed), model(torch.bfloat16, seed)
    for h in heads(b):
        h.data = h.data.float()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist() for n in (30, 70)]
    ta = generate(a, prompts, 10, stop_tokens=[], decode_step="eager", decode_threads=1).tokens
    tb = generate(b, prompts, 10, stop_tokens=[], decode_step="eager", decode_threads=1).tokens
    assert ta == tb
    ids = torch.tensor([prompts[1]])
    la, lb = a(ids), b(ids)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5 * lb.abs().max().item())
