"""HY-V4 (``model_type: hy_v4``) against transformers' ``HYV4ForCausalLM`` (issue 19).

Tiny checkpoints written by transformers with random weights at the real MLA / indexer widths
(latent 512 + rope 64, qk_nope 192, v 256, index_head_dim 128; tiny hidden size and layer count),
read by their own tensor names. transformers' ``torch.topk`` breaks ties arbitrarily; the ops
break them toward the lower position, so the reference runs with a stable top-k
(``lower_position_ties``), as in tests/test_integration_transformers.py.
"""

import json
import warnings

import pytest
import torch
from gloo_ranks import model_outputs, run_on_ranks
from hf_weights import stable_topk

from indexcache.tools.random_weights import randomize_
from test_model import run_paged

from indexcache.models import BatchMeta, HYV4ForCausalLM, from_pretrained
from indexcache.models.blocks.mla import sink_attention
from indexcache.runtime.generation import generate

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "HYV4ForCausalLM"):
    pytest.skip("this transformers has no HYV4ForCausalLM", allow_module_level=True)

WIDTHS = dict(vocab_size=80, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=6,
              num_attention_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, q_lora_rank=24,
              index_topk=8, index_head_dim=128, index_n_heads=4, max_position_embeddings=256,
              pad_token_id=None, bos_token_id=1, eos_token_id=2)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def hf_checkpoint(path, seed=0, **extra):
    cfg = transformers.HYV4Config(**{**WIDTHS, **extra})
    model = transformers.HYV4ForCausalLM(cfg)
    randomize_(model, seed)
    model.float().eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, ids, monkeypatch):
    model.config._attn_implementation = "eager"
    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)  # ties toward the lower position, as the ops
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()
    finally:
        monkeypatch.undo()


def ours(path, overrides=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every checkpoint tensor used (S layers' absent ones never asked for)
        return from_pretrained(path, hf_overrides=overrides, dtype=kw.pop("dtype", torch.float32),
                               indexer_fp8=kw.pop("indexer_fp8", False), **kw)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, WIDTHS["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A checkpoint with transformers' default indexer_types: full at 0 and (l - 1) % 4 == 0."""
    path = tmp_path_factory.mktemp("hy_v4")
    return path, hf_checkpoint(path, seed=0)


# ============================================================================ against transformers

def test_shipped_indexer_types_equal_transformers(shipped, ids, monkeypatch):
    path, ref = shipped
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["indexer_types"] == ["full", "full", "shared", "shared", "shared", "full"]
    assert not any(".indexer." in n for n in _names(path) if n.startswith(("model.layers.2.", "model.layers.3.")))
    model = ours(path)
    assert type(model) is HYV4ForCausalLM and model.plan.pattern == "FFSSSF"
    assert model.ic_config.shipped_by_checkpoint and "shipped" in model.plan_summary()
    # the --hf-overrides that reproduce the plan name the shipped list (not a freq)
    from indexcache.config import IndexCacheConfig
    again = json.loads(model.ic_config.hf_overrides_json())
    assert again["indexer_types"] == cfg["indexer_types"] and "index_topk_freq" not in again
    assert IndexCacheConfig.from_config({"num_hidden_layers": 6}, again).plan().pattern == "FFSSSF"
    assert model.indexer_param_count()[2:5] == [0, 0, 0] and model.indexer_param_count()[0] > 0
    assert model.args.native_mla and model.args.native_indexer and model.args.hc_mult == 4
    want = hf_logits(ref, ids, monkeypatch)
    assert rel(model(ids), want) < 1e-4
    # the fp8 indexer (the engines' scoring) runs too: its choices differ from fp32 scores on
    # some rows, but rows whose window fits in index_topk (8) attend over all of it either way
    fp8 = ours(path, indexer_fp8=True)(ids)
    assert torch.isfinite(fp8).all() and rel(fp8[:, :8], want[:, :8]) < 1e-4


def _names(path):
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("overrides,pattern", [
    ({"use_index_cache": True, "index_topk_freq": 2}, "FFSFSF"),
    ({"use_index_cache": True, "index_topk_pattern": "FSSFFS"}, "FSSFFS"),
    ({"use_index_cache": True, "indexer_types": ["full", "shared", "full", "full", "shared", "shared"]}, "FSFFSS"),
    (None, "FFFFFF"),
])
def test_all_full_checkpoint_with_overrides(tmp_path, ids, overrides, pattern, monkeypatch):
    # (seed 3: no two indexer scores within fp32 rounding of each other at a k-th place, where the
    # two sides' last-bit differences could pick different positions)
    hf_checkpoint(tmp_path / "ckpt", seed=3, indexer_types=["full"] * 6)
    model = ours(tmp_path / "ckpt", overrides)
    assert model.plan.pattern == pattern
    if overrides:
        assert "config.json's indexer_types replaced by --hf-overrides" in model.plan_summary()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.HYV4ForCausalLM.from_pretrained(
            tmp_path / "ckpt", indexer_types=["full" if c == "F" else "shared" for c in pattern]).float().eval()
    assert [layer.self_attn.indexer is None for layer in ref.model.layers] == [c == "S" for c in pattern]
    assert rel(model(ids), hf_logits(ref, ids, monkeypatch)) < 1e-4


def test_small_latent_widths_take_the_reference_path(tmp_path, ids, monkeypatch):
    # widths the native kernels do not take (latent 32 + rope 8, indexer 16): the ops' definitions
    ref = hf_checkpoint(tmp_path, seed=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=20,
                        index_head_dim=16, num_hidden_layers=3)
    model = ours(tmp_path)
    assert not model.args.native_mla and model.plan.pattern == "FFS"
    assert rel(model(ids), hf_logits(ref, ids, monkeypatch)) < 1e-4


def test_save_pretrained_writes_hy_v4_names(shipped, tmp_path, ids, monkeypatch):
    path, ref = shipped
    model = ours(path)
    model.save_pretrained(tmp_path / "again")
    assert sorted(_names(tmp_path / "again")) == sorted(_names(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.HYV4ForCausalLM.from_pretrained(tmp_path / "again").float().eval()
    assert rel(hf_logits(back, ids, monkeypatch), hf_logits(ref, ids, monkeypatch)) < 1e-6


def test_fp8_block_checkpoint(shipped, tmp_path, ids):
    path, _ = shipped
    model = ours(path)
    model.save_pretrained(tmp_path / "fp8", fp8=True)
    names = _names(tmp_path / "fp8")
    assert "model.layers.0.self_attn.linear_gate.weight_scale_inv" in names
    held = ours(tmp_path / "fp8", weights="fp8")
    assert held.model.layers[0].self_attn.gate_proj.weight.dtype == torch.float8_e4m3fn
    assert held.model.layers[1].mlp.shared_experts.gate_proj.weight.dtype == torch.float8_e4m3fn
    deq = ours(tmp_path / "fp8", weights="bf16")
    # the same e4m3 weights, held FP8 or dequantized at load
    assert rel(held(ids), deq(ids)) < 1e-5
    assert torch.isfinite(deq(ids)).all()
    # the fused 3-D expert tensors block-quantized expert by expert (scale_inv [E, rows/128, cols/128])
    from safetensors.torch import load_file, save_file

    from indexcache.fp8_blocks import dequantize_fp8_blocks, quantize_fp8_blocks
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    q, s = zip(*(quantize_fp8_blocks(w) for w in tensors[name]))
    tensors[name], tensors[name + "_scale_inv"] = torch.stack(q), torch.stack(s)
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    want = torch.stack([dequantize_fp8_blocks(a, b, name) for a, b in zip(q, s)])
    for weights in ("fp8", "bf16"):
        m = ours(tmp_path / "fp8", weights=weights)
        assert torch.equal(m.model.layers[1].mlp.experts.gate_up_proj, want)
    tensors.pop(name + "_scale_inv")
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match="gate_up_proj is stored in fp8 but .*_scale_inv is missing"):
        ours(tmp_path / "fp8")


# ============================================================================ serving paths

def test_paged_decode_and_chunked_prefill_equal_prefill(shipped):
    model = ours(shipped[0])
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, WIDTHS["vocab_size"], (n,), generator=g).tolist() for n in (37, 22)]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    single = run_paged(model, seqs[:1], [20], chunk=10_000)
    assert rel(single[0], full[0]) < 1e-5
    batched = run_paged(model, seqs, [30, 9], chunk=12)  # chunks cut through requests and mix them
    for got, want in zip(batched, full):
        assert rel(got, want) < 1e-5


def test_fp8_ds_mla_cache_bf16_and_generate(shipped):
    model = ours(shipped[0], indexer_fp8=True)
    s = torch.randint(0, WIDTHS["vocab_size"], (30,), generator=torch.Generator().manual_seed(3)).tolist()
    full = model(torch.tensor([s]))[0]
    fp8 = run_paged(model, [s], [12], chunk=8, kv_cache_dtype="fp8_ds_mla")[0]
    # Chunks of 8 and one of 30 go through torch's fp32 GEMM with different row counts. Where its
    # sums do not depend on the row count (Zen 3 / 4) the two runs agree to 1e-6; on an AMX Xeon
    # (MKL) they differ in the last bits, which the bf16 query the fp8 cache's attention takes
    # rounds a bf16 ulp apart: 2e-3-2.2e-2 at every position but the first two there (2026-12-03).
    # The fp8 cache against the fp32 forward, or a wrong chunk join, is further apart.
    whole = run_paged(model, [s], [30], chunk=64, kv_cache_dtype="fp8_ds_mla")[0]
    per_pos = torch.tensor([rel(a, b) for a, b in zip(fp8, whole)])
    assert per_pos.median() < 1e-2 and per_pos.max() < 5e-2, per_pos
    print("fp8 vs fp32 forward", rel(fp8, full))
    assert torch.isfinite(fp8).all() and 1e-5 < rel(fp8, full) < 0.5
    bf = ours(shipped[0], dtype=torch.bfloat16, indexer_fp8=True)
    assert bf.model.layers[0].attn_hc.fn.dtype == torch.float32 and bf.model.layers[0].self_attn.sinks.dtype == torch.float32
    bf16 = run_paged(bf, [s], [12], chunk=8, kv_cache_dtype="bf16")[0]
    # Per position, not over the whole sequence: in bf16 the paged chunks (<= FEW_ROWS rows: the
    # fused norms, ops.rows_matmul) and the 30-row forward (torch's) round a few elements a bf16 ulp
    # apart, enough to flip a near-tie of this fp8 top-8 at one position (measured 0.44 there,
    # <= 0.05 elsewhere). A wrong bf16 cache or chunk join moves every position.
    per_pos = torch.tensor([rel(a, b) for a, b in zip(bf16, bf(torch.tensor([s]))[0])])
    assert per_pos.median() < 0.02 and int((per_pos > 0.1).sum()) <= 2, per_pos
    res = generate(model, [s[:10], s[:17]], 6, stop_tokens=[], prefill_chunk_size=8)
    for p, toks in zip([s[:10], s[:17]], res.tokens):
        seq = list(p)
        for t in toks:
            assert int(model(torch.tensor([seq]))[0, -1].argmax()) == t
            seq.append(t)


# ============================================================================ the blocks

def test_sink_attention_torch_form():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    sinks = torch.tensor([0.5, 2.0])
    sel = torch.tensor([[[0, -1], [0, 1], [2, 0], [3, 1], [4, 2], [5, 0]]])
    got = sink_attention(q, k, v, 0.3, sinks, sel, [(0, 4), (4, 6)])
    for t in range(6):
        keys = sorted(int(x) for x in sel[0, t] if x >= 0)
        for h in range(2):
            s = torch.cat(((q[0, h, t] @ k[0, h, keys].T) * 0.3, sinks[h:h + 1]))
            want = torch.softmax(s, 0)[:-1] @ v[0, h, keys]
            torch.testing.assert_close(got[0, h, t], want, rtol=1e-5, atol=1e-6)


def test_torch_form_equals_kernel_form(shipped):
    """Training's differentiable forward (TorchPass: sinks, gate and hyper-connections in torch)
    gives the inference forward's loss."""
    from test_one_forward import assert_torch_form_equals_kernel_form

    model = ours(shipped[0], {"index_topk": 64})  # windows <= index_topk: the selection is the causal window
    ids = torch.randint(0, WIDTHS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    assert_torch_form_equals_kernel_form(model, ids)


# ============================================================================ errors

def test_errors(shipped, tmp_path):
    path, _ = shipped
    cfg = json.loads((path / "config.json").read_text())
    # MTP layers are not run (transformers does not either): built without them whatever the config says
    assert HYV4ForCausalLM.from_config(dict(cfg, num_nextn_predict_layers=1)).mtp_layers == []
    from indexcache.models import ModelArgs
    with pytest.raises(ValueError, match="MTP layers with hyper-connections"):
        ModelArgs.from_config(dict(cfg, num_nextn_predict_layers=1), "hy_v4", HYV4ForCausalLM.config_defaults)
    with pytest.raises(ValueError, match="hc_mult -1"):
        HYV4ForCausalLM.from_config(dict(cfg, hc_mult=-1))
    # a missing tensor is named by the checkpoint's own name
    from safetensors.torch import load_file, save_file
    (tmp_path / "bad").mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.learnable_sink_param"]
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.learnable_sink_param is missing"):
        ours(tmp_path / "bad")
    # a checkpoint's MTP tensors are passed over without a warning (ours() turns warnings into errors)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.mtp_layers.0.eh_proj.weight"] = torch.zeros(48, 96)
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    assert ours(tmp_path / "bad").plan.pattern == "FFSSSF"
    # a shared layer asked to be F in a forward has no indexer to run
    model = ours(path)
    ctx = model.forward_context(BatchMeta.dense(1, 3, "cpu"), full=[True] * 6)
    with pytest.raises(ValueError, match="layer 2 is F in this forward but holds no indexer"):
        model.hidden_states(torch.tensor([1, 2, 3]), ctx)


# ============================================================================ tensor / pipeline parallel

PAR_IDS = torch.tensor([[(3 * i + 1) % 80 for i in range(30)]])
PAR_PROMPTS = [[(7 * i + 3) % 80 for i in range(20)], [(5 * i + 11) % 80 for i in range(13)]]
PAR_LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2)]  # pp2: stage 1 begins on S layer 3 (FFS | SSF)


def _par_models(path):
    out = {}
    for name, tp, pp in PAR_LAYOUTS:
        model = HYV4ForCausalLM.from_pretrained(path, tp_size=tp, pp_size=pp, dtype=torch.float32, indexer_fp8=False)
        out[name] = {**model_outputs(model, PAR_IDS, PAR_PROMPTS),
                     "params": {n: tuple(p.shape) for n, p in model.named_parameters()}}
    return out


def test_tensor_and_pipeline_parallel(shipped, tmp_path):
    path = shipped[0]
    want = model_outputs(ours(path), PAR_IDS, PAR_PROMPTS)
    outs = run_on_ranks(_par_models, (path,), tmp_path)
    for r, o in enumerate(outs):
        for name, _, _ in PAR_LAYOUTS:
            got = o[name]
            assert rel(got["logits"], want["logits"]) < 1e-5, (name, r)
            assert torch.equal(got["rows"], want["rows"]) and got["tokens"] == want["tokens"], (name, r)
    tp = [o["tp2"]["params"] for o in outs]
    # heads split with their sinks and gates, experts split 2 + 2, hyper-connections replicated
    assert tp[0]["model.layers.0.self_attn.sinks"] == (1,)
    assert tp[0]["model.layers.0.self_attn.gate_proj.weight"] == (256, 48)
    assert tp[1]["model.layers.1.mlp.experts.gate_up_proj"] == (2, 48, 48)
    assert tp[0]["model.layers.0.attn_hc.fn"] == (8, 4 * 48)
    pp = [set(o["pp2"]["params"]) for o in outs]
    assert "model.hc_head.hc_fn" in pp[1] and "model.hc_head.hc_fn" not in pp[0]


# ============================================================================ pattern tools

def test_pattern_tools_take_hy_v4(tmp_path, capsys):
    from indexcache.cli import main

    path = tmp_path / "all_full"
    hf_checkpoint(path, seed=5, vocab_size=256, indexer_types=["full"] * 6)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, indexcache_tokenizer="bytes")))
    text = tmp_path / "text.txt"
    text.write_text("for line in open('settings.ini'):\n    key, _, value = line.partition('=')\n" * 20)
    common = ["--model", str(path), "--text", str(text), "--context", "24", "--windows", "2", "--json"]
    assert main(["overlap"] + common) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 24
    assert main(["search"] + common) == 0
    assert json.loads(capsys.readouterr().out)["steps"][0]["pattern"] == "FFFFFF"
    assert main(["eval"] + common) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["perplexity"] > 1
    # training-aware distillation of the indexers under a freq-2 plan writes an HY-V4 checkpoint
    # (its own tensor names, S layers without indexers) that transformers loads
    ov = json.dumps({"use_index_cache": True, "index_topk_freq": 2})
    assert main(["train", "--out", str(tmp_path / "run"), "--init", str(path), "--hf-overrides", ov,
                 "--mode", "indexers", "--warmup-steps", "1", "--sparse-steps", "1", "--batch", "1",
                 "--context-len", "24", "--eval-every", "2", "--text", str(text), "--heldout-text", str(text)]) == 0
    out = tmp_path / "run" / "checkpoint"
    names = _names(out)
    assert "model.layers.2.self_attn.learnable_sink_param" in names
    assert not any(n.startswith("model.layers.2.self_attn.indexer.") for n in names)
    assert json.loads((out / "config.json").read_text())["indexer_types"][:3] == ["full", "full", "shared"]
    model = ours(out)
    assert model.plan.pattern == "FFSFSF" and model.ic_config.shipped_by_checkpoint
    # eval takes a checkpoint whose S layers ship no indexer; overlap / search need them all
    assert main(["eval", "--model", str(out), "--text", str(text), "--context", "24", "--windows", "1"]) == 0
    assert main(["search", "--model", str(out), "--text", str(text), "--context", "24", "--windows", "1"]) == 2
    assert "overlap and search need every layer's indexer" in capsys.readouterr().err


# ============================================================================ transformers made sparse

def test_transformers_enable_takes_hy_v4(shipped, ids, monkeypatch):
    from indexcache.integrations.transformers import enable

    path, _ = shipped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.HYV4ForCausalLM.from_pretrained(path).float().eval()
        model = transformers.HYV4ForCausalLM.from_pretrained(path).float().eval()
    want = hf_logits(ref, ids, monkeypatch)
    enable(model, indexer_fp8=False)
    assert model.indexcache_plan.pattern == "FFSSSF"
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    assert rel(got, want) < 1e-4
    assert rel(got, ours(path)(ids)) < 1e-4
    # cached decode through transformers' generate: the greedy tokens of our paged model
    prompt = ids[:1, :12]
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                             do_sample=False, pad_token_id=0)
    res = generate(ours(path), [prompt[0].tolist()], 5, stop_tokens=[])
    assert out[0, 12:].tolist() == res.tokens[0]
