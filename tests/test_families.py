"""Every DSA checkpoint family against its own independent reference (issue: model families).

- GLM-5.x and DeepSeek-V3.2 checkpoints written by transformers (small latent widths, and GLM at
  the production 512 / 64 / 128 widths through the native kernels) against transformers' own
  ``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` logits, IndexCache on and off.
- The default indexer against a pure-torch transcription of DeepSeek's reference inference code
  (``rotate_activation``, ``act_quant`` with ue8m0 scales and the 1e-4 floor, ``fp8_index``) on a
  checkpoint in the official FP8 layout, row for row.
- Tokenizer-aware pattern tools on a checkpoint with its own ``tokenizer.json``.
- Bad input of each new path.
"""

import json
import math
import warnings

import pytest
import torch
from indexcache.tools.random_weights import randomize_

from indexcache.cli import main
from indexcache.models import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM, from_pretrained
from indexcache.models.tiny import tiny_config

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=80, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=5,
             num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
             kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=20, index_topk=8,
             index_head_dim=16, index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=256,
             routed_scaling_factor=2.5, n_group=2, topk_group=1)
NATIVE = dict(SMALL, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, num_hidden_layers=4)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def hf_checkpoint(path, family, widths, seed=0, **extra):
    """A transformers model with every parameter and buffer drawn at random, saved in HF layout."""
    if family == "glm_moe_dsa":
        cfg = transformers.GlmMoeDsaConfig(**widths, **extra)
        model = transformers.GlmMoeDsaForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV32Config(**widths, **extra)
        model = transformers.DeepseekV32ForCausalLM(cfg)
    randomize_(model, seed)
    model.float().eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, ids):
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5))


def ours(path, overrides=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_pretrained(path, hf_overrides=overrides, dtype=torch.float32, indexer_fp8=False, **kw)


# ============================================================================ against transformers

def test_glm_ships_indexer_types(tmp_path, ids):
    types = ["full", "shared", "full", "shared", "shared"]
    ref = hf_checkpoint(tmp_path, "glm_moe_dsa", SMALL, indexer_types=types)
    model = ours(tmp_path)  # no overrides: the checkpoint's own indexer_types
    assert isinstance(model, GlmMoeDsaForCausalLM) and model.plan.pattern == "FSFSS"
    assert model.ic_config.shipped_by_checkpoint and "shipped" in model.plan_summary()
    assert model.indexer_param_count()[1] == 0 and model.args.indexer_rope_interleave
    assert rel(model(ids), hf_logits(ref, ids)) < 1e-4


@pytest.mark.parametrize("overrides,pattern", [
    ({"use_index_cache": True, "index_topk_freq": 2}, "FFSFS"),
    ({"use_index_cache": True, "index_topk_pattern": "FSSFS"}, "FSSFS"),
    (None, "FFFFF"),
])
def test_glm_all_full_checkpoint_with_overrides(tmp_path, ids, overrides, pattern):
    # transformers writes indexer_types all "full"; the user's freq / pattern must replace it (DESIGN §2)
    hf_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", SMALL, seed=1)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["indexer_types"] == ["full"] * 5
    model = ours(tmp_path / "ckpt", overrides)
    assert model.plan.pattern == pattern
    if overrides:
        assert "config.json's indexer_types replaced by --hf-overrides" in model.plan_summary()
    # transformers' own model of the same weights with that plan (it drops the S layers' indexers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.GlmMoeDsaForCausalLM.from_pretrained(
            tmp_path / "ckpt", indexer_types=["full" if c == "F" else "shared" for c in pattern]).float().eval()
    assert [layer.self_attn.indexer is None for layer in ref.model.layers] == [c == "S" for c in pattern]
    assert rel(model(ids), hf_logits(ref, ids)) < 1e-4


def test_glm_native_widths_through_the_kernels(tmp_path, ids):
    types = ["full", "shared", "full", "shared"]
    ref = hf_checkpoint(tmp_path, "glm_moe_dsa", NATIVE, seed=2, indexer_types=types)
    model = ours(tmp_path)
    assert model.args.native_mla and model.args.native_indexer
    assert rel(model(ids), hf_logits(ref, ids)) < 1e-4


def test_deepseek_v32_small_widths(tmp_path, ids):
    ref = hf_checkpoint(tmp_path, "deepseek_v32", SMALL, seed=3)
    model = ours(tmp_path)
    assert type(model) is DeepseekV32ForCausalLM and not model.args.indexer_rope_interleave
    assert not model.args.native_mla
    assert rel(model(ids), hf_logits(ref, ids)) < 1e-4


def test_small_widths_paged_decode_equals_prefill(tmp_path):
    # the reference-path attention and indexer also serve the paged cache: a prefill then decode
    # of the same tokens reproduces the whole-prompt logits
    hf_checkpoint(tmp_path, "glm_moe_dsa", SMALL, seed=4, indexer_types=["full", "shared", "shared", "full", "shared"])
    model = ours(tmp_path)
    seq = torch.randint(0, SMALL["vocab_size"], (30,), generator=torch.Generator().manual_seed(9))
    want = model(seq.view(1, -1))[0]
    from indexcache.models import BatchMeta
    cache = model.allocate_cache(4)
    cache.manager.allocate("r", 30)
    h = model.forward_tokens(seq[:20], BatchMeta.paged_batch(cache, ["r"], [0], [20]), cache)
    got = [model.compute_logits(h)]
    for t in range(20, 30):
        h = model.forward_tokens(seq[t:t + 1], BatchMeta.paged_batch(cache, ["r"], [t], [1]), cache)
        got.append(model.compute_logits(h))
    assert rel(torch.cat(got), want) < 1e-5
    with pytest.raises(ValueError, match="fp8_ds_mla.*32 \\+ 8"):
        model.allocate_cache(4, "fp8_ds_mla")


# ============================================================================ DeepSeek's reference indexer

def _hadamard_matrix(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def test_rotation_is_the_sylvester_hadamard():
    x = torch.randn(5, 128)
    torch.testing.assert_close(ds_rotate_activation(x), x @ _hadamard_matrix(128).T / 128 ** 0.5, rtol=1e-5, atol=1e-5)


def ds_rotate_activation(x):
    """fast_hadamard_transform.hadamard_transform(x, scale=d ** -0.5): the fast Walsh-Hadamard
    transform in natural (Sylvester) order, butterflies of span 1, 2, 4, ... in fp32, then the scale."""
    y = x.float().clone()
    d = y.shape[-1]
    span = 1
    while span < d:
        y = y.unflatten(-1, (d // (2 * span), 2, span))
        a, b = y.select(-2, 0), y.select(-2, 1)
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        span *= 2
    return y * d ** -0.5


def ds_act_quant(x, block=128):
    """act_quant(x, block_size, scale_fmt='ue8m0'): amax floored at 1e-4, power-of-two scale."""
    g = x.float().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    y = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return y.flatten(-2), s.squeeze(-1)


def ds_fp8_index(q, weights, k, k_scale):
    """fp8_index: sum_h relu(q[t,h] . k[s]) * weights[t,h], times k_scale[s]."""
    logits = torch.einsum("thd,sd->hts", q.float(), k.float()).relu()
    return (logits * weights.t().unsqueeze(-1)).sum(0) * k_scale.view(1, -1)


def _dequant(path, name):
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        w = f.get_tensor(name)
        if w.dtype != torch.float8_e4m3fn:
            return w.float()
        s = f.get_tensor(name + "_scale_inv").float()
    rows, cols = w.shape
    return w.float() * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def test_default_indexer_equals_deepseek_reference_row_for_row(tmp_path):
    from test_model import _rope, _yarn_freqs_cis

    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=3, num_nextn_predict_layers=0, num_attention_heads=2, q_lora_rank=32,
                      qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                      topk_group=1, index_n_heads=8, index_topk=16, max_position_embeddings=512,
                      bos_token_id=None, eos_token_id=None)
    DeepseekV32ForCausalLM.from_config(cfg, dtype=torch.float32, seed=11).save_pretrained(tmp_path, fp8=True)
    st = json.loads((tmp_path / "config.json").read_text())
    assert st["quantization_config"]["weight_block_size"] == [128, 128]
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(64)
    fc = _yarn_freqs_cis(cfg, positions)

    def reference_rows(layer):
        x, qr = captured[layer]["x"], captured[layer]["qr"]
        p = f"model.layers.{layer}.self_attn.indexer."
        h, d, r = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
        q = (qr @ _dequant(tmp_path, p + "wq_b.weight").T).view(-1, h, d)
        q = torch.cat((_rope(q[..., :r], fc, interleaved=False), q[..., r:]), -1)
        k = torch.nn.functional.layer_norm(x @ _dequant(tmp_path, p + "wk.weight").T, (d,),
                                           _dequant(tmp_path, p + "k_norm.weight"), _dequant(tmp_path, p + "k_norm.bias"), 1e-6)
        k = torch.cat((_rope(k[..., :r], fc, interleaved=False), k[..., r:]), -1)
        q_fp8, q_scale = ds_act_quant(ds_rotate_activation(q))
        k_fp8, k_scale = ds_act_quant(ds_rotate_activation(k))
        w = (x @ _dequant(tmp_path, p + "weights_proj.weight").T) * h ** -0.5
        w = w * q_scale.squeeze(-1) * d ** -0.5
        score = ds_fp8_index(q_fp8, w, k_fp8, k_scale.squeeze(-1))
        score = score + torch.full((64, 64), -math.inf).triu(1)
        top = score.topk(min(cfg["index_topk"], 64), dim=-1).indices
        return [set(int(i) for i in row if i <= t) for t, row in enumerate(top)], score

    def agree(rows, layer):
        """Rows equal to the reference's, where a different position may only stand for an equal score
        (a tie at the k-th value, which the ops break toward the lower position and torch.topk arbitrarily)."""
        ref, score = reference_rows(layer)
        return [a == b or sorted(score[t, sorted(a)].tolist()) == sorted(score[t, sorted(b)].tolist())
                for t, (a, b) in enumerate(zip(rows[layer], ref))]

    def rows_of(hadamard):
        model = DeepseekV32ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                       hf_overrides=None if hadamard else {"indexer_hadamard": False})
        hooks = []
        for layer in model.model.layers:
            def hook(mod, inputs, out, i=layer.layer_id):
                captured[i] = {"x": inputs[0].clone(), "qr": inputs[1].clone(),
                               "rows": [set(int(v) for v in row if v >= 0) for row in out]}
            hooks.append(layer.self_attn.indexer.register_forward_hook(hook))
        model(ids)
        return {i: c["rows"] for i, c in captured.items()}

    captured = {}
    ours_default = rows_of(True)
    for layer in range(3):
        assert all(agree(ours_default, layer)), f"layer {layer}"
    ours_vllm = rows_of(False)  # no rotation: the engines' (vLLM's) choice differs from DeepSeek's on some rows
    assert sum(not ok for layer in range(3) for ok in agree(ours_vllm, layer)) > 0


# ============================================================================ tokenizer-aware pattern tools

TEXT = ("def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n\n"
        "for line in open('settings.ini'):\n    print(parse(line))\n") * 12


def _bpe_tokenizer(path, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def tok_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok-ckpt")
    cfg = tiny_config(vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=4,
                      num_attention_heads=2, q_lora_rank=24, qk_nope_head_dim=12, v_head_dim=12, n_routed_experts=4,
                      num_experts_per_tok=2, n_group=2, topk_group=1, index_n_heads=2, index_topk=8,
                      num_nextn_predict_layers=0, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    cfg.pop("indexcache_tokenizer")
    DeepseekV32ForCausalLM.from_config(cfg, dtype=torch.float32, seed=4).save_pretrained(path)
    tok = _bpe_tokenizer(path, 100)
    (path / "text.txt").write_text(TEXT)
    return path, tok


def test_eval_tokenizes_with_the_checkpoints_tokenizer(tok_ckpt, capsys):
    path, tok = tok_ckpt
    assert main(["eval", "--model", str(path), "--text", str(path / "text.txt"), "--context", "32", "--windows", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    enc = tok.encode(TEXT)
    assert enc.ids[:5] != list(TEXT.encode()[:5])  # really tokens, not bytes
    # independently: the all-F model's mean next-token loss over the same token windows
    windows = torch.tensor(enc.ids[:3 * 32 + 1]).unfold(0, 33, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = from_pretrained(path, dtype=torch.float32)  # as eval runs it: fp8 indexer
    logits = model(windows[:, :-1])
    nats = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 128), windows[:, 1:].reshape(-1)))
    covered = sum(len(TEXT[enc.offsets[i * 32 + 1][0]:enc.offsets[i * 32 + 32][1]].encode()) for i in range(3))
    row = out["rows"][0]
    assert row["perplexity"] == pytest.approx(math.exp(nats), rel=1e-4)
    assert out["bytes_per_token"] == pytest.approx(covered / 96) and out["bytes_per_token"] > 1.5
    assert row["bits_per_byte"] == pytest.approx(nats / math.log(2) / (covered / 96), rel=1e-4)


def test_overlap_and_search_take_tokens(tok_ckpt, capsys):
    path, _ = tok_ckpt
    assert main(["overlap", "--model", str(path), "--text", str(path / "text.txt"), "--context", "32",
                 "--windows", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 32
    assert main(["search", "--model", str(path), "--text", str(path / "text.txt"), "--context", "32",
                 "--windows", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] > 1.5 and out["steps"][0]["pattern"] == "FFFF"


def test_cli_runs_a_glm_checkpoint(tmp_path, capsys):
    # a GLM-5.2-style checkpoint (IndexCache in its config.json) with its own tokenizer, through the CLI
    hf_checkpoint(tmp_path, "glm_moe_dsa", dict(SMALL, vocab_size=128), seed=6,
                  indexer_types=["full", "full", "shared", "full", "shared"])
    _bpe_tokenizer(tmp_path, 100)
    (tmp_path / "text.txt").write_text(TEXT)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "def parse(line):", "--max-new-tokens", "4",
                 "--dtype", "fp32", "--no-warmup", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pattern"] == "FFSFS" and len(out["tokens"]) == 4
    assert main(["eval", "--model", str(tmp_path), "--text", str(tmp_path / "text.txt"), "--context", "32",
                 "--windows", "2", "--overrides", "{}", "--overrides", '{"use_index_cache": true, "index_topk_freq": 4}',
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["pattern"] for r in rows] == ["FFSFS", "FFSSS"]  # the checkpoint's own plan, then freq 4
    assert main(["plan", "--config", str(tmp_path / "config.json")]) == 0
    assert "settings shipped in the checkpoint's config.json" in capsys.readouterr().out
    # search needs every indexer; the S layers of this checkpoint were saved without one
    assert main(["search", "--model", str(tmp_path), "--text", str(tmp_path / "text.txt"), "--context", "32"]) == 2
    assert "need every layer's indexer" in capsys.readouterr().err


# ============================================================================ bad input

def test_family_bad_inputs(tmp_path, tok_ckpt, capsys):
    with pytest.raises(ValueError, match="unsupported model_type 'mixtral'.*'deepseek_v32'.*'glm_moe_dsa'"):
        DeepseekV32ForCausalLM.from_config(dict(tiny_config(), model_type="mixtral"))
    with pytest.raises(ValueError, match="model_type is 'glm_moe_dsa' but DeepseekV32ForCausalLM"):
        DeepseekV32ForCausalLM.from_config(dict(tiny_config(), model_type="glm_moe_dsa"))
    with pytest.raises(ValueError, match=r'indexer_types\[1\] is "sparse"; expected "full" or "shared"'):
        GlmMoeDsaForCausalLM.from_config(dict(tiny_config(), model_type="glm_moe_dsa",
                                              indexer_types=["full"] + ["sparse"] * 7))
    with pytest.raises(ValueError, match="starts with|first layer"):
        GlmMoeDsaForCausalLM.from_config(dict(tiny_config(), model_type="glm_moe_dsa", indexer_types=["shared"] * 8))
    # a tokenizer with more tokens than the model's vocabulary belongs to another checkpoint
    path, _ = tok_ckpt
    other = tmp_path / "other"
    other.mkdir()
    for f in ("config.json", "model.safetensors", "text.txt"):
        (other / f).write_bytes((path / f).read_bytes())
    tok = _bpe_tokenizer(other, 100)
    tok.add_tokens([f"<extra_{i}>" for i in range(100)])
    tok.save(str(other / "tokenizer.json"))
    assert main(["eval", "--model", str(other), "--text", str(other / "text.txt"), "--context", "32"]) == 2
    err = capsys.readouterr().err
    assert "tokens but the model's vocab_size is 128" in err and "does not belong to this checkpoint" in err
