"""Qwen3.8-Flash-Next (``qwen4_exp_text`` and the text tower of ``qwen4_exp``) against transformers'
``Qwen4ExpForCausalLM`` / ``Qwen4ExpForConditionalGeneration`` (issue 34).

Tiny checkpoints written by transformers with random weights: Gated DeltaNet and indexed layers
(4 of 7), PLE on two linear layers, two residual streams, a softmax MoE with its gated shared
expert, partial RoPE, and QSA blocks of 4 tokens with a budget of 2 blocks, so that 40-token
prompts choose 2 of up to 10 complete blocks. transformers' block top-k breaks ties by
``Tensor.topk`` (which ReLU'd all-zero scores make common); it is patched to the ops' order (ties
toward the lower block, ``hf_weights.stable_topk``). IndexCache patterns are checked against
transformers patched the same way (``reuse_selection``): an S indexed layer's indexer returns the
token selection of the nearest earlier F indexed layer.
"""

import contextlib
import json
import warnings

import pytest
import torch
from hf_weights import choice_hooks, recorded_choices, row_errors, stable_topk
from test_model import run_paged

from indexcache.models import BatchMeta, from_pretrained
from indexcache.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextTower
from indexcache.runtime.generation import generate

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen4ExpForCausalLM"):
    pytest.skip("this transformers has no Qwen4ExpForCausalLM", allow_module_level=True)
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf_q  # noqa: E402

LIN, IDX = "linear_attention", "indexed_attention"
LAYER_TYPES = [LIN, IDX, LIN, IDX, IDX, LIN, IDX]
INDEXED = [1, 3, 4, 6]
TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                          "mrope_section": [2, 1, 1]},
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts_per_tok=2, num_experts=4, layer_types=LAYER_TYPES, hc_count=2, hc_lowrank=8,
            ple_layer_ids=[1, 3], ple_embed_dim=16, ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2,
            ngram_vocab_size_base=200, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def randomize_(model, seed):
    """Every weight random: the ``1 + w`` norms near 0, Gated DeltaNet's output norm near 1, decay
    rates spread, fan-in scaled matrices; the n-gram hash constants (buffers) kept."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif "norm" in name.split(".")[-2] or name.endswith("layernorm.weight"):
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("A_log"):
                t.copy_(torch.empty(t.shape).uniform_(0.5, 8, generator=g).log())
            elif name.endswith("dt_bias"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith(("embed_tokens.weight", "ngram_embedding.weight")):
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    return model.float().eval()


def hf_text(path, seed=0, **extra):
    model = randomize_(transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**{**TEXT, **extra})), seed)
    model.save_pretrained(path)
    return model


def patch(monkeypatch, model, pattern=None):
    """transformers with the ops' tie order and, for ``pattern`` (one F/S per indexed layer), S
    indexed layers reusing the selection of the nearest earlier F indexed layer."""
    model.config._attn_implementation = "eager"
    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)
    if pattern is None:
        return
    cfg = getattr(model.config, "text_config", model.config)
    indexed = [i for i, t in enumerate(cfg.layer_types) if t == IDX]
    shared = {layer for layer, c in zip(indexed, pattern) if c == "S"}
    original, last = hf_q.Qwen4ExpTextQSAIndexer.forward, {}

    def forward(self, *args, **kwargs):
        if self.layer_idx in shared:
            return last["selection"]
        last["selection"] = original(self, *args, **kwargs)
        return last["selection"]

    monkeypatch.setattr(hf_q.Qwen4ExpTextQSAIndexer, "forward", forward)


def hf_logits(model, ids, pattern=None):
    mp = pytest.MonkeyPatch()
    patch(mp, model, pattern)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()
    finally:
        mp.undo()


def ours(path, overrides=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every checkpoint tensor used or knowingly passed over
        return from_pretrained(path, hf_overrides=overrides, dtype=kw.pop("dtype", torch.float32), **kw)


@pytest.fixture(scope="module")
def ids():
    ids = torch.randint(3, TEXT["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(11))
    ids[0, 13] = ids[1, 27] = 2  # eos inside a prompt: the n-gram segments restart there
    return ids


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp")
    return path, hf_text(path, seed=21)


def _names(path):
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


# ============================================================================ against transformers

def test_without_index_cache_equals_transformers(text, ids, monkeypatch):
    path, ref = text
    from indexcache import ops, reference
    # the QSA selection is the fused op's: no per-block score matrix, no separate top-k
    monkeypatch.setattr(ops, "topk_indices", None)
    monkeypatch.setattr(reference, "indexer_logits", None)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in _names(path)  # the released (unfused) layout
    assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight" in _names(path)
    model = ours(path)
    assert type(model) is Qwen4ExpForCausalLM and model.indexed == INDEXED and model.plan.pattern == "FFFF"
    assert model.args.index_topk == 8 // 4 + 1 and model.topk_buffer.shape[1] == 3
    counts = model.indexer_param_count()
    assert [c > 0 for c in counts] == [t == IDX for t in LAYER_TYPES]  # linear layers have none
    want = hf_logits(ref, ids)
    got = model(ids)
    assert rel(got, want) < 1e-4
    # the selection matters: with a budget covering every block the logits move
    wide = ours(path, {"indexer_budget": 64})
    assert wide.args.indexer_budget == 64 and rel(wide(ids), want) > 1e-3


@pytest.mark.parametrize("overrides,pattern", [
    ({"use_index_cache": True, "index_topk_freq": 2}, "FFSF"),
    ({"use_index_cache": True, "index_topk_pattern": "FSSF"}, "FSSF"),
    ({"use_index_cache": True, "indexer_types": ["full", "shared", "full", "shared"]}, "FSFS"),
])
def test_patterns_equal_transformers_reusing_selections(text, ids, overrides, pattern):
    path, ref = text
    model = ours(path, overrides)
    assert model.plan.pattern == pattern
    for layer in (layer for layer, c in zip(INDEXED, pattern) if c == "S"):
        assert model.model.layers[layer].self_attn.indexer is None and model.indexer_param_count()[layer] == 0
    want = hf_logits(ref, ids, pattern)
    assert rel(model(ids), want) < 1e-4
    assert rel(want, hf_logits(ref, ids)) > 1e-3  # reuse changes what S layers attend over
    assert "over the indexed_attention layers 1, 3, 4, 6" in model.plan_summary()


def test_vl_checkpoint_loads_its_text_tower(tmp_path, ids):
    cfg = transformers.Qwen4ExpConfig(text_config=TEXT, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
        temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16))
    ref = randomize_(transformers.Qwen4ExpForConditionalGeneration(cfg), 4)
    ref.save_pretrained(tmp_path)
    names = _names(tmp_path)
    assert any(n.startswith("model.visual.") for n in names)
    assert "model.language_model.layers.1.self_attn.indexer.index_qk_proj.weight" in names
    model = ours(tmp_path)  # vision tensors passed over without a warning
    assert type(model) is Qwen4ExpTextTower and model.indexed == INDEXED
    assert rel(model(ids), hf_logits(ref, ids)) < 1e-4
    pattern = "FSFS"
    ic = ours(tmp_path, {"use_index_cache": True, "index_topk_pattern": pattern})
    assert rel(ic(ids), hf_logits(ref, ids, pattern)) < 1e-4
    ic.save_pretrained(tmp_path / "again")  # the VL names round-trip, S indexers absent, no vision tower
    again = _names(tmp_path / "again")
    assert not any(n.startswith("model.visual.") for n in again)
    assert not any(n.startswith("model.language_model.layers.3.self_attn.indexer.") for n in again)
    back = ours(tmp_path / "again", {"use_index_cache": True, "index_topk_pattern": pattern})
    assert torch.equal(back(ids), ic(ids))
    with pytest.raises(ValueError, match="needs its text_config"):
        Qwen4ExpTextTower.from_config({"model_type": "qwen4_exp"})
    # IndexCache settings shipped in text_config are the checkpoint's own
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"].update(use_index_cache=True, index_topk_freq=2)
    model = Qwen4ExpTextTower.from_config(cfg)
    assert model.plan.pattern == "FFSF" and "shipped" in model.plan_summary()


# ============================================================================ serving paths

def test_paged_decode_and_chunked_prefill_equal_prefill(text):
    model = ours(text[0], {"use_index_cache": True, "index_topk_pattern": "FSSF"})
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(3, TEXT["vocab_size"], (n,), generator=g).tolist() for n in (37, 22)]
    seqs[0][17] = 2
    full = [model(torch.tensor([s]))[0] for s in seqs]
    single = run_paged(model, seqs[:1], [20], chunk=10_000)
    assert rel(single[0], full[0]) < 1e-5
    batched = run_paged(model, seqs, [30, 9], chunk=12)  # chunks cut through requests and mix them
    for got, want in zip(batched, full):
        assert rel(got, want) < 1e-5
    cache = model.allocate_cache(4)
    assert [t is not None for t in cache.index_k] == [i in (1, 6) for i in range(7)]  # F indexed layers only
    assert [t is not None for t in cache.k] == [t == IDX for t in LAYER_TYPES]
    assert cache.states[0]["gdn"][1].shape == (4, 4, 8, 8) and cache.states[0]["ple"][0].shape == (4, 2)
    assert "gdn" not in cache.states[1] and "ple" not in cache.states[5]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.allocate_cache(4, "fp8_ds_mla")
    # request state slots: handed out on first use, returned on free, exhaustion is a clear error
    small = model.allocate_cache(4, max_num_seqs=1)
    for rid in (0, 1):
        small.manager.allocate(rid, 3)
    model.forward_tokens(torch.tensor([5, 6, 7]), BatchMeta.paged_batch(small, [0], [0], [3]), small)
    with pytest.raises(RuntimeError, match="state slots"):
        model.forward_tokens(torch.tensor([5, 6, 7]), BatchMeta.paged_batch(small, [1], [0], [3]), small)
    small.manager.free(0)
    small.manager.allocate(0, 4)
    with pytest.raises(ValueError, match="has no state"):  # a freed request cannot continue
        model.forward_tokens(torch.tensor([8]), BatchMeta.paged_batch(small, [0], [3], [1]), small)
    got = model.compute_logits(model.forward_tokens(torch.tensor([5, 6, 7]),
                                                    BatchMeta.paged_batch(small, [1], [0], [3]), small))
    assert rel(got, model(torch.tensor([[5, 6, 7]]))[0]) < 1e-5  # the reused slot starts empty
    # a sync-free step (a captured decode step) is refused with a clear error
    cache.manager.allocate(0, 3)
    with pytest.raises(ValueError, match="sync-free"):
        model.forward_tokens(torch.tensor([5, 6, 7]), BatchMeta.paged_batch(cache, [0], [0], [3]), cache,
                             sync_free=True)


def test_generate_equals_transformers_generate(text, monkeypatch):
    path, ref = text
    model = ours(path, {"use_index_cache": True, "index_topk_freq": 2})
    prompt = torch.randint(3, TEXT["vocab_size"], (1, 14), generator=torch.Generator().manual_seed(2))
    res = generate(model, [prompt[0].tolist()], 8, stop_tokens=[], prefill_chunk_size=5)
    patch(monkeypatch, ref, model.plan.pattern)
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert res.tokens[0] == want[0, 14:].tolist()


def fp32_choices(hf, ids):
    """transformers' fp32 logits and the discrete choices behind them: per layer the routed experts
    ``[rows, top_k]``, per indexed layer the QSA selection (its token mask ``[B, 1, S, S]``)."""
    hooks, choices = recorded_choices(hf.model.layers, lambda layer: True, lambda layer: layer.layer_type == IDX)
    with hooks:
        return hf_logits(hf, ids), choices


def block_rows(mask, ratio, blocks):
    """transformers' QSA token mask ``[B, 1, S, S]`` as this package's selection rows
    ``[B * S, blocks + 1]``: the selected complete blocks ascending (then -1), and the query's own
    incomplete block (or -1) last."""
    b, _, s, _ = mask.shape
    pos = torch.arange(s)
    starts = mask[:, 0, :, ::ratio]  # [B, S, ceil(S / r)]: block j's first token selected
    j = torch.arange(starts.shape[-1])
    picked = starts & ((j + 1) * ratio <= pos.unsqueeze(1) + 1)  # complete blocks only (the tail is apart)
    assert (picked.sum(-1) == ((pos + 1) // ratio).clamp(max=blocks)).all()  # the whole budget, as ours
    ids = torch.where(picked, j, starts.shape[-1]).sort(dim=-1).values[..., :blocks]
    ids = torch.where(ids == starts.shape[-1], -1, ids)
    tail = torch.where((pos + 1) % ratio != 0, pos // ratio, -1).expand(b, s).unsqueeze(-1)
    return torch.cat([ids, tail], dim=-1).reshape(b * s, blocks + 1).to(torch.int32)


def rerouted(logits, experts, weights, forced, norm):
    """A softmax router's ``(experts, weights)`` with the rows whose expert set differs from
    ``forced`` given the forced experts instead, weighted by this router's own softmax there
    (renormalised when ``norm``); the other rows keep their own."""
    same = (experts.sort(dim=-1).values == forced.sort(dim=-1).values).all(dim=-1, keepdim=True)
    picked = torch.softmax(logits.float(), dim=-1).gather(1, forced.long())
    if norm:
        picked = picked / picked.sum(dim=-1, keepdim=True)
    return torch.where(same, experts, forced.to(experts.dtype)), torch.where(same, weights, picked.to(weights.dtype))


@contextlib.contextmanager
def forced(layers, choices, norm, transformers_side):
    """``layers`` (transformers' or ours) take ``choices`` instead of their own: each router the
    given experts where its own differ (``rerouted``), each QSA indexer the given selection (ours
    as block rows written over the shared top-k rows). Yields the set of choices applied."""
    used = set()
    r, blocks = TEXT["indexer_compress_ratio"], TEXT["indexer_budget"] // TEXT["indexer_compress_ratio"]

    def route(i):
        def hook(gate, args, out):
            used.add(("experts", i))
            if transformers_side:
                experts, weights = rerouted(out[0], out[2], out[1], choices[("experts", i)], norm)
                return out[0], weights, experts
            return rerouted(torch.nn.functional.linear(args[0], gate.weight), *out, choices[("experts", i)], norm)
        return hook

    def select(i):
        def hook(indexer, args, out):
            used.add(("selection", i))
            if transformers_side:
                return choices[("selection", i)]
            rows = block_rows(choices[("selection", i)], r, blocks)
            out[:rows.shape[0]] = rows.to(out.device)
            return out
        return hook
    with choice_hooks(layers, choices, route, select):
        yield used


def test_bf16_error_within_twice_transformers_bf16(tmp_path, ids):
    """Our bf16 model (``from_pretrained(..., dtype=torch.bfloat16)`` on the checkpoint
    ``save_pretrained`` wrote) against transformers' fp32 logits errs at most twice as much as
    transformers' own bf16 model (``Qwen4ExpForCausalLM.from_pretrained(..., dtype=torch.bfloat16)``),
    the median over rows of each row's relative error, on a fresh random checkpoint, all 80 rows.
    Both bf16 models replay the fp32 run's discrete choices: each softmax router keeps its own experts
    and weights on rows where its expert set is fp32's, elsewhere takes fp32's experts weighted by its
    own softmax; each F indexed layer's QSA indexer returns fp32's selection (transformers' token
    mask; for ours the same blocks as selection rows). Left to choose, a bf16 model flips a few of the
    560 routing decisions and of the QSA block picks per checkpoint (near-ties within bf16 rounding),
    transformers' about as often as ours, and the flipping side's error moves with them: forcing makes
    the comparison one of rounding alone. The replay is checked exact first: our fp32 model under the
    same forcing still equals transformers' fp32. docs/model.md, "Qwen3.8-Flash-Next in bf16", has
    the numbers."""
    hf = hf_text(tmp_path, seed=int(torch.randint(0, 1 << 30, ())))
    model = ours(tmp_path, dtype=torch.bfloat16)
    theirs_model = transformers.Qwen4ExpForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    for m in (model, theirs_model):
        assert m.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(model(ids)).all()
    want, choices = fp32_choices(hf, ids)
    assert set(choices) == {("experts", i) for i in range(7)} | {("selection", i) for i in INDEXED}
    norm = hf.config.norm_topk_prob
    fp32 = ours(tmp_path)
    with forced(fp32.model.layers, choices, norm, transformers_side=False) as used:
        assert rel(fp32(ids), want) < 1e-4
    assert used == set(choices)
    with forced(theirs_model.model.layers, choices, norm, transformers_side=True) as used:
        theirs = row_errors(hf_logits(theirs_model, ids), want)
    assert used == set(choices)
    with forced(model.model.layers, choices, norm, transformers_side=False) as used:
        out = model(ids)
    assert used == set(choices)
    mine = row_errors(out, want)
    assert torch.isfinite(out).all() and mine.median() < 2 * theirs.median(), (mine.median(), theirs.median())


def test_bf16_generate_follows_transformers_bf16(text, monkeypatch):
    """Greedy decode of our bf16 model (IndexCache FFSF, chunked prefill, paged decode) gives
    transformers' bf16 ``generate()`` tokens (patched to reuse the same way), up to a step where
    transformers' fp32 logits on the common prefix hold a near-tie: there both tokens must lie within
    transformers' own bf16 rounding of the fp32 maximum, and the runs part. (Over 12 fresh all-F
    checkpoints, 8 tokens: equal on 10; the other two parted on fp32 top-2 margins of 1.4e-4 and
    2.2e-4, where transformers' bf16 logits, rounded to bf16, tie exactly and argmax takes the lower
    id; ours keeps fp32 logits. docs/model.md, "Qwen3.8-Flash-Next in bf16".)"""
    path, ref = text
    pattern = {"use_index_cache": True, "index_topk_freq": 2}
    model = ours(path, pattern, dtype=torch.bfloat16)
    prompt = torch.randint(3, TEXT["vocab_size"], (1, 14))
    got = generate(model, [prompt[0].tolist()], 8, stop_tokens=[], prefill_chunk_size=5).tokens[0]
    theirs = transformers.Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    patch(monkeypatch, theirs, model.plan.pattern)
    with torch.no_grad():
        want = theirs.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               pad_token_id=0)[0, 14:].tolist()
    monkeypatch.undo()
    same = next((k for k in range(8) if got[k] != want[k]), 8)
    if same < 8:  # a near-tie of fp32's: both choices within transformers' bf16 rounding of its top
        seq = torch.tensor([prompt[0].tolist() + got[:same]])
        fp32 = hf_logits(ref, seq, model.plan.pattern)[0, -1]
        tol = float((hf_logits(theirs, seq, model.plan.pattern)[0, -1] - fp32).abs().max())
        assert fp32.max() - fp32[got[same]] <= tol and fp32.max() - fp32[want[same]] <= tol, (same, got, want)


# ============================================================================ tools and errors

def test_plan_command_covers_the_indexed_layers(text, capsys):
    from indexcache.cli import main
    path, _ = text
    assert main(["plan", "--config", str(path), "--hf-overrides",
                 '{"use_index_cache": true, "index_topk_pattern": "FSSF"}']) == 0
    out = capsys.readouterr().out
    assert "2 F / 2 S over 4 layers" in out and "pattern: FSSF" in out and "indexed layers 1, 3, 4, 6" in out
    assert main(["plan", "--config", str(path), "--json", "--hf-overrides",
                 '{"use_index_cache": true, "index_topk_freq": 2}']) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["pattern"] == "FFSF" and got["indexed_layers"] == INDEXED
    # what IndexCache removes, in QSA's terms: 1 of 4 F indexed layers' projection, block scoring, raw keys
    costs = got["costs"]
    assert costs["compress_ratio"] == 4 and costs["dims"]["index_n_heads"] == 2
    cache = costs["index_k_cache_bytes_per_sequence"]
    assert cache["all_f"] == 4 * costs["context"] * 16 * 2 and cache["removed_fraction"] == 0.25
    ctx, per_block, proj = 10, 2 * 2 * 16 + 2, 2 * 32 * 3 * 16
    assert main(["plan", "--config", str(path), "--json", "--context", str(ctx)]) == 0
    prefill = json.loads(capsys.readouterr().out)["costs"]["prefill_flops"]["all_f"]
    assert prefill == 4 * (ctx * proj + sum((t + 1) // 4 for t in range(ctx)) * per_block)


def test_pattern_tools_run(text, tmp_path, capsys):
    from indexcache.cli import main
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(text[0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "indexcache_tokenizer": "bytes"}))  # byte-level ids
    sample = tmp_path / "t.txt"
    sample.write_bytes(bytes(torch.randint(32, 127, (400,), generator=torch.Generator().manual_seed(3)).tolist()))
    common = ["--model", str(path), "--text", str(sample), "--context", "40", "--windows", "2"]
    assert main(["overlap", *common]) == 0
    out = capsys.readouterr().out
    assert "are layers 1, 3, 4, 6" in out and "QSA block (2 of 4 tokens) overlap" in out
    # by hand: per query row with more complete blocks than the budget, the share of indexed layer
    # i's blocks (the selected ones and the query's own) that indexed layer j also reads
    from indexcache.tools.patterns import PatternRunner, load_all_full, overlap_matrix, text_windows
    windows = text_windows(sample.read_bytes(), 40, 2)
    model = load_all_full(path)
    m = overlap_matrix(model, windows)
    state = PatternRunner(model, windows).run("FFFF")
    pos = torch.arange(40).repeat(2)
    for i, j in ((0, 1), (3, 2)):
        shares = []
        for row in range(pos.shape[0]):
            if (pos[row] + 1) // 4 <= 2:
                continue
            a = {int(b) for b in state.rows[i][row] if b >= 0}
            b = {int(b) for b in state.rows[j][row] if b >= 0}
            shares.append(len(a & b) / len(a))
        assert float(m[i, j]) == pytest.approx(sum(shares) / len(shares), abs=1e-6)  # fp32 shares there
    assert main(["search", *common]) == 0
    capsys.readouterr()
    assert main(["eval", *common, "--overrides", '{"use_index_cache": true, "index_topk_pattern": "FSFS"}']) == 0
    assert "FSFS" in capsys.readouterr().out


def test_config_errors_name_the_field(text):
    cfg = json.loads((text[0] / "config.json").read_text())
    cases = [
        ({"layer_types": [LIN, IDX]}, "layer_types"),
        ({"layer_types": [LIN, "sliding_attention", LIN, IDX, IDX, LIN, IDX]}, "layer_types"),
        ({"ple_layer_ids": [2]}, "ple_layer_ids"),
        ({"ple_layer_ids": [9]}, "ple_layer_ids"),
        ({"indexer_budget": 10}, "indexer_budget 10 is not a multiple of indexer_compress_ratio 4"),
        ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
        ({"indexer_head_dim": None}, "indexer_head_dim"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"output_gate_type": "gelu"}, "output_gate_type"),
        ({"ple_embed_dim": 18}, "ple_embed_dim 18"),
        ({"layer_types": [IDX] * 7, "ple_layer_ids": []}, None),  # every layer indexed: fine
    ]
    for change, match in cases:
        if match is None:
            assert Qwen4ExpForCausalLM.from_config({**cfg, **change}).indexed == list(range(7))
            continue
        with pytest.raises(ValueError, match=match):
            Qwen4ExpForCausalLM.from_config({**cfg, **change})
    with pytest.raises(ValueError, match="pattern"):  # one character per indexed layer (4), not per layer (7)
        Qwen4ExpForCausalLM.from_config(cfg, {"use_index_cache": True, "index_topk_pattern": "FSSFFSS"})
    with pytest.raises(ValueError, match="index_topk_pattern has 3 entries but the model has 4"):  # too short
        Qwen4ExpForCausalLM.from_config(cfg, {"use_index_cache": True, "index_topk_pattern": "FSS"})
    with pytest.raises(ValueError, match="indexer_types has 2 entries"):
        Qwen4ExpForCausalLM.from_config(cfg, {"use_index_cache": True, "indexer_types": ["full", "shared"]})
    with pytest.raises(ValueError, match="index_reuse_steps"):  # step reuse runs here (test_hybrid_step_reuse.py)
        Qwen4ExpForCausalLM.from_config(cfg, {"use_index_cache": True, "index_reuse_steps": 0})


def test_another_shape_equals_transformers(tmp_path):
    """Default layer_types (every fourth layer indexed), no PLE, a sigmoid output gate, three
    streams, as many value as key heads, a wider index head, an odd budget of 3 blocks of 3."""
    extra = dict(layer_types=None, num_hidden_layers=8, ple_layer_ids=None, output_gate_type="sigmoid", hc_count=3,
                 linear_num_value_heads=2, indexer_head_dim=24, indexer_n_heads=3, indexer_budget=9,
                 indexer_compress_ratio=3, num_experts=3, num_experts_per_tok=1, norm_topk_prob=False)
    ref = hf_text(tmp_path, seed=33, **extra)
    ids = torch.randint(0, TEXT["vocab_size"], (1, 33), generator=torch.Generator().manual_seed(34))
    model = ours(tmp_path)
    assert model.indexed == [3, 7] and model.args.hc_count == 3 and not model.args.ple_layer_ids
    assert rel(model(ids), hf_logits(ref, ids)) < 1e-4
    shared = ours(tmp_path, {"use_index_cache": True, "index_topk_pattern": "FS"})
    assert shared.model.layers[7].self_attn.indexer is None
    assert rel(shared(ids), hf_logits(ref, ids, "FS")) < 1e-4
    seq = ids[0].tolist()
    assert rel(run_paged(shared, [seq], [11], chunk=5)[0], shared(ids)[0]) < 1e-5


# ============================================================================ issue 34 audit additions

def test_cli_generate_equals_transformers_generate(text, tmp_path, capsys, monkeypatch):
    """The user's path: ``indexcache generate --json`` (fp32, chunked prefill, no IndexCache) gives
    transformers' greedy ``generate()`` tokens (its own cache path; ties toward the lower block)."""
    from indexcache.cli import main
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(text[0], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "indexcache_tokenizer": "bytes"}))
    prompt = "Qwen3.8-Flash-Next, "
    assert main(["generate", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "8", "--dtype", "fp32",
                 "--prefill-chunk-size", "7", "--no-warmup", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = [TEXT["bos_token_id"]] + list(prompt.encode())  # the byte tokenizer puts the config's BOS first
    assert got["prompt_tokens"] == len(ids) and max(ids) < TEXT["vocab_size"]
    patch(monkeypatch, text[1])
    with torch.no_grad():
        want = text[1].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = want[0, len(ids):].tolist()
    assert got["tokens"] == want, (got["tokens"], want, got["finish_reason"])
    assert len(want) == 8 or want[-1] == TEXT["eos_token_id"]


def test_pattern_tools_against_transformers(text, tmp_path, capsys):
    """``overlap`` counted from transformers' own QSA selections (its token masks as block rows);
    every greedy-search loss (steps and candidates) and eval's loss equal the cross-entropy of
    transformers' logits under that pattern (patched to reuse) and of a model loaded with it."""
    from indexcache.cli import main
    from indexcache.tools.patterns import load_all_full, overlap_matrix, text_windows
    import shutil
    path, ref = text[0], text[1]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "indexcache_tokenizer": "bytes"}))
    sample = tmp_path / "t.txt"
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    sample.write_bytes(bytes(torch.randint(32, 127, (400,), generator=g).tolist()))
    windows = text_windows(sample.read_bytes(), 40, 2)
    inputs, targets = windows[:, :-1], windows[:, 1:].reshape(-1)
    m = overlap_matrix(load_all_full(ckpt), windows)
    want_logits, choices = fp32_choices(ref, inputs)
    pos = torch.arange(40).repeat(2)
    real = (pos + 1) // 4 > 2
    sets = [[{int(b) for b in row if b >= 0} for row in block_rows(choices[("selection", layer)], 4, 2)[real]]
            for layer in INDEXED]
    for i in range(4):
        for j in range(4):
            want = sum(len(a & b) / len(a) for a, b in zip(sets[i], sets[j])) / len(sets[i])
            assert float(m[i, j]) == pytest.approx(want, abs=1e-6), (i, j)
    assert m.min() < 0.99

    def hf_loss(p):
        return float(torch.nn.functional.cross_entropy(hf_logits(ref, inputs, p).reshape(80, -1), targets))

    common = ["--model", str(ckpt), "--text", str(sample), "--context", "40", "--windows", "2"]
    assert main(["search", *common, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert [s["num_full"] for s in steps] == [4, 3, 2, 1]
    trials = {s["pattern"]: s["loss"] for s in steps}
    for prev, s in zip(steps, steps[1:]):
        trials |= {prev["pattern"][:int(k)] + "S" + prev["pattern"][int(k) + 1:]: v for k, v in s["candidates"].items()}
    assert len(trials) == 7
    for p, loss in trials.items():
        model = ours(ckpt, {"use_index_cache": True, "index_topk_pattern": p})
        assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(model(inputs).reshape(80, -1), targets)),
                                     rel=1e-5), p
        assert loss == pytest.approx(hf_loss(p), rel=1e-4), p
    assert main(["eval", *common, "--json", "--overrides", '{"use_index_cache": true, "index_topk_pattern": "FSFS"}'
                 ]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out)["rows"] if r["pattern"] == "FSFS")
    assert row["loss_nats"] == pytest.approx(hf_loss("FSFS"), rel=1e-4)


@pytest.mark.parametrize("block_size", [4, 6])
def test_decode_across_pages_equals_the_full_forward(text, block_size):
    """Pages of 4 and 6 tokens (the other decode tests' 64-token pages hold a whole request; 6: QSA
    blocks of 4 straddle pages): K, V and raw index keys of a request over several blocks."""
    model = ours(text[0], {"use_index_cache": True, "index_topk_pattern": "FSSF"})
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    seqs = [torch.randint(3, TEXT["vocab_size"], (n,), generator=g).tolist() for n in (37, 22)]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    for got, want in zip(run_paged(model, seqs, [19, 6], chunk=7, block_size=block_size), full):
        assert rel(got, want) < 1e-5
