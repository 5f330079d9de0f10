"""DeepSeek-V4 (``model_type: deepseek_v4``) against transformers' ``DeepseekV4ForCausalLM`` (issue 21).

A tiny random checkpoint written by transformers (its own tensor names: DeepSeek's ``attn.wq_a``,
``ffn.experts.E.w1``, ``hc_attn_fn``, ...) with sliding, CSA and HCA layers, hash-routed and
sqrt-softplus-routed MoE and hyper-connections; compress rates 4 (CSA) and 8 (HCA) and a window
of 8, so that several windows close within 40 tokens. IndexCache is checked against transformers
patched so that an S CSA layer's indexer returns the nearest earlier F CSA layer's picks. Ties
in the indexer's top-k go to the lower entry on both sides (``stable_topk``).
"""

import warnings

import pytest
import torch
from gloo_ranks import model_outputs, run_on_ranks
from hf_weights import stable_topk

from indexcache.tools.random_weights import randomize_
from test_model import run_paged

from indexcache.models import DeepseekV4ForCausalLM, from_pretrained
from indexcache.runtime.generation import generate

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYERS = [SLIDING, CSA, HCA, CSA, CSA]  # CSA layers 1, 3, 4: the plan covers these three
WIDTHS = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4,
              head_dim=64, q_lora_rank=16, partial_rotary_factor=16 / 64, num_experts_per_tok=2, n_routed_experts=4,
              layer_types=LAYERS, compress_rates={CSA: 4, HCA: 8}, hc_mult=2, sliding_window=8, o_groups=2,
              o_lora_rank=8, index_n_heads=16, index_head_dim=32, index_topk=3,
              mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], max_position_embeddings=256)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def hf_checkpoint(path, seed=0, **extra):
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**{**WIDTHS, **extra}))
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("tid2eid"):  # token -> experts: distinct experts per token
                t.copy_(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t.shape[0])]))
    model.float().eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


def hf_logits(model, ids, monkeypatch, shared=()):
    """transformers' logits; ``shared``: CSA layer ids whose indexer returns the nearest earlier
    F CSA layer's picks (IndexCache S, the patch this test owns)."""
    indexer = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Indexer
    original, last = indexer.forward, {}

    def forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
        if layer_idx in shared:
            return last["picks"]
        last["picks"] = original(self, hidden_states, q_residual, position_ids, cache, layer_idx)
        return last["picks"]

    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)
    monkeypatch.setattr(indexer, "forward", forward)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()
    finally:
        monkeypatch.undo()


def ours(path, overrides=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every checkpoint tensor used (S layers' indexers never asked for)
        return from_pretrained(path, hf_overrides=overrides, dtype=kw.pop("dtype", torch.float32), **kw)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, WIDTHS["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v4")
    return path, hf_checkpoint(path)


# ============================================================================ against transformers

def test_prefill_equals_transformers(ckpt, ids, monkeypatch):
    path, ref = ckpt
    model = ours(path)
    assert type(model) is DeepseekV4ForCausalLM
    assert model.indexed == [1, 3, 4] and model.plan.pattern == "FFF"
    assert [layer.self_attn.kind for layer in model.model.layers] == LAYERS
    assert [layer.mlp.gate.hashed for layer in model.model.layers] == [True, True, False, False, False]
    got, want = model(ids), hf_logits(ref, ids, monkeypatch)
    assert rel(got, want) < 1e-4
    # the indexer matters here: with index_topk 1 instead of 3 the logits move
    assert rel(ours(path, {"index_topk": 1})(ids), want) > 1e-3


@pytest.mark.parametrize("overrides,pattern", [
    ({"use_index_cache": True, "index_topk_pattern": "FSS"}, "FSS"),
    ({"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1}, "FSF"),
])
def test_index_cache_equals_patched_transformers(ckpt, ids, overrides, pattern, monkeypatch):
    path, ref = ckpt
    model = ours(path, overrides)
    assert model.plan.pattern == pattern
    shared = [layer for layer, c in zip(model.indexed, pattern) if c == "S"]
    counts = model.indexer_param_count()
    assert [counts[i] == 0 for i in model.indexed] == [c == "S" for c in pattern] and counts[0] == counts[2] == 0
    for i in shared:  # an S CSA layer keeps its KV compressor, owns no indexer
        assert model.model.layers[i].self_attn.compressor is not None and model.model.layers[i].self_attn.indexer is None
    want = hf_logits(ref, ids, monkeypatch, shared)
    assert rel(model(ids), want) < 1e-4
    assert rel(want, hf_logits(ref, ids, monkeypatch)) > 1e-3  # the reuse changes the model's output


def test_yarn_compress_rope_equals_transformers(tmp_path, ids, monkeypatch):
    # V4's configs put YaRN on the compressed branches only ("compress", cos/sin unscaled)
    ref = hf_checkpoint(tmp_path, seed=2, rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32,
                                                            "original_max_position_embeddings": 16, "beta_slow": 1})
    model = ours(tmp_path)
    assert model.args.compress_rope_scaling["factor"] == 16.0 and model.args.rope_scaling is None
    assert torch.equal(model.v4_inv_freq["compress"], ref.model.rotary_emb.compress_inv_freq.float())
    assert rel(model(ids), hf_logits(ref, ids, monkeypatch)) < 1e-4


def test_layers_run_one_by_one(ckpt, ids):
    """As the pattern tools run a model (context first, then the embedding, then each layer):
    hash routing finds the token ids the embedding read."""
    from indexcache.models import BatchMeta
    model = ours(ckpt[0], {"use_index_cache": True, "index_topk_pattern": "FSF"})
    ctx = model.forward_context(BatchMeta.dense(2, 40, "cpu"))
    x = model.model.embed(ids.reshape(-1))
    for layer in model.model.layers:
        x = layer(x, ctx)
    assert rel(model.compute_logits(model.model.final_norm(x)).view(2, 40, -1), model(ids)) < 1e-6


def test_attention_in_row_chunks(ckpt, ids, monkeypatch):
    """A long prefill attends row chunk by row chunk (bounded index memory): one row at a time
    gives the same logits (to rounding)."""
    from indexcache.models.blocks import v4_attention
    model = ours(ckpt[0])
    want = model(ids)
    monkeypatch.setattr(v4_attention, "ATTN_CHUNK_ELEMS", 1)
    assert rel(model(ids), want) < 1e-6  # (the same sums, in other BLAS blockings)


def test_plan_covers_csa_layers_only(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="index_topk_pattern has 4 entries"):
        ours(path, {"use_index_cache": True, "index_topk_pattern": "FSSF"})
    with pytest.raises(ValueError, match="starts with .S."):
        ours(path, {"use_index_cache": True, "index_topk_pattern": "SFF"})
    model = ours(path, {"use_index_cache": True, "indexer_types": ["full", "shared", "full"]})
    assert model.plan.pattern == "FSF" and model.model.layers[3].self_attn.indexer is None


def test_missing_tensor_is_a_clear_error(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    path, _ = ckpt
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("model.layers.3.attn.compressor.ape")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.attn\.compressor\.ape is missing"):
        ours(tmp_path)
    # the indexer tensors of an S layer are not needed: the same file without them loads under FSS
    for name in [n for n in tensors if n.startswith("model.layers.4.attn.indexer.")]:
        tensors.pop(name)
    tensors["model.layers.3.attn.compressor.ape"] = torch.zeros(4, 128)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert ours(tmp_path, {"use_index_cache": True, "index_topk_pattern": "FFS"}).plan.pattern == "FFS"
    with pytest.raises(ValueError, match=r"model\.layers\.4\.attn\.indexer\..* is missing"):
        ours(tmp_path)


def test_deepseek_layout_and_fp8_checkpoints(ckpt, tmp_path, ids):
    """DeepSeek's own names (no ``model.`` prefix, ``embed.weight``, ``hc_head_fn``) load too, and a
    block-FP8 checkpoint loads held FP8 or dequantized."""
    import re

    from safetensors.torch import load_file, save_file
    path, _ = ckpt
    want = ours(path)(ids)
    tensors = load_file(str(path / "model.safetensors"))
    official = {re.sub(r"^model\.", "", re.sub(r"^model\.hc_head\.hc_", "hc_head_",
                                                re.sub(r"^model\.embed_tokens\.", "embed.", n))): t
                for n, t in tensors.items()}
    assert "embed.weight" in official and "hc_head_fn" in official and "layers.1.attn.indexer.wq_b.weight" in official
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "config.json").write_text((path / "config.json").read_text())
    save_file(official, str(tmp_path / "ds" / "model.safetensors"))
    model = ours(tmp_path / "ds", {"use_index_cache": True, "index_topk_pattern": "FSF"})
    assert model.official_layout and model.model.layers[3].self_attn.indexer is None
    assert torch.equal(ours(tmp_path / "ds")(ids), want)
    ours(path).save_pretrained(tmp_path / "fp8", fp8=True)
    names = set(load_file(str(tmp_path / "fp8" / "model.safetensors")))
    assert "model.layers.1.attn.wq_a.weight_scale_inv" in names and "model.layers.0.ffn.experts.3.w1.weight_scale_inv" in names
    held, deq = ours(tmp_path / "fp8", weights="fp8"), ours(tmp_path / "fp8", weights="bf16", dtype=torch.float32)
    assert held.model.layers[0].mlp.experts[3].gate_proj.weight.dtype == torch.float8_e4m3fn
    assert rel(held(ids), deq(ids)) < 1e-5 and 1e-6 < rel(deq(ids), want) < 0.3  # e4m3 weights of a tiny random model


def test_no_training_forward_yet(ckpt):
    from indexcache.models.state import TorchPass
    model = ours(ckpt[0])
    with pytest.raises(ValueError, match="no differentiable"):
        model.torch_pass_context(TorchPass(1, 8, "causal", [(0, 8)]))


def test_save_pretrained_round_trip(ckpt, tmp_path, ids, monkeypatch):
    """What this model writes is the checkpoint transformers wrote: the same names, and transformers
    reads it back to the same logits."""
    from safetensors import safe_open
    path, ref = ckpt
    ours(path).save_pretrained(tmp_path / "again")
    names = [set(safe_open(str(p / "model.safetensors"), "pt").keys()) for p in (path, tmp_path / "again")]
    assert names[0] == names[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "again").float().eval()
    assert rel(hf_logits(back, ids, monkeypatch), hf_logits(ref, ids, monkeypatch)) < 1e-6


def test_config_errors(ckpt):
    import json
    cfg = json.loads((ckpt[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="layer_types"):
        DeepseekV4ForCausalLM.from_config({**cfg, "layer_types": LAYERS[:4] + ["full_attention"]})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        DeepseekV4ForCausalLM.from_config({**cfg, "mlp_layer_types": ["moe", "hash_moe", "moe", "moe", "moe"]})
    with pytest.raises(ValueError, match="scoring_func"):
        DeepseekV4ForCausalLM.from_config({**cfg, "scoring_func": "tanh"})
    with pytest.raises(ValueError, match="compress_rates must be >= 1"):
        DeepseekV4ForCausalLM.from_config({**cfg, "compress_rates": {CSA: 0, HCA: 8}})
    with pytest.raises(ValueError, match="o_groups 3 must divide num_attention_heads 4"):
        DeepseekV4ForCausalLM.from_config({**cfg, "o_groups": 3})
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        DeepseekV4ForCausalLM.from_config({**cfg, "sliding_window": -1})


# ============================================================================ serving paths

@pytest.mark.parametrize("overrides", [None, {"use_index_cache": True, "index_topk_pattern": "FSF"}])
def test_paged_decode_equals_prefill(ckpt, overrides):
    model = ours(ckpt[0], overrides)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, WIDTHS["vocab_size"], (n,), generator=g).tolist() for n in (37, 22)]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    single = run_paged(model, seqs[:1], [5], chunk=10_000)  # decode from position 5: every window closes in decode
    assert rel(single[0], full[0]) < 1e-5
    batched = run_paged(model, seqs, [30, 9], chunk=7)  # chunks cut through windows and requests, mixing them
    for got, want in zip(batched, full):
        assert rel(got, want) < 1e-5


def test_reused_blocks_start_clean(ckpt):
    """A request whose blocks another request used before (compressed rows, window accumulators,
    index keys all left behind) decodes exactly as on a fresh cache."""
    from indexcache.models import BatchMeta
    model = ours(ckpt[0])
    g = torch.Generator().manual_seed(11)
    first, second = (torch.randint(0, WIDTHS["vocab_size"], (n,), generator=g) for n in (40, 26))
    cache = model.allocate_cache(1, "fp32", block_size=64)

    def run(rid, seq, prefill):
        cache.manager.allocate(rid, len(seq))
        out = [model.compute_logits(model.forward_tokens(seq[:prefill], BatchMeta.paged_batch(cache, [rid], [0], [prefill]),
                                                         cache))]
        for p in range(prefill, len(seq)):
            meta = BatchMeta.paged_batch(cache, [rid], [p], [1])
            out.append(model.compute_logits(model.forward_tokens(seq[p:p + 1], meta, cache)))
        cache.manager.free(rid)
        return torch.cat(out)

    run("a", first, 7)
    assert rel(run("b", second, 6), model(second.view(1, -1))[0]) < 1e-5


def test_paged_cache_layout(ckpt):
    model = ours(ckpt[0])
    cache = model.allocate_cache(3, "fp32", block_size=16)
    # one pool per layer: 3 x 16 raw rows, then ceil(16 / rate) compressed rows per block
    assert [s.pool.shape[0] for s in cache.layers] == [48, 48 + 12, 48 + 6, 48 + 12, 48 + 12]
    # accumulator rings: 2 windows per block (HCA: one series of 64 x max / denominator / numerator)
    assert cache.layers[0].acc is None and cache.layers[2].acc.shape == (3, 2, 3 * 64)
    assert cache.layers[2].index_k is None and cache.layers[1].index_k.shape == (12, 32)
    assert cache.nbytes()["index_k"] > 0
    s = ours(ckpt[0], {"use_index_cache": True, "index_topk_pattern": "FSS"}).allocate_cache(3, "fp32", 16)
    assert s.layers[3].index_k is None and s.nbytes()["index_k"] == cache.layer_bytes(1)[1]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.allocate_cache(3, "fp8_ds_mla")


def test_generate_and_bf16(ckpt):
    model = ours(ckpt[0])
    s = torch.randint(0, WIDTHS["vocab_size"], (30,), generator=torch.Generator().manual_seed(3)).tolist()
    res = generate(model, [s[:10], s[:17]], 6, stop_tokens=[], prefill_chunk_size=8)
    for p, toks in zip([s[:10], s[:17]], res.tokens):
        seq = list(p)
        for t in toks:
            assert int(model(torch.tensor([seq]))[0, -1].argmax()) == t
            seq.append(t)
    bf = ours(ckpt[0], dtype=torch.bfloat16)
    assert bf.model.layers[0].attn_hc.fn.dtype == torch.float32 and bf.model.layers[1].mlp.gate.tid2eid.dtype == torch.int64
    want = model(torch.tensor([s]))[0]
    assert rel(bf(torch.tensor([s]))[0], want) < 0.1
    assert rel(run_paged(bf, [s], [12], chunk=8, kv_cache_dtype="bf16")[0], bf(torch.tensor([s]))[0]) < 0.02


def test_random_init_runs_paged():
    cfg = transformers.DeepseekV4Config(**WIDTHS).to_dict()
    model = DeepseekV4ForCausalLM.from_config(cfg, seed=1)
    ids = torch.randint(0, WIDTHS["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    assert torch.isfinite(full).all()
    paged = run_paged(model, [ids[0].tolist()], [3], chunk=64)
    assert rel(paged[0], full[0]) < 1e-5


def test_plan_cli_reports_the_csa_layers(ckpt, capsys):
    import json

    from indexcache.cli.app import main
    path, _ = ckpt
    assert main(["plan", "--config", str(path / "config.json"), "--context", "4000", "--json",
                 "--hf-overrides", '{"use_index_cache": true, "index_topk_pattern": "FSS"}']) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pattern"] == "FSS" and out["num_hidden_layers"] == 3
    assert [(r["layer"], r["type"], r["source_layer"]) for r in out["layers"]] == [(1, "F", 1), (3, "S", 1), (4, "S", 1)]
    costs = out["costs"]
    # per F CSA layer: projections (q_b_proj 16 x 32 from 16, weights_proj, the indexer compressor's two
    # series of 32) + a ReLU-weighted score over each of the 1000 visible entries (4000 / rate 4)
    per_layer = 2 * 16 * 16 * 32 + 2 * 32 * 16 + 8 * 32 * 32 + 1000 * (2 * 16 * 32 + 2 * 16)
    assert costs["decode_flops_per_token"]["all_f"] == 3 * per_layer
    assert costs["decode_flops_per_token"]["plan"] == per_layer
    assert costs["index_k_cache_bytes_per_sequence"]["removed"] == 2 * 1000 * (32 + 4)
    assert main(["plan", "--config", str(path / "config.json")]) == 0
    assert "3 CSA layers, entries of 4 tokens" in capsys.readouterr().out
    assert main(["plan", "--config", str(path / "config.json"), "--tp", "2"]) != 0
    assert "DeepSeek-V4's are not sized yet" in capsys.readouterr().err


def test_native_widths_through_the_ops(tmp_path, monkeypatch):
    """The production widths (K=V head 512 with RoPE 64, indexer 128): attention through
    ``ops.sparse_mla(..., extra_indices=)``, the indexer through ``ops.indexer_topk`` (fp32)."""
    from indexcache.models.blocks import v4_attention
    ref = hf_checkpoint(tmp_path, seed=1, head_dim=512, partial_rotary_factor=64 / 512, index_head_dim=128,
                        num_hidden_layers=3, layer_types=[SLIDING, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
                        num_attention_heads=2, index_n_heads=8)
    calls = []
    real = v4_attention.ops.sparse_mla
    monkeypatch.setattr(v4_attention.ops, "sparse_mla", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = ours(tmp_path)
    assert model.args.native_mla and model.args.native_indexer
    ids = torch.randint(0, WIDTHS["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(2))
    got = model(ids)
    assert len(calls) == 3 and all(k["extra_indices"].shape[1] == WIDTHS["sliding_window"] for k in calls)
    monkeypatch.undo()
    assert rel(got, hf_logits(ref, ids, monkeypatch)) < 1e-4
    s = ids[0].tolist()
    assert rel(run_paged(model, [s], [9], chunk=64)[0], got[0]) < 1e-5
    with pytest.raises(ValueError, match="fp32 indexer"):  # no sync-free decode step: "auto" runs eager steps
        generate(model, [s[:5]], 2, stop_tokens=[], decode_step="static")


PAR_IDS = torch.tensor([[(3 * i + 1) % 64 for i in range(30)]])
PAR_PROMPTS = [[(7 * i + 3) % 64 for i in range(20)], [(5 * i + 11) % 64 for i in range(13)]]
PAR_PATTERN = {"use_index_cache": True, "index_topk_pattern": "FSF"}  # pp2: stage 1 begins on S CSA layer 3
PAR_LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2)]


def _par_models(path):
    out = {}
    for name, tp, pp in PAR_LAYOUTS:
        model = DeepseekV4ForCausalLM.from_pretrained(path, hf_overrides=PAR_PATTERN, tp_size=tp, pp_size=pp,
                                                      dtype=torch.float32)
        out[name] = {**model_outputs(model, PAR_IDS, PAR_PROMPTS),
                     "params": {n: tuple(p.shape) for n, p in model.named_parameters()}}
    return out


def test_tensor_and_pipeline_parallel(ckpt, tmp_path):
    path = ckpt[0]
    want = model_outputs(ours(path, PAR_PATTERN), PAR_IDS, PAR_PROMPTS)
    outs = run_on_ranks(_par_models, (path,), tmp_path)
    for r, o in enumerate(outs):
        for name, _, _ in PAR_LAYOUTS:
            got = o[name]
            assert rel(got["logits"], want["logits"]) < 1e-5, (name, r)
            assert torch.equal(got["rows"], want["rows"]) and got["tokens"] == want["tokens"], (name, r)
    tp = [o["tp2"]["params"] for o in outs]
    # experts split 2 + 2 by id, the shared expert by columns, hyper-connections replicated
    assert "model.layers.0.mlp.experts.2.gate_proj.weight" in tp[1] and "model.layers.0.mlp.experts.0.gate_proj.weight" in tp[0]
    assert "model.layers.0.mlp.experts.2.gate_proj.weight" not in tp[0]
    assert tp[0]["model.layers.0.mlp.shared_experts.gate_proj.weight"] == (8, 32)
    # heads split by output group (2 groups of 2 heads): q_b_proj rows, sinks, o_a_proj rows, o_b_proj columns
    assert tp[1]["model.layers.1.self_attn.q_b_proj.weight"] == (128, 16) and tp[1]["model.layers.1.self_attn.sinks"] == (2,)
    assert tp[0]["model.layers.1.self_attn.o_a_proj.weight"] == (8, 128) and tp[0]["model.layers.1.self_attn.o_b_proj.weight"] == (32, 8)
    assert tp[0]["model.layers.1.self_attn.kv_proj.weight"] == (64, 32) and tp[0]["model.layers.0.attn_hc.fn"] == (8, 64)
    pp = [set(o["pp2"]["params"]) for o in outs]
    assert "model.hc_head.hc_fn" in pp[1] and "model.hc_head.hc_fn" not in pp[0]


def test_step_reuse_is_refused_not_ignored(ckpt):
    # its CSA indexer has no reuse across decode steps: the key is an error, not a printed plan it ignores
    with pytest.raises(ValueError, match=r"index_reuse_steps 3: DeepseekV4ForCausalLM .*across layers only"):
        ours(ckpt[0], {"use_index_cache": True, "index_topk_freq": 2, "index_reuse_steps": 3})
