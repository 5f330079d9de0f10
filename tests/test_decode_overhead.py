"""The CPU decode step's short cuts (docs/profiling.md, "Third round") give what the long forms
give: the indexer rotating its rope dims in place, MLA rotating q_pe straight into the absorbed
query, one-chunk sparse attention returning the op's output, and the stage ranges that exist only
while torch's profiler (or a StageTimer) is there to see them."""

import contextlib

import pytest
import torch

from indexcache import reference
from indexcache.models.blocks.indexer import Indexer
from indexcache.models.blocks.mla import absorb_queries
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.state import StageTimer
from indexcache.models.tiny import tiny_config
from indexcache.runtime.generation import GenerationSettings, Run, decode_step, prefill

SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, index_n_heads=2, index_topk=8,
             max_position_embeddings=256)


def _angles(n, r, g):
    theta = torch.rand(n, r // 2, generator=g) * 6.0
    return theta.cos(), theta.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("n", [1, 3, 20])  # decode rows (in place) and prompt rows (torch's ops)
def test_indexer_rope_matches_definition(dtype, tail, n):
    g = torch.Generator().manual_seed(n * 10 + tail)
    ix = Indexer.__new__(Indexer)
    torch.nn.Module.__init__(ix)
    ix.rope_dim, ix.rope_tail, ix.rope_interleave = 16, tail, False
    t = torch.randn(n, 3, 40, generator=g).to(dtype)
    cos, sin = _angles(n, 16, g)
    rot = slice(24, 40) if tail else slice(0, 16)
    keep = slice(0, 24) if tail else slice(16, 40)
    want_rot = reference.rope(t[..., rot], cos, sin, False)
    want_keep = t[..., keep].clone()
    with torch.no_grad():
        got = ix._rope(t.clone(), cos, sin)
    assert got.shape == t.shape and got.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)  # one bf16 ulp
    torch.testing.assert_close(got[..., rot], want_rot, **tol)
    assert torch.equal(got[..., keep], want_keep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorb_queries_into_its_buffer(dtype):
    """q_pe already the buffer's rope part (no copy), a separate q_pe (copied), and no buffer all
    give the definition: q_nope through W_UK per head, then q_pe."""
    g = torch.Generator().manual_seed(1)
    n, h, nope, latent, r = 2, 3, 16, 32, 8
    q_nope = torch.randn(n, h, nope, generator=g).to(dtype)
    w_uk = torch.randn(h, nope, latent, generator=g).to(dtype)
    q_pe = torch.randn(n, h, r, generator=g).to(dtype)
    want = torch.cat((torch.einsum("thd,hdc->thc", q_nope.double(), w_uk.double()), q_pe.double()), -1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        plain = absorb_queries(q_nope, q_pe, w_uk)
        buf = torch.full((n, h, latent + r), float("nan"), dtype=dtype)
        buf[..., latent:] = q_pe
        aliased = absorb_queries(q_nope, buf[..., latent:], w_uk, out=buf)
        other = torch.full((n, h, latent + r), float("nan"), dtype=dtype)
        copied = absorb_queries(q_nope, q_pe, w_uk, out=other)
    assert aliased is buf and copied is other
    for got in (plain, aliased, copied):
        torch.testing.assert_close(got.double(), want, **tol)
        assert torch.equal(got[..., latent:], q_pe)
    assert torch.equal(aliased, plain) and torch.equal(copied, plain)


def _decode_tokens(model, prompt, steps, timer=None):
    run = Run(model, [prompt], steps + 1, GenerationSettings(stop_tokens=[], timer=timer))
    prefill(run)
    out = []
    for _ in range(steps):
        live = run.live()
        decode_step(run, live)
        out.append(live[0].next_token)
    return out


def test_stage_ranges_only_when_seen():
    """No profiler and no timer: the stages are no-ops; under torch.profiler each layer's stages are
    ranges; under a StageTimer each stage is timed; the tokens are the same all three ways."""
    torch.manual_seed(0)
    model = DeepseekV32ForCausalLM.from_config(tiny_config(**SMALL), None, dtype=torch.float32, seed=3,
                                               indexer_fp8=False)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = _decode_tokens(model, prompt, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = _decode_tokens(model, prompt, 3)
    keys = {e.key for e in prof.key_averages()}
    for layer in range(SMALL["num_hidden_layers"]):
        assert f"indexcache::layer{layer}::mla_proj" in keys and f"indexcache::layer{layer}::attention" in keys
    timer = StageTimer()
    timed = _decode_tokens(model, prompt, 3, timer)
    assert {"mla_proj", "attention", "indexer", "topk"} <= set(timer.times) and all(v > 0 for v in timer.times.values())
    assert plain == profiled == timed
    run = Run(model, [prompt], 2, GenerationSettings(stop_tokens=[]))
    ctx = model.forward_context(run.meta([0], [0], [1]), run.cache, None)
    assert isinstance(ctx.stage(0, "mla_proj"), contextlib.nullcontext)


def _layer_norm_definition(x, w, b, eps):
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    var = ((xd - mean) ** 2).mean(-1, keepdim=True)
    return (xd - mean) / torch.sqrt(var + eps) * w.double() + b.double()


def test_layer_norm_fp32_params_follow_the_parameters():
    """A bf16 LayerNorm's fp32 weight and bias are reused between calls, and made again after an
    in-place load_state_dict, a new parameter, and whenever grad mode is on (gradients reach them)."""
    from indexcache.models.blocks.norms import LayerNorm
    g = torch.Generator().manual_seed(7)
    ln = LayerNorm(32, eps=1e-6).to(torch.bfloat16)
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)

    def check():
        with torch.no_grad():
            got = ln(x)
        want = _layer_norm_definition(x, ln.weight, ln.bias, 1e-6)
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
        return got

    for p in ln.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(32, generator=g))
    check()
    with torch.no_grad():
        first = ln._fp32_params()
        assert all(a is b for a, b in zip(first, ln._fp32_params()))
    ln.load_state_dict({"weight": torch.randn(32, generator=g).to(torch.bfloat16),
                        "bias": torch.randn(32, generator=g).to(torch.bfloat16)})
    got = check()
    assert torch.equal(got, torch.nn.functional.layer_norm(x.float(), (32,), ln.weight.float(), ln.bias.float(),
                                                           1e-6).to(torch.bfloat16))
    ln.weight = torch.nn.Parameter(torch.randn(32, generator=g).to(torch.bfloat16))
    check()
    xg = x.float().requires_grad_()
    ln.float()
    ln(xg).sum().backward()
    assert ln.weight.grad is not None and ln.bias.grad is not None
    ln.to(torch.bfloat16)
    ln.zero_grad()
    ln(x).float().sum().backward()
    assert ln.weight.grad is not None and torch.isfinite(ln.weight.grad).all()


def test_kv_b_views_follow_the_weight():
    """MLA's W_UK / W_UV views are kept between no-grad calls, see an in-place load, are made
    again for a new weight and are not reused while grad mode is on."""
    torch.manual_seed(0)
    model = DeepseekV32ForCausalLM.from_config(tiny_config(**SMALL), None, dtype=torch.float32, seed=3,
                                               indexer_fp8=False)
    mla = model.model.layers[0].self_attn
    h, nope, v, latent = mla.n_heads, mla.nope, mla.v_dim, mla.latent

    def want():
        w = mla.kv_b_proj.weight.detach().view(h, nope + v, latent)
        return w[:, :nope], w[:, nope:]

    with torch.no_grad():
        a = mla._kv_b_parts(torch.float32)
        assert all(x is y for x, y in zip(a, mla._kv_b_parts(torch.float32)))
        mla.kv_b_proj.weight.copy_(torch.randn_like(mla.kv_b_proj.weight))
        assert all(torch.equal(x, y) for x, y in zip(mla._kv_b_parts(torch.float32), want()))
        mla.kv_b_proj.weight = torch.nn.Parameter(torch.randn_like(mla.kv_b_proj.weight))
        b = mla._kv_b_parts(torch.float32)
        assert all(torch.equal(x, y) for x, y in zip(b, want())) and b[0] is not a[0]
    uk, uv = mla._kv_b_parts(torch.float32)
    (uk.sum() + uv.sum()).backward()
    assert torch.equal(mla.kv_b_proj.weight.grad, torch.ones_like(mla.kv_b_proj.weight))


def test_topk_rows_view_follows_the_buffer():
    run = Run(DeepseekV32ForCausalLM.from_config(tiny_config(**SMALL), None, dtype=torch.float32, seed=3,
                                                 indexer_fp8=False), [[1, 2, 3]], 2, GenerationSettings(stop_tokens=[]))
    ctx = run.model.forward_context(run.meta([0], [0], [3]), run.cache, None)
    rows = ctx.topk_rows
    assert rows is ctx.topk_rows and rows.shape[0] == 3 and rows.data_ptr() == ctx.topk_buffer.data_ptr()
    ctx.topk_buffer = torch.full((5, rows.shape[1]), 7, dtype=torch.int32)
    assert ctx.topk_rows.shape == (3, rows.shape[1]) and bool((ctx.topk_rows == 7).all())
