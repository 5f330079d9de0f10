"""GLM-5.3-Flash (``glm5_next``) against transformers' ``Glm5NextForConditionalGeneration`` (issue 34).

Tiny VL checkpoints written by transformers' ``save_pretrained`` with random weights (a one-block
vision tower, which the model passes over): KDA and indexed layers, dense and MoE MLPs,
hyper-connections with two streams, pools of 4 keys and index_topk 8 (2 pools + a tail of up to 3)
so that 37-token prompts select from up to 9 pools. Pools tie often (a head weight ``w_h(x)`` of
either sign puts every pool whose ReLU terms all vanish at score 0, on top when the others are
negative): transformers' ``torch.topk`` breaks ties arbitrarily, this package toward the lower pool
(DESIGN.md §6), so transformers runs here with that rule (``lower_index_ties``: ``Tensor.topk`` as a
stable sort), and ``test_ties_go_to_the_lower_pool`` checks the rule on its own. transformers honours
``indexer_types`` itself, but hands an S layer only the selection of the layer right before it, so
the patterns compared with it put every S indexed layer right after an F one.
"""

import contextlib
import copy
import json
import math
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from hf_weights import choice_hooks, recorded_choices, row_errors
from test_model import run_paged

from indexcache.models import BatchMeta, Glm5NextForCausalLM, from_pretrained, model_class
from indexcache.runtime.generation import generate
from indexcache.tools import random_weights

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm5NextForConditionalGeneration"):
    pytest.skip("this transformers has no Glm5NextForConditionalGeneration", allow_module_level=True)

LIN, IDX = "linear_attention", "indexed_attention"
LAYER_TYPES = [LIN, IDX, IDX, LIN, IDX, IDX, IDX]
INDEXED = [1, 2, 4, 5, 6]
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=7,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_head_dim=16,
            index_n_heads=4, index_kpool=4, linear_head_dim=8, linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=5,
            layer_types=LAYER_TYPES, mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "dense", "sparse"],
            pad_token_id=0, bos_token_id=None, eos_token_id=None, max_position_embeddings=512)
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
              projection_intermediate_size=16, patch_size=2, spatial_merge_size=1, temporal_patch_size=1)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def global_types(pattern):
    """A per-indexed-layer pattern as transformers' per-layer ``indexer_types`` (KDA entries: "full")."""
    out, chars = [], iter(pattern)
    for t in LAYER_TYPES:
        out.append({"F": "full", "S": "shared"}[next(chars)] if t == IDX else "full")
    return out


def hf_model(seed, pattern=None, state=None, **text):
    cfg = transformers.Glm5NextConfig(text_config={**TEXT, **text, **({"indexer_types": global_types(pattern)}
                                                                      if pattern else {})}, vision_config=VISION)
    model = transformers.Glm5NextForConditionalGeneration(cfg)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not missing and all(".indexer." in k for k in unexpected)
    else:
        random_weights.randomize_(model, seed)
    model = model.float().eval()
    model.config._attn_implementation = "eager"
    model.config.text_config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next")
    model = hf_model(seed=int(torch.randint(0, 1 << 30, ())))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TEXT["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(11))


@contextlib.contextmanager
def lower_index_ties():
    """transformers' top-k calls (the pooled indexer's, the router's) with ties toward the lower index."""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))
    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def hf_logits(model, ids):
    with torch.no_grad(), lower_index_ties():
        return model(input_ids=ids).logits.float()


def test_logits_equal_transformers_all_full(ckpt, ids, monkeypatch):
    path, hf = ckpt
    from indexcache import ops, reference  # width 16 too: the fused op, no [rows, pools] scores
    monkeypatch.setattr(reference, "indexer_logits", None)
    monkeypatch.setattr(ops, "topk_indices", None)
    model = from_pretrained(path, dtype=torch.float32)
    assert isinstance(model, Glm5NextForCausalLM) and model.indexed == INDEXED
    assert model.plan.pattern == "FFFFF"
    assert rel(model(ids), hf_logits(hf, ids)) < 1e-4
    kinds = [type(l.self_attn).__name__ for l in model.model.layers]
    assert kinds == ["KimiDeltaAttention", "Glm5NextAttention", "Glm5NextAttention", "KimiDeltaAttention",
                     "Glm5NextAttention", "Glm5NextAttention", "Glm5NextAttention"]


@pytest.mark.parametrize("pattern", ["FSFSF", "FSFFS"])
def test_patterns_equal_transformers_indexer_types(ckpt, ids, pattern, tmp_path):
    path, hf = ckpt
    shared = hf_model(0, pattern=pattern, state=hf.state_dict())
    want = hf_logits(shared, ids)
    assert rel(want, hf_logits(hf, ids)) > 1e-3  # the pattern changes what the S layers attend
    # the pattern as an override (one character per indexed layer) ...
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = from_pretrained(path, dtype=torch.float32,
                                hf_overrides={"use_index_cache": True, "index_topk_pattern": pattern})
    # the vision tower and the S layers' indexer tensors are passed over knowingly
    assert not [w for w in caught if "not used" in str(w.message)], [str(w.message) for w in caught]
    assert model.plan.pattern == pattern
    assert [model.model.layers[i].self_attn.indexer is None for i in INDEXED] == [c == "S" for c in pattern]
    assert rel(model(ids), want) < 1e-4
    # ... and shipped in the checkpoint as transformers writes it (indexer_types over every layer)
    shared.save_pretrained(tmp_path)
    shipped = from_pretrained(tmp_path, dtype=torch.float32)
    assert shipped.plan.pattern == pattern and "shipped" in shipped.plan_summary()
    assert rel(shipped(ids), want) < 1e-4


def test_shared_layers_reuse_the_nearest_earlier_full_layer(ckpt, ids):
    """S layers behind a KDA layer and behind another S layer (which transformers cannot run) attend
    the rows the last F indexed layer wrote: the same logits as a model whose S layers own indexers
    but are made to attend those rows."""
    path, _ = ckpt
    model = from_pretrained(path, dtype=torch.float32, hf_overrides={"use_index_cache": True,
                                                                       "index_topk_pattern": "FSSSF"})
    full = from_pretrained(path, dtype=torch.float32)
    meta = BatchMeta.dense(*ids.shape, full.device)
    ctx = full.forward_context(meta, full=full.full_of([c == "S" for c in "FSSSF"]))
    with torch.no_grad():  # as model(ids) runs: the CPU's fused norms and rotations, not autograd's ops
        want = full.compute_logits(full.hidden_states(ids.reshape(-1), ctx)).view(*ids.shape, -1)
    assert torch.equal(model(ids), want)
    assert rel(want, full(ids)) > 1e-3


def test_native_width_indexer_equals_transformers(tmp_path, ids):
    """index_head_dim 128 (the released width; the other tests' is 16): the same fused ``ops.indexer_topk``."""
    hf = hf_model(seed=int(torch.randint(0, 1 << 30, ())), index_head_dim=128)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=torch.float32)
    assert model.model.layers[1].self_attn.indexer.head_dim == 128
    assert rel(model(ids), hf_logits(hf, ids)) < 1e-4
    shared = hf_model(0, pattern="FSFFS", state=hf.state_dict(), index_head_dim=128)
    model = from_pretrained(tmp_path, dtype=torch.float32,
                            hf_overrides={"use_index_cache": True, "index_topk_pattern": "FSFFS"})
    assert rel(model(ids), hf_logits(shared, ids)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_production_latent_attends_through_the_kernel(tmp_path, dtype, monkeypatch):
    """kv_lora_rank 512 without RoPE: the selected-position attention runs ``ops.sparse_mla`` (its
    512-wide K = V form), not the reference, and paged decode still equals the full forward (fp32:
    transformers too)."""
    from indexcache import reference
    hf = hf_model(seed=int(torch.randint(0, 1 << 30, ())), kv_lora_rank=512)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=dtype)
    calls = []
    monkeypatch.setattr(reference, "sparse_mla", lambda *a, **k: calls.append(1) or (_ for _ in ()).throw(
        AssertionError("reference.sparse_mla called")))
    ids = torch.randint(0, TEXT["vocab_size"], (1, 29), generator=torch.Generator().manual_seed(7))
    got = model(ids)
    if dtype == torch.float32:
        assert rel(got, hf_logits(hf, ids)) < 1e-4
    paged = run_paged(model, [ids[0].tolist()], [12], chunk=10_000)[0]
    if dtype == torch.float32:
        assert rel(paged, got[0]) < 1e-5
    else:
        # Per position (as test_hy_v4's bf16 cache check): the paged decode rows (ops.rows_matmul,
        # fused norms) and the 29-row forward (torch's GEMM) round a few elements a bf16 ulp apart,
        # which can flip a near-tie of the indexer's top-k at a position (on an AMX Xeon: one
        # position at 0.15 over the whole sequence). A wrong cache or chunk join moves every one.
        per_pos = torch.tensor([rel(a, b) for a, b in zip(paged, got[0])])
        assert per_pos.median() < 0.02 and int((per_pos > 0.1).sum()) <= 2, per_pos
    assert not calls


def test_ties_go_to_the_lower_pool(ckpt):
    """Among pools of equal score the lower one is kept (the unfinished tail always is). Inputs
    ``x > 0`` under negative head weights make every ``w_h(x)`` negative, so a pool scores 0 exactly
    when its ReLU terms all vanish, and then it is on top; queries scaled down per row make that
    common (a query of 0 ties every pool)."""
    path, _ = ckpt
    model = from_pretrained(path, dtype=torch.float32)
    idx = model.model.layers[1].self_attn.indexer
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    with torch.no_grad():
        idx.weights_proj.weight.copy_(-torch.rand(idx.weights_proj.weight.shape, generator=g) - 0.1)
    t = 45
    x = torch.rand(t, TEXT["hidden_size"], generator=g) + 0.05
    qr = torch.randn(t, TEXT["q_lora_rank"], generator=g) * (torch.rand(t, 1, generator=g) < 0.5)
    meta = BatchMeta.dense(1, t, model.device)
    ctx = model.forward_context(meta)
    idx(x, qr, ctx)
    rows = ctx.topk_rows.clone()
    # the definition, written out: pooled keys, ReLU-weighted scores, a stable descending sort
    with torch.no_grad():
        k = idx.k_norm(idx.wk(x))
        gate = x @ idx.index_kpool_compress_gate.t()
        p = t // 4
        w = torch.softmax(gate[:p * 4].view(p, 4, -1) + idx.index_kpool_compress_ape, dim=1)
        pools = (w * k[:p * 4].view(p, 4, -1)).sum(1)
        q = idx.wq_b(qr).view(t, 4, 16)
        scores = (torch.relu(q @ pools.t() / 4.0) * (idx.weights_proj(x) / 2.0).unsqueeze(-1)).sum(1)
    assert (idx.weights_proj(x) < 0).all()
    ties = 0
    for r in range(t):
        seen = (r + 1) // 4
        order = torch.sort(scores[r, :seen], descending=True, stable=True).indices[:2].tolist()
        ties += int((scores[r, :seen] == 0).sum() > 2)
        want = {j * 4 + i for j in order for i in range(4)} | set(range((r + 1) // 4 * 4, r + 1))
        assert set(rows[r].tolist()) - {-1} == want, r
    assert ties > 5  # the rule was exercised


def test_decode_and_chunked_prefill_equal_the_full_forward(ckpt):
    path, _ = ckpt
    model = from_pretrained(path, dtype=torch.float32, hf_overrides={"use_index_cache": True,
                                                                       "index_topk_pattern": "FSSFS"})
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, TEXT["vocab_size"], (n,), generator=g).tolist() for n in (41, 23)]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    single = run_paged(model, seqs[:1], [17], chunk=10_000)  # prefill 17 then 24 single-token steps
    assert rel(single[0], full[0]) < 1e-5
    batched = run_paged(model, seqs, [30, 9], chunk=7)  # chunks cut through requests (and pools)
    for got, want in zip(batched, full):
        assert rel(got, want) < 1e-5
    cache = model.allocate_cache(4)
    for rid in range(3):
        cache.manager.allocate(rid, 8)
    cache.linear.slots([0, 1], [0, 0])
    cache.manager.free(0)
    assert cache.linear.slots([2], [0]) == [cache.linear._slot_of[2]] and cache.linear.num_slots == 2  # reused
    with pytest.raises(ValueError, match="continues at position 5"):
        cache.linear.slots([7], [5])
    assert [t is not None for t in cache.index_raw] == [i in (1, 5) for i in range(7)]  # F indexed layers only
    assert [t is not None for t in cache.kv] == [i in INDEXED for i in range(7)]
    assert cache.linear.recurrent[0].shape == (2, 2, 8, 8) and cache.linear.conv[3].shape == (2, 48, 3)
    # the linear state is per live request: its bytes do not grow with the blocks a request holds
    assert cache.linear.nbytes() == 2 * 2 * (2 * 8 * 8 + 48 * 3) * 4
    with pytest.raises(ValueError, match="index_kpool"):
        model.allocate_cache(4, block_size=6)


def test_generate_equals_transformers_greedy(ckpt):
    path, hf = ckpt
    model = from_pretrained(path, dtype=torch.float32)
    prompt = torch.randint(1, TEXT["vocab_size"], (13,), generator=torch.Generator().manual_seed(3)).tolist()
    res = generate(model, [prompt], 8, stop_tokens=[], prefill_chunk_size=5)
    with torch.no_grad(), lower_index_ties():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert res.tokens[0] == want


def test_save_pretrained_round_trip(ckpt, ids, tmp_path):
    """This package's own save_pretrained writes the names it reads (transformers' layout); an S
    layer's indexer is not written, and run-time IndexCache overrides are not baked into config.json."""
    path, hf = ckpt
    full = from_pretrained(path, dtype=torch.float32)
    full.save_pretrained(tmp_path / "full")
    assert torch.equal(from_pretrained(tmp_path / "full", dtype=torch.float32)(ids), full(ids))
    over = {"use_index_cache": True, "index_topk_pattern": "FSFSF"}
    model = from_pretrained(path, dtype=torch.float32, hf_overrides=over)
    model.save_pretrained(tmp_path / "fsfsf")
    assert torch.equal(from_pretrained(tmp_path / "fsfsf", dtype=torch.float32, hf_overrides=over)(ids), model(ids))
    with pytest.raises(ValueError, match="layers.2.self_attn.indexer.wq_b.weight is missing"):
        from_pretrained(tmp_path / "fsfsf", dtype=torch.float32)


def test_text_only_flat_checkpoint(ckpt, ids, tmp_path):
    """A text checkpoint keeping the text fields flat and the language model at ``model.*``."""
    from safetensors.torch import load_file, save_file
    path, hf = ckpt
    cfg = json.loads((path / "config.json").read_text())
    flat = {**cfg["text_config"], "model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()
               if not k.startswith("model.visual.")}, str(tmp_path / "model.safetensors"))
    model = from_pretrained(tmp_path, dtype=torch.float32)
    want = hf_logits(hf, ids)
    assert rel(model(ids), want) < 1e-4
    # transformers' text config type, flat
    (tmp_path / "config.json").write_text(json.dumps({**flat, "model_type": "glm5_next_text", "architectures": []}))
    model = from_pretrained(tmp_path, dtype=torch.float32)
    assert model.model_type == "glm5_next_text" and rel(model(ids), want) < 1e-4


def fp32_choices(hf, ids):
    """transformers' fp32 logits and the discrete choices behind them: per MoE layer the routed
    experts ``[rows, top_k]``, per indexed layer the selection ``[B, S, index_topk + P - 1]``."""
    hooks, choices = recorded_choices(hf.model.language_model.layers, lambda layer: hasattr(layer.mlp, "gate"),
                                      lambda layer: getattr(layer.self_attn, "indexer", None) is not None)
    with hooks:
        return hf_logits(hf, ids), choices


def rerouted(gate, x, experts, weights, forced, scale):
    """A router's ``(experts, weights)`` with the rows whose expert set differs from ``forced`` given
    the forced experts instead, weighted by this router's own sigmoid scores there (renormalised,
    times ``scale``); the other rows keep its own weights."""
    same = (experts.sort(dim=-1).values == forced.sort(dim=-1).values).all(dim=-1, keepdim=True)
    scores = torch.sigmoid(F.linear(x.reshape(-1, x.shape[-1]).float(), gate.weight.float()))
    picked = scores.gather(1, forced.long())
    picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * scale
    return torch.where(same, experts, forced.to(experts.dtype)), torch.where(same, weights, picked.to(weights.dtype))


@contextlib.contextmanager
def forced(layers, choices, scale, transformers_side):
    """``layers`` (transformers' or ours) take ``choices`` instead of their own: each router the
    given experts where its own differ (``rerouted``), each indexer the given selection. Yields the
    set of choices applied, filled as the forward runs."""
    used = set()

    def route(i):
        def hook(gate, args, out):
            used.add(("experts", i))
            forced = choices[("experts", i)]
            if transformers_side:
                experts, weights = rerouted(gate, args[0], out[2], out[1], forced, scale)
                return out[0], weights, experts
            return rerouted(gate, args[0], out[0], out[1], forced, scale)
        return hook

    def select(i):
        def hook(indexer, args, out):
            used.add(("selection", i))
            rows = choices[("selection", i)]
            if transformers_side:
                return rows
            ctx = args[2]  # ours writes the shared top-k buffer: overwrite it
            ctx.topk_rows.fill_(-1)
            ctx.topk_rows[:, :rows.shape[-1]] = rows.reshape(-1, rows.shape[-1])
        return hook
    with choice_hooks(layers, choices, route, select):
        yield used


def test_bf16_error_within_twice_transformers_bf16(ckpt, ids):
    """Our bf16 model against transformers' fp32 logits errs at most twice as much as transformers'
    own bf16 model (the median over rows of each row's relative error), both bf16 models taking the
    fp32 run's discrete choices (routed experts, pooled selections). Left to choose, either bf16
    model flips a near-tie now and then (fp32 router margins ~1e-3) and its error jumps 3-10x on that
    checkpoint, transformers' as often as ours; and a row where a layer amplifies rounding 100x
    (either model's, as fp32 math does) sways the error over all rows. docs/model.md, "GLM-5.3-Flash
    in bf16", has the numbers."""
    path, hf = ckpt
    model = from_pretrained(path, dtype=torch.bfloat16)
    assert model.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_conv1d.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert torch.isfinite(model(ids)).all()
    want, choices = fp32_choices(hf, ids)
    moe = [i for i, t in enumerate(TEXT["mlp_layer_types"]) if t == "sparse"]
    assert set(choices) == {("experts", i) for i in moe} | {("selection", i) for i in INDEXED}
    scale = hf.config.text_config.routed_scaling_factor
    theirs_model = copy.deepcopy(hf).to(torch.bfloat16)
    with forced(theirs_model.model.language_model.layers, choices, scale, transformers_side=True) as used:
        theirs = row_errors(hf_logits(theirs_model, ids), want)
    assert used == set(choices)
    with forced(model.model.layers, choices, scale, transformers_side=False) as used:
        out = model(ids)
    assert used == set(choices)
    ours = row_errors(out, want)
    assert torch.isfinite(out).all() and ours.median() < 2 * theirs.median(), (ours.median(), theirs.median())


def test_pattern_tools_run(ckpt, tmp_path, capsys):
    from indexcache.cli import main
    src, _ = ckpt
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "indexcache_tokenizer": "bytes"}))  # byte-level text
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 10)
    assert main(["overlap", "--model", str(path), "--text", str(text), "--context", "40", "--windows", "2",
                 "--hf-overrides", '{"use_index_cache": true, "index_topk_pattern": "FSFSF"}']) == 0
    out = capsys.readouterr().out
    assert "1, 2, 4, 5, 6" in out and "pattern FSFSF" in out
    assert main(["search", "--model", str(path), "--text", str(text), "--context", "40", "--windows", "2",
                 "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)
    assert steps
    assert main(["eval", "--model", str(path), "--text", str(text), "--context", "40", "--windows", "1",
                 "--overrides", '{"use_index_cache": true, "index_topk_pattern": "FSFSF"}', "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got


def test_plan_command_reports_the_indexed_layers(ckpt, capsys):
    from indexcache.cli import main
    path, _ = ckpt
    assert main(["plan", "--config", str(path), "--hf-overrides",
                 '{"use_index_cache": true, "index_topk_pattern": "FSSFS"}']) == 0
    out = capsys.readouterr().out
    assert "2 F / 3 S over 5 layers" in out and "pattern: FSSFS" in out and "indexed layers 1, 2, 4, 5, 6" in out
    assert "    5  F         itself" in out and "    6  S         layer 5" in out and "    4  S         layer 1" in out
    assert "index caches per sequence (" in out and "(removes" in out  # pools scored, not keys
    assert main(["plan", "--config", str(path), "--json", "--hf-overrides",
                 '{"use_index_cache": true, "index_topk_freq": 2}']) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["indexed_layers"] == INDEXED and got["costs"]["index_kpool"] == 4
    assert abs(got["costs"]["prefill_flops"]["removed_fraction"] - got["num_shared"] / 5) < 1e-12


def test_bad_configs_name_the_field(ckpt):
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    text = cfg["text_config"]
    assert model_class(cfg) is Glm5NextForCausalLM

    def build(overrides=None, **changes):
        return Glm5NextForCausalLM.from_config({**cfg, "text_config": {**text, **changes}}, overrides)

    with pytest.raises(ValueError, match="layer_types"):
        build(layer_types=LAYER_TYPES[:-1])
    with pytest.raises(ValueError, match="layer_types"):
        build(layer_types=LAYER_TYPES[:-1] + ["sliding_attention"])
    with pytest.raises(ValueError, match="mlp_layer_types"):
        build(mlp_layer_types=["dense"] * 6)
    with pytest.raises(ValueError, match="indexer_types"):
        build(indexer_types=["full"] * 6)
    with pytest.raises(ValueError, match="index_kpool"):
        build(index_kpool=3)
    with pytest.raises(ValueError, match="index_kpool"):
        build(index_kpool=0)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        build(qk_rope_head_dim=4)
    with pytest.raises(ValueError, match="index_topk_pattern"):  # one character per indexed layer (5), not per layer
        build({"use_index_cache": True, "index_topk_pattern": "FSSFSFS"})
    with pytest.raises(ValueError, match="index_topk_pattern"):
        build({"use_index_cache": True, "index_topk_pattern": "FSSF"})
    with pytest.raises(ValueError, match="indexer_types"):
        build({"use_index_cache": True, "indexer_types": ["full", "shared", "full"]})
    with pytest.raises(ValueError, match="S"):  # the first indexed layer has nothing to reuse
        build(indexer_types=global_types("SFFFF"))
    with pytest.raises(ValueError, match="index_reuse_steps"):  # step reuse runs here (test_hybrid_step_reuse.py)
        build({"use_index_cache": True, "index_reuse_steps": 0})
    # the KDA layers' entries of a per-layer indexer_types mean nothing
    m = build(indexer_types=["shared"] + global_types("FSFFF")[1:])
    assert m.plan.pattern == "FSFFF"
    assert not math.isnan(float(m(torch.tensor([[1, 2, 3]])).sum()))


def test_without_the_tail_paged_equals_dense(ckpt):
    """``index_kpool_always_select_tail: false`` (not compared with transformers, whose rows with no
    complete pool attend every key): the rows are the selected pools only, and the paged path agrees."""
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"] = {**cfg["text_config"], "index_kpool_always_select_tail": False}
    model = Glm5NextForCausalLM.from_config(cfg, {"use_index_cache": True, "index_topk_pattern": "FSSFS"},
                                            seed=int(torch.randint(0, 1 << 30, ())))
    assert model.args.index_topk == 8 and model.model.layers[1].self_attn.indexer.row_width == 8
    seq = torch.randint(0, TEXT["vocab_size"], (30,), generator=torch.Generator().manual_seed(9)).tolist()
    full = model(torch.tensor([seq]))[0]
    assert torch.isfinite(full).all()
    got = run_paged(model, [seq], [13], chunk=6)[0]
    assert rel(got, full) < 1e-5


# ============================================================================ issue 34 audit additions

def hf_derived(seed, **ic):
    """transformers' model on a config whose ``indexer_types`` transformers derives itself from
    ``ic`` (``index_topk_pattern`` per layer, or ``index_topk_freq`` / ``index_skip_topk_offset``)."""
    cfg = transformers.Glm5NextConfig(text_config={**TEXT, **ic}, vision_config=VISION)
    model = transformers.Glm5NextForConditionalGeneration(cfg)
    random_weights.randomize_(model, seed)
    model = model.float().eval()
    model.config._attn_implementation = model.config.text_config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("ic,pattern", [
    ({"index_topk_pattern": "FFSFFSF"}, "FSFSF"),  # per layer, as transformers reads it
    ({"index_topk_freq": 2, "index_skip_topk_offset": 3}, "FFFSF"),  # over layer ids, not indexed layers
])
def test_checkpoint_shipping_transformers_derivation_keys(tmp_path, ids, ic, pattern):
    """A config transformers built from ``index_topk_pattern`` / ``index_topk_freq`` /
    ``index_skip_topk_offset`` writes those keys beside the ``indexer_types`` it derived (the only
    key its model reads): the checkpoint loads with transformers' plan and its logits."""
    hf = hf_derived(int(torch.randint(0, 1 << 30, ())), **ic)
    hf.save_pretrained(tmp_path)
    shipped = json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert all(shipped[k] == v for k, v in ic.items())  # both written
    want = "".join("F" if hf.config.text_config.indexer_types[i] == "full" else "S" for i in INDEXED)
    assert want == pattern
    model = from_pretrained(tmp_path, dtype=torch.float32)
    assert model.plan.pattern == pattern and "shipped" in model.plan_summary()
    assert rel(model(ids), hf_logits(hf, ids)) < 1e-4
    # a hand-written config with the derivation keys and no indexer_types: derived as transformers does
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["text_config"]["indexer_types"]
    assert Glm5NextForCausalLM.from_config(cfg).plan.pattern == pattern


def test_shipped_freq_over_layer_ids_and_its_errors(ckpt):
    """transformers' default offset 2 over the layer ids (FSSFS here: S layers behind a KDA layer,
    which transformers cannot run but this package can); bad shipped values name their field; an S
    first indexed layer names the model layer it is."""
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in cfg["text_config"].items() if k != "indexer_types"}

    def build(**changes):
        return Glm5NextForCausalLM.from_config({**cfg, "text_config": {**text, **changes}})

    want = transformers.Glm5NextTextConfig(**{**TEXT, "index_topk_freq": 2}).indexer_types
    assert build(index_topk_freq=2).plan.pattern == "".join("F" if want[i] == "full" else "S" for i in INDEXED)
    assert build(index_topk_freq=2).plan.pattern == "FSSFS"
    assert build().plan.pattern == "FFFFF"  # nothing shipped: IndexCache off
    with pytest.raises(ValueError, match="index_topk_freq in config.json must be an integer"):
        build(index_topk_freq="2")
    with pytest.raises(ValueError, match="index_topk_pattern must have one entry per layer"):
        build(index_topk_pattern="FSF")
    with pytest.raises(ValueError, match="index_topk_pattern in config.json must be a string"):
        build(index_topk_pattern=5)
    with pytest.raises(ValueError, match="its layer 0 is model layer 1"):  # offset 1: layer 1 shared
        build(index_topk_freq=2, index_skip_topk_offset=1)


def test_cli_generate_equals_transformers_generate_with_a_pattern(ckpt, tmp_path, capsys):
    """The user's path: ``indexcache generate --json`` (fp32, chunked prefill, IndexCache FSFSF as
    an override) gives transformers' greedy ``generate()`` tokens, transformers running the same
    pattern natively through ``indexer_types``."""
    from indexcache.cli import main
    src, hf = ckpt
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "indexcache_tokenizer": "bytes"}))
    prompt = "IndexCache on GLM-5.3-Flash, "
    assert main(["generate", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "8", "--dtype", "fp32",
                 "--prefill-chunk-size", "11", "--no-warmup", "--json",
                 "--hf-overrides", '{"use_index_cache": true, "index_topk_pattern": "FSFSF"}']) == 0
    got = json.loads(capsys.readouterr().out)
    ids = list(prompt.encode())  # bytes; no BOS (bos_token_id None)
    assert got["prompt_tokens"] == len(ids)
    shared = hf_model(0, pattern="FSFSF", state=hf.state_dict())
    with torch.no_grad(), lower_index_ties():
        want = shared.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist()
        plain = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    assert got["tokens"] == want
    assert want != plain or rel(hf_logits(shared, torch.tensor([ids])), hf_logits(hf, torch.tensor([ids]))) > 1e-3


def test_pattern_tools_against_transformers(ckpt, tmp_path, capsys):
    """``overlap``: each entry is the share of indexed layer i's positions (the selected pools' and
    the tail's) that layer j also reads, over the rows whose query sees more complete pools than it
    keeps, counted here from transformers' own selections. ``search`` (greedy, JSON): every step's and
    candidate's loss is the cross-entropy of a model loaded with that pattern, and of transformers'
    logits where transformers can run the pattern (each S right after an F indexed layer). ``eval``:
    its loss is transformers' cross-entropy under the same indexer_types."""
    from indexcache.cli import main
    from indexcache.tools.patterns import load_all_full, overlap_matrix, text_windows
    src, hf = ckpt
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "indexcache_tokenizer": "bytes"}))
    sample = tmp_path / "t.txt"
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    sample.write_bytes(bytes(torch.randint(32, 127, (400,), generator=g).tolist()))
    windows = text_windows(sample.read_bytes(), 40, 2)
    inputs, targets = windows[:, :-1], windows[:, 1:].reshape(-1)
    m = overlap_matrix(load_all_full(path), windows)
    hooks, choices = recorded_choices(hf.model.language_model.layers, lambda layer: False,
                                      lambda layer: getattr(layer.self_attn, "indexer", None) is not None)
    with hooks:
        hf_logits(hf, inputs)
    pos = torch.arange(40).repeat(2)
    real = (pos + 1) // 4 > 8 // 4
    sets = [[{int(p) for p in row if p >= 0} for row in choices[("selection", layer)].reshape(80, -1)[real]]
            for layer in INDEXED]
    for i in range(5):
        for j in range(5):
            want = sum(len(a & b) / len(a) for a, b in zip(sets[i], sets[j])) / len(sets[i])
            assert float(m[i, j]) == pytest.approx(want, abs=1e-6), (i, j)
    assert m.min() < 0.99  # the layers' choices differ somewhere

    def runnable(p):  # transformers hands an S layer only the previous layer's selection
        return all(c == "F" or (INDEXED[k] - 1 == INDEXED[k - 1] and p[k - 1] == "F") for k, c in enumerate(p))

    def hf_loss(p):
        model = hf if p == "FFFFF" else hf_model(0, pattern=p, state=hf.state_dict())
        return float(F.cross_entropy(hf_logits(model, inputs).reshape(80, -1), targets))

    common = ["--model", str(path), "--text", str(sample), "--context", "40", "--windows", "2"]
    assert main(["search", *common, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert [s["num_full"] for s in steps] == [5, 4, 3, 2, 1]
    trials = {s["pattern"]: s["loss"] for s in steps}
    for prev, s in zip(steps, steps[1:]):  # the candidates: the previous step's pattern with one more S
        trials |= {prev["pattern"][:int(k)] + "S" + prev["pattern"][int(k) + 1:]: v for k, v in s["candidates"].items()}
    checked = 0
    for p, loss in trials.items():
        model = from_pretrained(path, dtype=torch.float32, hf_overrides={"use_index_cache": True,
                                                                         "index_topk_pattern": p})
        assert loss == pytest.approx(float(F.cross_entropy(model(inputs).reshape(80, -1), targets)), rel=1e-5), p
        if runnable(p):
            assert loss == pytest.approx(hf_loss(p), rel=1e-4), p
            checked += 1
    assert checked >= 3
    assert main(["eval", *common, "--json", "--overrides", '{"use_index_cache": true, "index_topk_pattern": "FSFSF"}'
                 ]) == 0
    got = json.loads(capsys.readouterr().out)
    row = next(r for r in got["rows"] if r["pattern"] == "FSFSF")
    assert row["loss_nats"] == pytest.approx(hf_loss("FSFSF"), rel=1e-4)


def test_overlap_without_the_tail_counts_rows_with_a_choice(ckpt):
    """``index_kpool_always_select_tail: false``: a row is a choice once its query sees more
    complete pools than it keeps (here 12 tokens or more), not once it has more than index_topk
    tokens (9-11 tokens see only 2 pools and read both, which would count as full overlap)."""
    from indexcache.tools.patterns import PatternRunner, overlap_matrix, text_windows
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"] = {**cfg["text_config"], "index_kpool_always_select_tail": False}
    model = Glm5NextForCausalLM.from_config(cfg, seed=int(torch.randint(0, 1 << 30, ())))
    windows = text_windows(bytes(range(32, 127)) * 2, 20, 2)
    m = overlap_matrix(model, windows)
    rows = PatternRunner(model, windows).run("FFFFF").rows
    real = (torch.arange(20).repeat(2) + 1) // 4 > 2
    sets = [[{int(p) for p in r if p >= 0} for r in rows[k][real]] for k in range(5)]
    for i, j in ((0, 1), (4, 2), (1, 3)):
        want = sum(len(a & b) / len(a) for a, b in zip(sets[i], sets[j])) / len(sets[i])
        assert float(m[i, j]) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("block_size", [4, 8])
def test_decode_across_pages_equals_the_full_forward(ckpt, block_size):
    """Pages of 1 and 2 pools (the other decode tests' 64-token pages hold a whole request): the
    latent, ``key | gate`` and pooled rows of a request spread over several blocks, pools completing
    on a page's last token, chunks and decode steps crossing pages."""
    path, _ = ckpt
    model = from_pretrained(path, dtype=torch.float32, hf_overrides={"use_index_cache": True,
                                                                       "index_topk_pattern": "FSSFS"})
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    seqs = [torch.randint(0, TEXT["vocab_size"], (n,), generator=g).tolist() for n in (41, 23)]
    full = [model(torch.tensor([s]))[0] for s in seqs]
    for got, want in zip(run_paged(model, seqs, [19, 6], chunk=7, block_size=block_size), full):
        assert rel(got, want) < 1e-5


def test_transformers_writes_the_released_names(ckpt):
    """What ``save_pretrained`` wrote (and ``from_pretrained`` above read) is the released layout,
    transformers' conversion mapping run backwards: per-expert matrices, three convs, the forget
    gate and hyper-connection tensors under their original names, the vision tower beside."""
    from safetensors import safe_open
    path, _ = ckpt
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    lm = "model.language_model.layers"
    for name in (f"{lm}.0.self_attn.f_a_proj.weight", f"{lm}.0.self_attn.A_log", f"{lm}.0.self_attn.q_conv1d.weight",
                 f"{lm}.0.hc_attn_fn", f"{lm}.1.mlp.experts.3.gate_proj.weight", f"{lm}.1.mlp.experts.0.down_proj.weight",
                 f"{lm}.1.self_attn.indexer.index_kpool_compress_ape"):
        assert name in names, (name, sorted(n for n in names if n.startswith(name.rsplit(".", 2)[0]))[:8])
    assert not any("gate_up_proj" in n or "forget_gate" in n or ".conv1d." in n for n in names)
    assert any(n.startswith("model.visual.") for n in names)
