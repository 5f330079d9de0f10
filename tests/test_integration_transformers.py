"""``indexcache.integrations.transformers.enable`` (issue 23) against independent references.

- GLM-5 (``GlmMoeDsaForCausalLM``): enabled logits equal transformers' own forward of the same
  checkpoint, with the ``indexer_types`` the checkpoint ships and with ``hf_overrides`` replacing
  them (the reference is transformers loaded with the same plan, so it drops the same indexers).
  transformers' ``torch.topk`` breaks ties arbitrarily; the ops break them toward the lower
  position (docs/ops.md), so the reference runs with a stable top-k that does the same
  (``lower_position_ties``). Few indexer heads make exact ties (every ReLU term 0) common.
- DeepSeek-V3.2 with a pattern: equal to this project's own model (``indexcache.models``) loaded
  from the same checkpoint.
- ``generate()``: greedy and beam tokens equal the unpatched model's; the enabled model's cached
  decode (fp8 index-K cache included) reproduces its own whole-sequence logits.
- Batches of two without padding, left padding, and two sequences packed in one row.
- Every error path of ``enable``.
- Every test that runs the ops runs on each CPU path this CPU has (``cpu_isa``: 'auto' and each
  forced path that differs from it; a path the CPU lacks is skipped with its reason), so a bf16
  or fp32 model agrees with transformers whichever kernels a CPU kind takes.

Prompts are longer than ``index_topk`` (16), so dense attention could not pass.
"""

import json
import warnings

import pytest
import torch
from hf_weights import stable_topk

from indexcache.tools.random_weights import randomize_

transformers = pytest.importorskip("transformers")

from indexcache.integrations import transformers as ict  # noqa: E402
from indexcache.integrations.transformers import enable  # noqa: E402

try:
    ict.check_transformers_version()
    UNSUPPORTED = None
except ValueError as e:  # another transformers release installed: only the refusal itself is tested
    UNSUPPORTED = str(e)
needs_supported = pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or "")

# The kernels' widths (512 latent, 64 RoPE, 128 indexer) with everything else tiny.
WIDTHS = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
              num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=16,
              v_head_dim=24, index_topk=16, index_head_dim=128, index_n_heads=4, first_k_dense_replace=1,
              max_position_embeddings=512, n_group=2, topk_group=1, eos_token_id=None, pad_token_id=0)
# fp8 scoring on both sides from q / k computed by different code (transformers' modules here, the
# project's there): a value whose rounding lands on an e4m3 boundary may move one selected key.
FP8_BAR = 2e-2
CLASSES = {"glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
           "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM")}


@pytest.fixture(autouse=True)
def one_thread():
    """The models are tiny: a second thread only adds contention (10x slower on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def write_checkpoint(path, family, seed, **extra):
    """A transformers model with every weight drawn at random, written by its own save_pretrained."""
    cfg_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
    model = model_cls(cfg_cls(**{**WIDTHS, **extra}))
    randomize_(model, seed)
    model.save_pretrained(path)
    return path


def load(path, family, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, CLASSES[family][1]).from_pretrained(path, dtype=torch.float32,
                                                                          attn_implementation="eager", **kw)
    return model.eval()


@pytest.fixture
def lower_position_ties(monkeypatch):
    """transformers' indexer with ties broken toward the lower position, as the ops do."""
    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)


def prompts(batch, length, seed):
    return torch.randint(1, WIDTHS["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits


# ============================================================================ GLM-5 against transformers

@needs_supported
def test_glm_shipped_indexer_types(tmp_path, monkeypatch, cpu_isa):
    path = write_checkpoint(tmp_path, "glm_moe_dsa", seed=1, indexer_types=["full", "shared", "full", "shared"])
    ids = prompts(2, 60, seed=2)
    ref = load(path, "glm_moe_dsa")
    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)
    want = logits(ref, ids)
    monkeypatch.undo()
    model = enable(load(path, "glm_moe_dsa"), indexer_fp8=False)
    assert model.indexcache_plan.pattern == "FSFS"
    assert "shipped" in model.indexcache_summary and "fp32" in model.indexcache_summary
    got = logits(model, ids)
    assert torch.isfinite(got).all() and rel(got, want) < 1e-5
    # the default (fp8 + Hadamard) against this project's own GLM model with the same numerics
    from indexcache.models import from_pretrained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        assert rel(logits(enable(load(path, "glm_moe_dsa")), ids), ours(ids)) < FP8_BAR


@pytest.mark.parametrize("overrides,pattern", [
    ({"use_index_cache": True, "index_topk_freq": 2}, "FFSF"),
    ('{"use_index_cache": true, "index_topk_pattern": "FSSF"}', "FSSF"),
])
@needs_supported
def test_glm_overrides_replace_shipped_indexer_types(tmp_path, overrides, pattern, lower_position_ties, cpu_isa):
    # transformers writes indexer_types (all "full") into every GLM config it saves; the user's
    # freq / pattern replaces it (DESIGN §2)
    path = write_checkpoint(tmp_path, "glm_moe_dsa", seed=3)
    assert json.loads((path / "config.json").read_text())["indexer_types"] == ["full"] * 4
    ids = prompts(2, 50, seed=4)
    ref = load(path, "glm_moe_dsa", indexer_types=["full" if c == "F" else "shared" for c in pattern])
    model = enable(load(path, "glm_moe_dsa"), hf_overrides=overrides, indexer_fp8=False)
    assert model.indexcache_plan.pattern == pattern
    assert "replaced by --hf-overrides" in model.indexcache_summary
    # S layers' indexers are detached
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [c == "S" for c in pattern]
    assert rel(logits(model, ids), logits(ref, ids)) < 1e-5


# ============================================================================ DeepSeek-V3.2 against this project's model

@pytest.mark.parametrize("fp8", [False, None])
@needs_supported
def test_deepseek_v32_pattern_equals_project_model(tmp_path, fp8, cpu_isa):
    from indexcache.models import from_pretrained

    path = write_checkpoint(tmp_path, "deepseek_v32", seed=5)
    overrides = {"use_index_cache": True, "index_topk_pattern": "FSSF"}
    ids = prompts(2, 48, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = from_pretrained(path, hf_overrides=overrides, dtype=torch.float32, indexer_fp8=fp8)
    assert ours.plan.pattern == "FSSF"
    model = enable(load(path, "deepseek_v32"), hf_overrides=overrides, indexer_fp8=fp8)
    assert model.indexcache_plan.pattern == "FSSF"
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, True, False]
    with torch.no_grad():
        want = ours(ids)
    assert rel(logits(model, ids), want) < (1e-4 if fp8 is False else FP8_BAR)


@needs_supported
def test_deepseek_v32_all_full_equals_transformers(tmp_path, lower_position_ties, cpu_isa):
    # no overrides: V3.2 has no IndexCache in transformers, every layer F
    path = write_checkpoint(tmp_path, "deepseek_v32", seed=7)
    ids = prompts(2, 40, seed=8)
    want = logits(load(path, "deepseek_v32"), ids)
    model = enable(load(path, "deepseek_v32"), indexer_fp8=False)
    assert model.indexcache_plan.pattern == "FFFF" and "IndexCache off" in model.indexcache_summary
    assert rel(logits(model, ids), want) < 1e-5


# ============================================================================ generate()

@pytest.fixture(scope="module")
def glm_path(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("glm"), "glm_moe_dsa", seed=9,
                            indexer_types=["full", "shared", "full", "shared"])


@pytest.mark.parametrize("num_beams", [1, 2])
@needs_supported
def test_generate_equals_unpatched(glm_path, num_beams, lower_position_ties, cpu_isa):
    ids = prompts(2, 40, seed=10)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, num_beams=num_beams)
    want = load(glm_path, "glm_moe_dsa").generate(ids, **kw)
    got = enable(load(glm_path, "glm_moe_dsa"), indexer_fp8=False).generate(ids, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", [None, False])
@needs_supported
def test_cached_decode_equals_whole_sequence(glm_path, fp8, cpu_isa):
    # the latent and index-K caches (132-byte fp8 rows by default) give the same logits step by
    # step as one forward over the whole sequence
    model = enable(load(glm_path, "glm_moe_dsa"), indexer_fp8=fp8)
    ids = prompts(2, 30, seed=11)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    step_logits = torch.stack(out.logits, dim=1)  # [B, 8, vocab]
    whole = logits(model, out.sequences, use_cache=False)[:, 29:-1]
    assert rel(step_logits, whole) < 1e-5


@needs_supported
def test_crop_then_continue(glm_path, cpu_isa):
    # assisted decoding crops the cache; the latent and index-K caches crop with it
    model = enable(load(glm_path, "glm_moe_dsa"))
    ids = prompts(1, 36, seed=12)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        # F layers (0, 2) hold 132-byte fp8 index-K rows, S layers (1, 3) none; every layer one
        # 576-wide latent row per token
        for i, layer in enumerate(cache.layers):
            assert layer.keys.shape == (1, 1, 36, 576) and layer.values.shape[-1] == 0
            if i % 2 == 0:
                assert layer.indexer_keys.dtype == torch.uint8 and layer.indexer_keys.shape == (1, 36, 132)
            else:
                assert layer.indexer_keys is None
        cache.crop(-6)
        assert cache.get_seq_length() == 30
        tail = model(input_ids=ids[:, 30:], cache=cache, use_cache=True).logits
    assert rel(tail, logits(model, ids, use_cache=False)[:, 30:]) < 1e-5


# ============================================================================ batches

@needs_supported
def test_left_padded_batch_equals_single_prompts(glm_path, cpu_isa):
    model = enable(load(glm_path, "glm_moe_dsa"))
    a, b = prompts(1, 40, seed=13), prompts(1, 28, seed=14)
    ids = torch.cat((a, torch.cat((torch.zeros(1, 12, dtype=torch.long), b), dim=1)))
    mask = torch.cat((torch.ones(1, 40), torch.cat((torch.zeros(1, 12), torch.ones(1, 28)), dim=1))).long()
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for i, p in enumerate((a, b)):
        alone = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=6, do_sample=False)
        assert torch.equal(batch[i, 40:], alone[0, p.shape[1]:])


@needs_supported
def test_two_sequences_packed_in_one_row(glm_path, cpu_isa):
    # padding-free packing: position_ids restart at 0 and transformers' mask is block-diagonal
    model = enable(load(glm_path, "glm_moe_dsa"))
    a, b = prompts(1, 36, seed=15), prompts(1, 30, seed=16)
    position_ids = torch.cat((torch.arange(36), torch.arange(30))).view(1, -1)
    with torch.no_grad():
        packed = model(input_ids=torch.cat((a, b), dim=1), position_ids=position_ids, use_cache=False).logits
    assert rel(packed[:, :36], logits(model, a, use_cache=False)) < 1e-5
    assert rel(packed[:, 36:], logits(model, b, use_cache=False)) < 1e-5


# ============================================================================ errors

@needs_supported
def test_errors(glm_path, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is not supported; supported transformers classes"):
        enable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="is not supported"):
        enable(load(glm_path, "glm_moe_dsa").model)  # the bare decoder stack, not the causal LM
    with pytest.raises(ValueError, match=r"transformers 5\.40\.0 is not supported"):
        ict.check_transformers_version("5.40.0")
    with pytest.raises(ValueError, match=r"transformers 5\.23\.1 is not supported"):
        ict.check_transformers_version("5.23.1")
    ict.check_transformers_version("5.24.0")
    with monkeypatch.context() as m:
        m.setattr(ict, "_installed_version", lambda: "5.30.0")
        with pytest.raises(ValueError, match="not supported"):
            enable(load(glm_path, "glm_moe_dsa"))

    model = load(glm_path, "glm_moe_dsa")
    with pytest.raises(ValueError, match="indexer_fp8 must be"):
        enable(model, indexer_fp8="yes")
    with pytest.raises(ValueError, match="cannot apply --hf-overrides max_position_embeddings"):
        enable(model, hf_overrides={"max_position_embeddings": 8})
    with pytest.raises(ValueError, match="not valid JSON"):
        enable(model, hf_overrides="{use_index_cache")
    with pytest.raises(ValueError, match="layer 0 must be 'F'"):
        enable(model, hf_overrides={"use_index_cache": True, "index_topk_pattern": "SFFF"})
    with pytest.raises(ValueError, match="index_topk must be"):
        enable(model, hf_overrides={"index_topk": 0})
    # layer 1 ships "shared": transformers loaded no indexer there, so a plan making it F is refused
    with pytest.raises(ValueError, match="makes layer 1 F .* no indexer"):
        enable(model, hf_overrides={"use_index_cache": True, "index_topk_pattern": "FFSS"})
    # a refused enable() changed nothing
    assert getattr(model, "_indexcache_state", None) is None
    assert not any("forward" in vars(layer.self_attn) for layer in model.model.layers)
    assert not model.model._forward_pre_hooks
    enable(model)
    with pytest.raises(ValueError, match="already called"):
        enable(model)
    ids = prompts(1, 20, seed=17)
    with pytest.raises(ValueError, match="StaticCache|DynamicCache"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                       cache_implementation="static")
    model.train()
    with pytest.raises(RuntimeError, match="inference only"):
        model(input_ids=ids)
    model.eval()
    # a cache filled by the unpatched model holds expanded-layout latents: refused, not misread
    plain = load(glm_path, "glm_moe_dsa")
    cache = transformers.DynamicCache(config=plain.config)
    with torch.no_grad():
        plain(input_ids=ids, cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="filled by the model before enable"):
            model(input_ids=ids[:, :1], cache=cache, use_cache=True)
    # widths the kernels do not take
    small = write_checkpoint(tmp_path / "small", "glm_moe_dsa", seed=18, kv_lora_rank=32, qk_rope_head_dim=8,
                             index_head_dim=16)
    with pytest.raises(ValueError, match="kv_lora_rank=32, qk_rope_head_dim=8, index_head_dim=16"):
        enable(load(small, "glm_moe_dsa"))


@needs_supported
def test_disable_undoes_every_change(tmp_path):
    """disable() puts back every change enable() lists: transformers' forward, the S layers'
    indexers (the state dict lacks them only while enabled), skip_topk, the attention
    implementation, the hook and the attributes; the logits are the unpatched model's again."""
    path = write_checkpoint(tmp_path, "glm_moe_dsa", seed=21)
    ids = prompts(2, 30, seed=22)
    want = logits(load(path, "glm_moe_dsa"), ids)
    model = load(path, "glm_moe_dsa")
    keys, impl = set(model.state_dict()), model.config._attn_implementation
    attns = [layer.self_attn for layer in model.model.layers]
    skip = [getattr(a, "skip_topk", None) for a in attns]
    enable(model, hf_overrides={"use_index_cache": True, "index_topk_pattern": "FSSF"})
    assert model.indexcache_changes == ict.CHANGES
    assert all("forward" in vars(a) for a in attns) and [a.indexer is None for a in attns] == [False, True, True, False]
    gone = keys - set(model.state_dict())
    assert gone and all(".self_attn.indexer." in k and (".layers.1." in k or ".layers.2." in k) for k in gone)
    assert ict.disable(model) is model
    assert set(model.state_dict()) == keys and model.config._attn_implementation == impl
    assert all("forward" not in vars(a) and a.indexer is not None for a in attns)
    assert [getattr(a, "skip_topk", None) for a in attns] == skip
    assert not model.model._forward_pre_hooks
    assert not any(hasattr(model, n) for n in ("_indexcache_state", "indexcache_plan", "indexcache_summary",
                                               "indexcache_changes"))
    assert torch.equal(logits(model, ids), want)
    with pytest.raises(ValueError, match="needs a model that enable"):
        ict.disable(model)
    # again, with the model cast while enabled: the detached indexers follow it back
    ict.disable(enable(model, hf_overrides={"use_index_cache": True, "index_topk_pattern": "FSSF"}).to(torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert set(model.state_dict()) == keys


@needs_supported
def test_bf16_model(glm_path, lower_position_ties, cpu_isa):
    # a bf16 model: bf16 latent cache and sparse MLA; with transformers' fp32 scores of the same bf16
    # q / k it selects what transformers selects, and attends in bf16 (absorbed vs its expanded form).
    # Read per position: the two forms differ by bf16 noise (median 1.4-1.8e-2 over prompt seeds
    # 19-30, on every CPU path), and that noise flips a near-tie of a later layer's top-16 or expert
    # routing at a few positions, whose logits then move 0.1-1.2 (which positions, and how many, differs
    # by path: 2 of 80 on avx512bf16 and 5 on an AMX Xeon's blas path for this seed). A wrong layer plan
    # (FSSS instead of the shipped FSFS) reads median 0.09-0.19, 75th percentile 0.29-0.36.
    ids = prompts(2, 40, seed=19)
    want = logits(load(glm_path, "glm_moe_dsa").to(torch.bfloat16), ids)
    model = enable(load(glm_path, "glm_moe_dsa").to(torch.bfloat16), indexer_fp8=False)
    got = logits(model, ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    per_position = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)
    assert per_position.median() < 2.5e-2 and per_position.quantile(0.75) < 6e-2, per_position
    # fp8 indexer from bf16 q / k, the model converted after enable (the absorbed weights follow)
    model = enable(load(glm_path, "glm_moe_dsa")).to(torch.bfloat16)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 44) and all(torch.isfinite(x).all() for x in out.logits)
    assert model.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16


def test_installed_version_outside_the_range_is_refused(monkeypatch):
    monkeypatch.setattr(ict, "_installed_version", lambda: "5.40.0")
    with pytest.raises(ValueError, match=r"transformers 5\.40\.0 is not supported.*>=5\.24\.0,<5\.25"):
        enable(torch.nn.Linear(2, 2))
