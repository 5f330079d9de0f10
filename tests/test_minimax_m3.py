"""MiniMax-M3 (``minimax_m3_vl_text`` and the text tower of ``minimax_m3_vl``) against transformers'
``MiniMaxM3VLForCausalLM`` / ``MiniMaxM3SparseForConditionalGeneration`` (issue 20).

Tiny checkpoints written by transformers with random weights: both layer types, dense and MoE
MLPs with a shared expert, partial RoPE, and blocks of 4 keys so that 40-token prompts select
2 of up to 10 blocks per KV head. IndexCache patterns are checked against transformers patched
the same way (``reuse_selection``): an S sparse layer's indexer returns the block selection of the
nearest earlier F sparse layer. transformers' block top-k orders blocks by score, the op by id:
the selections are compared as what attention reads (sets), and scores are continuous random
values, so no two blocks tie except the forced local block (+inf) and empty ones (-inf).
"""

import json
import warnings

import pytest
import torch
from test_model import run_paged

from indexcache.models import BatchMeta, MiniMaxM3ForCausalLM, MiniMaxM3VLTextTower, from_pretrained
from indexcache.runtime.generation import generate
from indexcache.tools import random_weights

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiniMaxM3VLForCausalLM"):
    pytest.skip("this transformers has no MiniMaxM3VLForCausalLM", allow_module_level=True)
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_mm  # noqa: E402

FULL, SPARSE = "full_attention", "minimax_m3_sparse"
LAYER_TYPES = [FULL, SPARSE, SPARSE, FULL, SPARSE, SPARSE]
SPARSE_IDS = [1, 2, 4, 5]
TEXT = dict(vocab_size=96, hidden_size=48, intermediate_size=16, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rotary_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            num_local_experts=4, num_experts_per_tok=2, dense_intermediate_size=24, shared_intermediate_size=8,
            index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
            layer_types=LAYER_TYPES, mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def randomize_(model, seed):
    """Every weight random, the norms (1 + w) near 1: the shared weights with the norms centred on 0."""
    return random_weights.randomize_(model, seed, norm_center=0.0).float().eval()


def hf_text(path, seed=0, **extra):
    model = randomize_(transformers.MiniMaxM3VLForCausalLM(transformers.MiniMaxM3VLTextConfig(**{**TEXT, **extra})), seed)
    model.save_pretrained(path)
    return model


def hf_logits(model, ids, pattern=None, monkeypatch=None):
    """transformers' fp32 logits; ``pattern`` (one F/S per sparse layer): S sparse layers reuse the
    selection of the nearest earlier F sparse layer."""
    model.config._attn_implementation = "eager"
    if pattern is not None:
        reuse_selection(monkeypatch, model, pattern)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()


def reuse_selection(monkeypatch, model, pattern):
    """Patch transformers' indexer as IndexCache runs it (DESIGN.md §2, §6): F sparse layers select
    and remember; S sparse layers return the remembered selection instead of scoring."""
    cfg = getattr(model.config, "text_config", model.config)
    sparse = [i for i, t in enumerate(cfg.layer_types) if t == SPARSE]
    shared = {layer for layer, c in zip(sparse, pattern) if c == "S"}
    original, last = hf_mm.MiniMaxM3VLIndexer.forward, {}

    def forward(self, *args, **kwargs):
        if self.layer_idx in shared:
            return last["selection"]
        last["selection"] = original(self, *args, **kwargs)
        return last["selection"]

    monkeypatch.setattr(hf_mm.MiniMaxM3VLIndexer, "forward", forward)


def ours(path, overrides=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every checkpoint tensor used or knowingly passed over
        return from_pretrained(path, hf_overrides=overrides, dtype=kw.pop("dtype", torch.float32), **kw)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TEXT["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("minimax_m3")
    return path, hf_text(path)


def _names(path):
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


# ============================================================================ against transformers

def test_without_index_cache_equals_transformers(text, ids):
    path, ref = text
    model = ours(path)
    assert type(model) is MiniMaxM3ForCausalLM and model.indexed == SPARSE_IDS and model.plan.pattern == "FFFF"
    assert model.args.index_topk == 2 * 2 and model.topk_buffer.shape[1] == 4
    counts = model.indexer_param_count()
    assert [c > 0 for c in counts] == [t == SPARSE for t in LAYER_TYPES]  # full_attention layers have none
    want = hf_logits(ref, ids)
    got = model(ids)
    assert rel(got, want) < 1e-4
    # the selection matters: with every sparse layer reading all of its blocks the logits move
    wide = ours(path, {"index_topk_blocks": 16})
    assert wide.args.index_topk_blocks == 16 and rel(wide(ids), want) > 1e-3


@pytest.mark.parametrize("overrides,pattern", [
    ({"use_index_cache": True, "index_topk_freq": 2}, "FFSF"),
    ({"use_index_cache": True, "index_topk_pattern": "FSSF"}, "FSSF"),
    ({"use_index_cache": True, "indexer_types": ["full", "shared", "full", "shared"]}, "FSFS"),
])
def test_patterns_equal_transformers_reusing_selections(text, ids, overrides, pattern, monkeypatch):
    path, ref = text
    model = ours(path, overrides)
    assert model.plan.pattern == pattern
    shared = [layer for layer, c in zip(SPARSE_IDS, pattern) if c == "S"]
    for layer in shared:  # an S sparse layer owns no indexer and loaded none of its tensors
        assert model.model.layers[layer].self_attn.indexer is None
        assert model.indexer_param_count()[layer] == 0
    want = hf_logits(ref, ids, pattern, monkeypatch)
    assert rel(model(ids), want) < 1e-4
    assert rel(want, hf_logits(ref, ids)) > 1e-3  # reuse changes what S layers attend over
    assert "over the sparse layers 1, 2, 4, 5" in model.plan_summary()


def test_vl_checkpoint_loads_its_text_tower(tmp_path, ids, capsys):
    cfg = transformers.MiniMaxM3VLConfig(text_config=TEXT, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    ref = randomize_(transformers.MiniMaxM3SparseForConditionalGeneration(cfg), 4)
    ref.save_pretrained(tmp_path)
    names = _names(tmp_path)
    assert any(n.startswith("vision_tower.") for n in names)
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    model = ours(tmp_path)  # vision tensors passed over without a warning
    assert type(model) is MiniMaxM3VLTextTower and model.indexed == SPARSE_IDS
    assert not model.args.fused_experts
    want = hf_logits(ref, ids)
    assert rel(model(ids), want) < 1e-4
    pattern = "FSFS"
    ic = ours(tmp_path, {"use_index_cache": True, "index_topk_pattern": pattern})
    mp = pytest.MonkeyPatch()
    assert rel(ic(ids), hf_logits(ref, ids, pattern, mp)) < 1e-4
    # the official names round-trip through save_pretrained (no vision tower, S indexers absent)
    ic.save_pretrained(tmp_path / "again")
    again = _names(tmp_path / "again")
    assert not any(n.startswith("vision_tower.") for n in again)
    assert not any(n.startswith("language_model.model.layers.2.self_attn.index_") for n in again)
    back = ours(tmp_path / "again", {"use_index_cache": True, "index_topk_pattern": pattern})
    assert torch.equal(back(ids), ic(ids))
    with pytest.raises(ValueError, match="needs its text_config"):
        MiniMaxM3VLTextTower.from_config({"model_type": "minimax_m3_vl"})
    # IndexCache settings shipped in text_config are the checkpoint's own
    import shutil
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    shutil.copy(tmp_path / "model.safetensors", shipped / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"].update(use_index_cache=True, index_topk_freq=2)
    (shipped / "config.json").write_text(json.dumps(cfg))
    model = ours(shipped)
    assert model.plan.pattern == "FFSF" and "shipped" in model.plan_summary()
    from indexcache.cli import main
    assert main(["plan", "--config", str(shipped), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["pattern"] == "FFSF" and got["shipped_by_checkpoint"] and got["indexed_layers"] == SPARSE_IDS


# ============================================================================ loading

def test_missing_tensor_is_a_clear_error_and_s_layers_need_none(text, tmp_path):
    from safetensors.torch import load_file, save_file
    path, _ = text
    tensors = load_file(str(path / "model.safetensors"))
    gone = "model.layers.2.self_attn.indexer.q_proj.weight"
    tensors.pop(gone)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"lacks weights the model needs: {gone} is missing"):
        ours(tmp_path)
    # layer 2 (sparse position 1) as S: its indexer is never asked for
    model = ours(tmp_path, {"use_index_cache": True, "index_topk_pattern": "FS"})
    assert model.plan.pattern == "FSFF" and model.model.layers[2].self_attn.indexer is None
    tensors.pop("model.layers.0.self_attn.q_norm.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_norm.weight is missing"):
        ours(tmp_path, {"use_index_cache": True, "index_topk_pattern": "FS"})


def test_from_pretrained_picks_the_class_and_config_errors(text):
    from indexcache.models import model_class
    path, _ = text
    cfg = json.loads((path / "config.json").read_text())
    assert model_class(cfg) is MiniMaxM3ForCausalLM
    assert model_class({"model_type": "minimax_m3_vl"}) is MiniMaxM3VLTextTower
    with pytest.raises(ValueError, match="minimax_m3_vl_text"):
        model_class({"model_type": "minimax_m4"})
    with pytest.raises(ValueError, match="index_n_heads 3 must equal num_key_value_heads 2"):
        MiniMaxM3ForCausalLM.from_config({**cfg, "index_n_heads": 3})
    with pytest.raises(ValueError, match="layer_types must list"):
        MiniMaxM3ForCausalLM.from_config({**cfg, "layer_types": [FULL, SPARSE]})
    with pytest.raises(ValueError, match="pattern"):  # one character per sparse layer (4), not per layer
        MiniMaxM3ForCausalLM.from_config(cfg, {"use_index_cache": True, "index_topk_pattern": "FSSFFS"})


def test_plan_command_covers_the_sparse_layers(text, capsys):
    from indexcache.cli import main
    path, _ = text
    assert main(["plan", "--config", str(path), "--hf-overrides",
                 '{"use_index_cache": true, "index_topk_pattern": "FSSF"}']) == 0
    out = capsys.readouterr().out
    assert "2 F / 2 S over 4 layers" in out and "pattern: FSSF" in out and "indexed layers 1, 2, 4, 5" in out
    assert "    2  S         layer 1" in out and "    4  S         layer 1" in out and "    5  F" in out
    assert main(["plan", "--config", str(path), "--json", "--hf-overrides",
                 '{"use_index_cache": true, "index_topk_freq": 2}']) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["pattern"] == "FFSF" and got["indexed_layers"] == SPARSE_IDS
    assert [r["layer"] for r in got["layers"]] == SPARSE_IDS and got["layers"][2]["source_layer"] == 2


# ============================================================================ serving paths

def test_paged_decode_and_chunked_prefill_equal_prefill(text):
    model = ours(text[0], {"use_index_cache": True, "index_topk_pattern": "FSSF"})
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, TEXT["vocab_size"], (n,), generator=g).tolist() for n in (37, 22)]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    single = run_paged(model, seqs[:1], [20], chunk=10_000)
    assert rel(single[0], full[0]) < 1e-5
    batched = run_paged(model, seqs, [30, 9], chunk=12)  # chunks cut through requests and mix them
    for got, want in zip(batched, full):
        assert rel(got, want) < 1e-5
    # a sync-free step (no host reads: the form a captured decode step needs) runs the full-attention
    # layers through the block-sparse op with one block spanning every key: the same rows
    cache = model.allocate_cache(4)
    cache.manager.allocate(0, 30)
    seq = torch.tensor(seqs[0][:30])
    model.forward_tokens(seq[:29], BatchMeta.paged_batch(cache, [0], [0], [29]), cache)
    step = BatchMeta.paged_batch(cache, [0], [29], [1])
    eager = model.forward_tokens(seq[29:], step, cache)
    assert rel(model.forward_tokens(seq[29:], step, cache, sync_free=True), eager) < 1e-5
    assert rel(model.compute_logits(eager)[0], full[0][29]) < 1e-5
    cache = model.allocate_cache(4)
    assert [t is not None for t in cache.index_k] == [i in (1, 5) for i in range(6)]  # F sparse layers only
    assert cache.k[0].shape == (4, 64, 2, 16) and cache.nbytes()["index_k"] == 2 * 4 * 64 * 16 * 4
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.allocate_cache(4, "fp8_ds_mla")


def test_generate_is_greedy_prefill(text):
    model = ours(text[0], {"use_index_cache": True, "index_topk_freq": 2})
    prompt = torch.randint(3, TEXT["vocab_size"], (9,), generator=torch.Generator().manual_seed(2)).tolist()
    res = generate(model, [prompt], 6, stop_tokens=[], prefill_chunk_size=4)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert res.tokens[0] == seq[len(prompt):]


def test_bf16_runs_close_to_fp32(text, ids):
    model = ours(text[0], dtype=torch.bfloat16)
    assert model.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    out = model(ids)
    # rows whose window fits in 2 blocks of 4 read all of it whatever the rounding of the scores
    assert torch.isfinite(out).all() and rel(out[:, :8], ours(text[0])(ids)[:, :8]) < 0.05



def test_step_reuse_is_refused_not_ignored(text):
    # its block selector has no reuse across decode steps: the key is an error, not a printed plan it ignores
    with pytest.raises(ValueError, match=r"index_reuse_steps 4: MiniMaxM3ForCausalLM .*across layers only"):
        ours(text[0], {"use_index_cache": True, "index_topk_freq": 2, "index_reuse_steps": 4})
