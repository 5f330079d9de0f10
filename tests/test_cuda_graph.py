"""The sync-free decode step (runtime/cuda_graph.py) and its CUDA graph.

On the CPU: the static-buffer step, run eagerly, against the ordinary paged decode forward (the
same layers with the MoE's routed form) and against a model's own full-prefill logits; the
masked MoE against the routed one; generation with ``decode_step="static"`` against "eager";
every refusal. On CUDA (skipped here without a device): a captured step replays bit-identically
to an eager run of the same step, step after step, with no host synchronisation inside it.
"""

import types

import pytest
import torch

from indexcache.runtime.cuda_graph import DecodeStep, unsupported_reason
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.state import BatchMeta, StageTimer
from indexcache.models.blocks import MoE
from indexcache.models.tiny import tiny_config
from indexcache.runtime import generate

CFG = tiny_config(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_nextn_predict_layers=0, num_attention_heads=2, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
    kv_lora_rank=512, qk_rope_head_dim=64,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, index_n_heads=4, index_topk=16, max_position_embeddings=512,
    bos_token_id=None, eos_token_id=None,
)
FREQ2 = {"use_index_cache": True, "index_topk_freq": 2}
CUDA = torch.cuda.is_available()


def make(device="cpu", dtype=torch.float32, indexer_fp8=True, seed=0):
    return DeepseekV32ForCausalLM.from_config(CFG, FREQ2, dtype=dtype, device=device, indexer_fp8=indexer_fp8, seed=seed)


def prefill(model, prompts, kv_cache_dtype="auto"):
    """A paged cache holding ``prompts`` (room for 40 more tokens each) and each request's next token."""
    bs = 16
    cache = model.allocate_cache(sum(-(-(len(p) + 40) // bs) for p in prompts), kv_cache_dtype, bs)
    for i, p in enumerate(prompts):
        cache.manager.allocate(i, len(p) + 40)
    ids = torch.tensor([t for p in prompts for t in p], device=model.device)
    meta = BatchMeta.paged_batch(cache, list(range(len(prompts))), [0] * len(prompts), [len(p) for p in prompts])
    h = model.forward_tokens(ids, meta, cache)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    return cache, model.compute_logits(h[ends.to(h.device)]).argmax(-1).tolist()


def eager_step(model, cache, tokens, lens):
    meta = BatchMeta.paged_batch(cache, list(range(len(tokens))), lens, [1] * len(tokens))
    return model.compute_logits(model.forward_tokens(torch.tensor(tokens, device=model.device), meta, cache))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_static_step_matches_the_eager_decode_and_the_full_prefill():
    torch.manual_seed(0)
    model = make()
    prompts = [torch.randint(0, CFG["vocab_size"], (n,)).tolist() for n in (37, 5, 70)]
    cache_a, toks = prefill(model, prompts)
    cache_b, toks_b = prefill(model, prompts)
    assert toks == toks_b
    step = DecodeStep(model, cache_b, 3, max_blocks=8)
    lens = [len(p) for p in prompts]
    seqs = [list(p) for p in prompts]
    for it in range(4):
        want = eager_step(model, cache_a, toks, lens)
        step.prepare(toks, lens, list(range(3)) if it == 0 else None)
        got = step().clone()
        assert got.shape == want.shape and got.dtype == torch.float32
        assert rel(got, want) < 1e-5, it
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        # independent: the last row of a cache-free forward over the whole sequence
        for b in range(3):
            seqs[b].append(toks[b])
            full = model(torch.tensor([seqs[b]]))[0, -1]
            assert rel(got[b], full) < 1e-4, (it, b)
        for layer in range(CFG["num_hidden_layers"]):
            assert rel(cache_b.kv[layer], cache_a.kv[layer]) < 1e-5
        toks = got.argmax(-1).tolist()
        lens = [n + 1 for n in lens]


@torch.no_grad()
def test_masked_moe_equals_routed():
    torch.manual_seed(1)
    model = make()
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(23, CFG["hidden_size"])
    idx, w = moe.gate(x)
    routed, masked = moe._routed(x, idx, w), moe._masked(x, idx, w)
    assert rel(masked, routed) < 1e-6
    # per token, by hand: the gate-weighted sum of its experts
    tok = 5
    want = sum(float(w[tok, j]) * moe.expert(int(idx[tok, j]))(x[tok:tok + 1])[0] for j in range(idx.shape[1]))
    assert rel(masked[tok], want) < 1e-5


def test_generate_static_equals_eager_as_the_batch_shrinks():
    torch.manual_seed(2)
    model = make()
    prompts = [torch.randint(0, CFG["vocab_size"], (n,)).tolist() for n in (9, 30, 17)]
    eager = generate(model, prompts, 10, stop_tokens=[], decode_step="eager")
    stop = eager.tokens[1][2]  # request 1 stops early: the decode batch goes from 3 rows to 2
    eager = generate(model, prompts, 10, stop_tokens=[stop], decode_step="eager")
    static = generate(model, prompts, 10, stop_tokens=[stop], decode_step="static")
    assert static.tokens == eager.tokens and static.finish_reasons == eager.finish_reasons
    assert static.decode_step == "static" and static.graph_captures == 0
    assert eager.decode_step == "eager"
    assert generate(model, prompts, 3, stop_tokens=[]).decode_step == "eager"  # auto on the CPU


def test_generate_compiled_equals_eager():
    """The step compiled for the CPU (one graph, torch.compile) gives eager's tokens as the batch
    shrinks (one compile per batch size), F and S layers (two layers: each compile traces them all);
    its compiling step is timed apart. fp32: no near-tie flips a rounding could cause."""
    torch.manual_seed(4)
    model = DeepseekV32ForCausalLM.from_config({**CFG, "num_hidden_layers": 2},
                                               {"use_index_cache": True, "index_topk_pattern": "FS"}, seed=4)
    assert model.plan.pattern == "FS"
    prompts = [torch.randint(0, CFG["vocab_size"], (n,)).tolist() for n in (9, 30, 17)]
    eager = generate(model, prompts, 8, stop_tokens=[], decode_step="eager", decode_threads=1)
    stop = eager.tokens[1][2]  # request 1 stops early: the decode batch goes from 3 rows to 2
    eager = generate(model, prompts, 8, stop_tokens=[stop], decode_step="eager", decode_threads=1)
    comp = generate(model, prompts, 8, stop_tokens=[stop], decode_step="compiled", decode_threads=1)
    assert comp.tokens == eager.tokens and comp.finish_reasons == eager.finish_reasons
    assert comp.decode_step == "compiled" and comp.compile_seconds > 0
    # one compiling step of 3 rows, timed apart; the rest counted as decode
    assert comp.decode_tokens == eager.decode_tokens - 3


@torch.no_grad()
@pytest.mark.parametrize("pattern", ["FS", "FF"])
def test_compiled_bf16_step_rounds_as_eager(pattern):
    """bf16 (as models load): the compiled step's logits against the uncompiled static step's on the
    same inputs, step after step; its fused ops round each bf16 intermediate as the eager ops do
    (COMPILE_OPTIONS), so the two stay within a few bf16 roundings, and the caches agree. Two
    models of the same shapes, one after the other in a process: each step compiles its own model
    (prompts longer than top-k: the pattern changes what the S layer attends)."""
    torch.manual_seed(5)
    model = DeepseekV32ForCausalLM.from_config({**CFG, "num_hidden_layers": 2},
                                               {"use_index_cache": True, "index_topk_pattern": pattern},
                                               dtype=torch.bfloat16, seed=5)
    prompts = [torch.randint(0, CFG["vocab_size"], (n,)).tolist() for n in (40, 27)]
    cache_a, toks = prefill(model, prompts)
    cache_b, _ = prefill(model, prompts)
    plain, comp = DecodeStep(model, cache_a, 2, 8), DecodeStep(model, cache_b, 2, 8, compiled=True)
    lens = [len(p) for p in prompts]
    for it in range(3):
        for st in (plain, comp):
            st.prepare(toks, lens, [0, 1] if it == 0 else None)
        want, got = plain().clone(), comp().clone()
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert rel(got, want) < 1e-2, it
        for layer in range(2):
            assert rel(cache_b.kv[layer], cache_a.kv[layer]) < 1e-2
        toks = want.argmax(-1).tolist()
        lens = [n + 1 for n in lens]


def test_compiled_step_refusals():
    model = make()
    with pytest.raises(ValueError, match="cannot time stages"):
        generate(model, [[1, 2]], 2, decode_step="compiled", timer=StageTimer())
    cache, _ = prefill(model, [[1, 2, 3]])
    with pytest.raises(ValueError, match="either captured"):
        DecodeStep(model, cache, 1, 4, graph=True, compiled=True)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))
    assert "for the CPU" in unsupported_reason(model, on_cuda, compiled=True)
    with pytest.raises(ValueError, match="choose auto, eager, static, graph or compiled"):
        generate(model, [[1, 2]], 2, decode_step="compile")


def test_refusals(monkeypatch):
    model = make()
    cache, toks = prefill(model, [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match="decode_step 'bogus'"):
        generate(model, [[1, 2]], 2, decode_step="bogus")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        generate(model, [[1, 2]], 2, decode_step="graph")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DecodeStep(model, cache, 2, 4, graph=True)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))  # only the device is asked
    assert unsupported_reason(model, on_cuda, graph=True) is None
    monkeypatch.setenv("INDEXCACHE_CHECK", "1")
    assert "INDEXCACHE_CHECK=1" in unsupported_reason(model, on_cuda, graph=True)
    assert unsupported_reason(model, on_cuda) is None  # the eager static step does not mind
    monkeypatch.delenv("INDEXCACHE_CHECK")
    with pytest.raises(ValueError, match="outside"):
        DecodeStep(model, cache, 0, 4)
    step = DecodeStep(model, cache, 2, 4)
    with pytest.raises(ValueError, match="needs the requests"):
        step.prepare(toks, [3, 2])
    with pytest.raises(ValueError, match="serves 2 requests"):
        step.prepare(toks[:1], [3], [0])
    with pytest.raises(ValueError, match="token ids"):
        step.prepare([1, 96], [3, 2], [0, 1])
    with pytest.raises(ValueError, match="outside the requests' allocated blocks"):
        step.prepare(toks, [3, 64], [0, 1])
    with pytest.raises(ValueError, match="tables hold"):
        DecodeStep(model, cache, 2, 1).prepare(toks, [3, 2], [0, 1])
    fp32 = make(indexer_fp8=False)
    assert "fp32 indexer" in unsupported_reason(fp32, fp32.allocate_cache(2))
    with pytest.raises(ValueError, match="fp32 indexer"):
        generate(fp32, [[1, 2]], 2, decode_step="static")
    small = DeepseekV32ForCausalLM.from_config({**CFG, "kv_lora_rank": 32, "qk_rope_head_dim": 16}, FREQ2,
                                               dtype=torch.float32)
    with pytest.raises(ValueError, match="reference.sparse_mla"):
        DecodeStep(small, small.allocate_cache(2), 1, 2)
    # a sync-free forward refuses the paths that read request lengths on the host
    meta = BatchMeta.paged_batch(cache, [0, 1], [3, 2], [2, 1])
    with pytest.raises(ValueError, match="sync-free forward"):
        model.forward_tokens(torch.tensor([1, 2, 3]), meta, cache, sync_free=True)


# ---------------------------------------------------------------------------------------- CUDA

@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_ds_mla"])
def test_cuda_graph_replays_bit_identically(kv_cache_dtype):
    torch.manual_seed(3)
    model = make("cuda", torch.bfloat16)
    prompts = [torch.randint(0, CFG["vocab_size"], (n,)).tolist() for n in (37, 5, 70, 129)]
    cache_e, toks = prefill(model, prompts, kv_cache_dtype)
    cache_g, toks_g = prefill(model, prompts, kv_cache_dtype)
    assert toks == toks_g
    eager = DecodeStep(model, cache_e, 4, 16)
    graph = DecodeStep(model, cache_g, 4, 16, graph=True)
    lens = [len(p) for p in prompts]
    for it in range(5):
        rids = list(range(4)) if it == 0 else None
        eager.prepare(toks, lens, rids)
        graph.prepare(toks, lens, rids)
        want = eager().clone()
        if it > 0:  # captured: nothing in the replay may synchronise with the host
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = graph().clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want), it
        for layer in range(CFG["num_hidden_layers"]):
            assert torch.equal(cache_g.kv[layer], cache_e.kv[layer])
            ik_g, ik_e = cache_g.index_k[layer], cache_e.index_k[layer]
            assert (ik_g is None) == (ik_e is None) and (ik_g is None or torch.equal(ik_g, ik_e))
        toks = got.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    assert graph.graph is not None and graph.replays == 5


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_eager_step_does_not_sync():
    model = make("cuda", torch.bfloat16)
    cache, toks = prefill(model, [[1, 2, 3, 4], [5, 6]], "fp8_ds_mla")
    step = DecodeStep(model, cache, 2, 4)
    step.prepare(toks, [4, 2], [0, 1])
    step()  # first call: lazy set-up allowed
    step.prepare(step().argmax(-1).tolist(), [5, 3])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_cuda_generate_uses_the_graph():
    torch.manual_seed(4)
    model = make("cuda", torch.bfloat16)
    prompts = [torch.randint(0, CFG["vocab_size"], (n,)).tolist() for n in (9, 30, 17)]
    auto = generate(model, prompts, 12, stop_tokens=[], kv_cache_dtype="fp8_ds_mla")
    static = generate(model, prompts, 12, stop_tokens=[], kv_cache_dtype="fp8_ds_mla", decode_step="static")
    assert auto.decode_step == "graph" and auto.graph_captures == 1
    assert auto.tokens == static.tokens
