"""Training-aware IndexCache (python/indexcache/tools/aware.py, aware_loss.py): the multi-layer loss, training,
saving a checkpoint for its pattern, and errors. Tiny random models, a few steps each."""

import json
import math
from pathlib import Path

import pytest
import torch

import indexcache
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.tiny import tiny_config
from indexcache import differentiable
from indexcache.models import BatchMeta
from indexcache.tools.aware import AwareSchedule, aware_forward, load_for_pattern, train_aware
from indexcache.tools.aware_loss import multi_layer_kl, served_target, serving_groups

SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
             n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, index_n_heads=2, index_topk=8,
             max_position_embeddings=256, num_nextn_predict_layers=1)
FREQ2 = {"use_index_cache": True, "index_topk_pattern": "FSSF"}


def _text() -> bytes:
    root = Path(indexcache.__file__).parent
    return b"\n".join(p.read_bytes() for p in sorted(root.glob("*.py")))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("aware") / "init"
    DeepseekV32ForCausalLM.from_config(tiny_config(**SMALL), dtype=torch.bfloat16, seed=3).save_pretrained(path)
    return path


def test_loss_equals_hand_computation():
    # two layers served by one indexer, two heads each, two query rows over three keys
    a = torch.tensor([[[[0.5, 0.3, 0.2], [0.8, 0.2, 0.0]],
                       [[0.1, 0.1, 0.8], [0.8, 0.2, 0.0]]]])      # [B=1, H=2, rows=2, keys=3]
    b = torch.tensor([[[[0.2, 0.2, 0.6], [0.5, 0.5, 0.0]],
                       [[0.4, 0.4, 0.2], [0.5, 0.5, 0.0]]]])
    logits = torch.tensor([[[0.0, 1.0, 2.0], [0.0, 2.0, 100.0]]])  # the masked key's logit must not count
    allowed = torch.tensor([[[True, True, True], [True, True, False]]])
    target = [[0.3, 0.25, 0.45], [0.65, 0.35]]  # mean over layers of the head means

    def kl(t, lg):
        lse = math.log(sum(math.exp(v) for v in lg))
        return sum(p * (math.log(p) - (v - lse)) for p, v in zip(t, lg))

    want = (kl(target[0], [0.0, 1.0, 2.0]) + kl(target[1], [0.0, 2.0])) / 2
    assert served_target([a, b])[0, 0].tolist() == pytest.approx(target[0], abs=1e-6)
    assert float(multi_layer_kl(logits, [a, b], allowed)) == pytest.approx(want, rel=1e-5)
    # one layer per indexer is the single-layer DSA loss
    single = (kl([0.3, 0.2, 0.5], [0.0, 1.0, 2.0]) + kl([0.8, 0.2], [0.0, 2.0])) / 2
    assert float(multi_layer_kl(logits, [a], allowed)) == pytest.approx(single, rel=1e-5)


def test_serving_groups_follow_the_plan():
    plan = indexcache.build_layer_plan(8, use_index_cache=True, index_topk_freq=4)
    assert plan.pattern == "FFSSSFSS"
    assert serving_groups(list(plan.source_layer), 8) == {0: [0], 1: [1, 2, 3, 4], 5: [5, 6, 7]}


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_chunked_loss_matches_whole_matrix(ckpt, stage):
    torch.manual_seed(1)
    model = load_for_pattern(ckpt, FREQ2)
    groups = serving_groups(list(model.plan.source_layer), 4)
    assert groups == {0: [0, 1, 2], 3: [3]}
    ids = torch.randint(0, 256, (2, 41))
    _, whole, rec = aware_forward(model, ids, stage, groups, keep=True)
    _, chunked, dropped = aware_forward(model, ids, stage, groups, chunk_elems=2 * 2 * 40 * 7)  # 6 rows a chunk
    assert dropped == {}  # each group's tensors go once its KL is taken
    for f in groups:
        assert chunked[f] == pytest.approx(whole[f], rel=1e-4)
    # the same loss written out over whole [T, T] matrices
    t = 40
    allowed = differentiable.allowed_keys(rec[0].selection, 0, t, 2, "cpu")
    probs = [differentiable.attention_probs(rec[l].q, rec[l].k, rec[l].scale, allowed) for l in groups[0]]
    ctx = model.forward_context(BatchMeta.dense(2, t, "cpu"))
    with torch.no_grad():
        q, k, w = model.model.layers[0].self_attn.indexer.dense_inputs(rec[0].x, rec[0].qr, ctx.cos, ctx.sin)
        direct = multi_layer_kl(differentiable.dense_indexer_logits(q, k, w), probs, allowed)
    assert whole[0] == pytest.approx(float(direct), rel=1e-4)
    assert whole[0] > 0


def test_training_lowers_loss_and_freezes_the_rest(ckpt, tmp_path):
    from safetensors.torch import load_file

    text = _text()
    sched = AwareSchedule(warmup_steps=8, sparse_steps=2, batch=2, context=64, lr=1e-2, eval_every=5, eval_windows=1)
    ids = torch.stack([torch.frombuffer(bytearray(text[i * 997:i * 997 + 65]), dtype=torch.uint8).long()
                       for i in range(3)])

    def loss_of(model):
        groups = serving_groups(list(model.plan.source_layer), 4)
        return sum(aware_forward(model, ids, "warmup", groups)[1].values())

    before = loss_of(load_for_pattern(ckpt, FREQ2))
    logs = []
    out = train_aware(tmp_path / "run", ckpt, FREQ2, sched, train_text=text, heldout_text=text[-2000:],
                      log=logs.append, progress=False)
    after_model = load_for_pattern(out, None)  # the checkpoint ships its pattern
    assert after_model.plan.pattern == "FSSF"
    after = loss_of(after_model)
    assert after < 0.9 * before, (before, after)
    hist = [json.loads(line) for line in (tmp_path / "run" / "aware_log.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist] == list(range(10)) and hist[-1]["stage"] == "sparse"

    init, trained = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, t in trained.items():
        if ".indexer." in name:
            continue
        assert t.dtype == init[name].dtype and torch.equal(t, init[name]), name  # bit-identical, MTP layer included
    assert not torch.equal(trained["model.layers.0.self_attn.indexer.wk.weight"],
                           init["model.layers.0.self_attn.indexer.wk.weight"])
    # resuming a finished run trains nothing more and writes the same checkpoint
    logs.clear()
    again = train_aware(tmp_path / "run", ckpt, FREQ2, sched, train_text=text, heldout_text=text[-2000:],
                        log=logs.append, progress=False)
    assert any("resuming at step 10" in line for line in logs)
    assert torch.equal(load_file(str(again / "model.safetensors"))["model.layers.3.self_attn.indexer.wq_b.weight"],
                       trained["model.layers.3.self_attn.indexer.wq_b.weight"])


def test_saved_checkpoint_carries_its_plan(ckpt, tmp_path):
    from safetensors.torch import load_file

    ov = {"use_index_cache": True, "index_topk_freq": 2}  # offset 2: F S F S -> "FFSF"
    sched = AwareSchedule(warmup_steps=1, sparse_steps=1, batch=1, context=32, eval_every=2, eval_windows=1)
    out = train_aware(tmp_path / "run", ckpt, ov, sched, train_text=_text(), heldout_text=_text()[:500],
                      log=lambda s: None, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["use_index_cache"] is True and cfg["indexer_types"] == ["full", "full", "shared", "full"]
    assert "index_topk_freq" not in cfg and "index_topk_pattern" not in cfg
    names = load_file(str(out / "model.safetensors")).keys()
    assert not any(n.startswith("model.layers.2.self_attn.indexer.") for n in names)
    assert all(any(n.startswith(f"model.layers.{l}.self_attn.indexer.") for n in names) for l in (0, 1, 3, 4))
    model = DeepseekV32ForCausalLM.from_pretrained(out)  # no overrides needed
    assert model.plan.pattern == "FFSF" and model.ic_config.shipped_by_checkpoint
    assert model.model.layers[2].self_attn.indexer is None
    assert torch.isfinite(model(torch.randint(0, 256, (1, 24)))).all()
    from indexcache.tools.aware_table import trained_source_overlap
    from indexcache.tools.patterns import text_windows

    ov = trained_source_overlap(ckpt, out, text_windows(_text(), 32, 2))
    assert ov[:2] == [1.0, 1.0] and ov[3] == 1.0 and 0.0 <= ov[2] < 1.0


def test_bad_input_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match="has 5 layers, the checkpoint .* has 4"):
        load_for_pattern(ckpt, {"use_index_cache": True, "index_topk_pattern": "FSFSF"})
    with pytest.raises(ValueError, match="has 3 layers, the checkpoint .* has 4"):
        load_for_pattern(ckpt, {"use_index_cache": True, "index_topk_pattern": "FSF"})
    with pytest.raises(ValueError, match="indexer_types has 2 entries"):
        load_for_pattern(ckpt, {"use_index_cache": True, "indexer_types": ["full", "shared"]})
    with pytest.raises(ValueError, match="use_index_cache"):
        load_for_pattern(ckpt, {"index_topk_freq": 2})
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(tiny_config(**{**SMALL, "index_topk": 0})))
    with pytest.raises(ValueError, match="not a DSA checkpoint.*no indexer to train"):
        load_for_pattern(dense, FREQ2)
    from indexcache.cli import main

    assert main(["train", "--out", str(tmp_path / "x"), "--hf-overrides", json.dumps(FREQ2)]) == 2  # no --init
    assert main(["train", "--out", str(tmp_path / "x"), "--init", str(ckpt), "--hf-overrides",
                 '{"use_index_cache": true, "index_topk_pattern": "FSXF"}']) == 2


def test_glm5_layout_and_fp8_checkpoint(tmp_path):
    from indexcache.models import GlmMoeDsaForCausalLM, from_pretrained

    cfg = tiny_config(**SMALL, model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"],
                      indexer_types=["full"] * 4, index_topk_freq=1, index_skip_topk_offset=3)
    GlmMoeDsaForCausalLM.from_config(cfg, dtype=torch.bfloat16, seed=5).save_pretrained(tmp_path / "glm", fp8=True)
    ov = {"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1}  # F S F S
    sched = AwareSchedule(warmup_steps=2, sparse_steps=1, batch=1, context=32, eval_every=3, eval_windows=1)
    out = train_aware(tmp_path / "run", tmp_path / "glm", ov, sched, train_text=_text(), heldout_text=_text()[:500],
                      log=lambda s: None, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["indexer_types"] == ["full", "shared", "full", "shared"]
    assert "index_topk_freq" not in cfg and "index_skip_topk_offset" not in cfg
    model = from_pretrained(out)
    assert isinstance(model, GlmMoeDsaForCausalLM) and model.plan.pattern == "FSFS"


def test_model_mode_trains_main_layers_not_mtp(ckpt, tmp_path):
    from safetensors.torch import load_file

    sched = AwareSchedule(warmup_steps=1, sparse_steps=2, batch=1, context=32, mode="model", eval_every=3, eval_windows=1)
    out = train_aware(tmp_path / "run", ckpt, FREQ2, sched, train_text=_text(), heldout_text=_text()[:500],
                      log=lambda s: None, progress=False)
    init, trained = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {n for n in trained if not torch.equal(trained[n], init[n])}
    assert "model.layers.1.self_attn.q_a_proj.weight" in changed and "lm_head.weight" in changed
    assert not any(n.startswith("model.layers.4.") for n in changed)  # the MTP layer stays
    assert not any("e_score_correction_bias" in n for n in changed)
    with pytest.raises(ValueError, match="mode must be one of"):
        train_aware(tmp_path / "bad", ckpt, FREQ2, AwareSchedule(mode="all"), train_text=_text(), progress=False)


def test_plain_train_command_keeps_its_schedule(tmp_path, monkeypatch):
    import indexcache.tools.train as tr
    from indexcache.cli import main

    seen = {}
    monkeypatch.setattr(tr, "train", lambda out, sched, init=None: seen.update(sched=sched, init=init) or out)
    assert main(["train", "--out", str(tmp_path)]) == 0
    assert seen["sched"] == tr.TrainSchedule() and seen["init"] is None
    assert main(["train", "--out", str(tmp_path), "--warmup-steps", "120", "--sparse-context-len", "512"]) == 0
    assert seen["sched"] == tr.TrainSchedule(warmup_steps=120, sparse_context=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexers_mode_leaves_every_other_tensor_bit_identical(tmp_path, dtype):
    """``train --mode indexers`` on an fp32 and on a bf16 checkpoint: every tensor but the kept
    indexers' comes out bit for bit as it went in, in its stored dtype (lm_head included)."""
    from safetensors.torch import load_file

    from indexcache.cli import main

    init = tmp_path / "init"
    DeepseekV32ForCausalLM.from_config(tiny_config(**SMALL), dtype=dtype, seed=11).save_pretrained(init)
    text = tmp_path / "text.txt"
    text.write_bytes(_text())
    assert main(["train", "--out", str(tmp_path / "run"), "--init", str(init), "--hf-overrides", json.dumps(FREQ2),
                 "--mode", "indexers", "--warmup-steps", "1", "--sparse-steps", "1", "--batch", "1",
                 "--context-len", "32", "--eval-every", "2", "--text", str(text), "--heldout-text", str(text)]) == 0
    before = load_file(str(init / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert before["lm_head.weight"].dtype == dtype
    kept = [n for n in after if ".indexer." in n]
    s_layers = ("model.layers.1.self_attn.indexer.", "model.layers.2.self_attn.indexer.")  # FSSF
    assert kept and set(after) == {n for n in before if not n.startswith(s_layers)}
    for name, t in after.items():
        assert t.dtype == before[name].dtype, name
        if ".indexer." not in name:
            assert torch.equal(t, before[name]), name
    assert not torch.equal(after["model.layers.0.self_attn.indexer.wq_b.weight"],
                           before["model.layers.0.self_attn.indexer.wq_b.weight"])


class _Payload:
    """Unpickling this would touch a file: a resume state must never get that far."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_state_is_plain_data_of_this_run(ckpt, tmp_path):
    from indexcache.resume import load_resume_state, save_resume_state
    from indexcache.tools.train import TrainSchedule, train

    sched = AwareSchedule(warmup_steps=1, sparse_steps=1, batch=1, context=32, eval_every=2, eval_windows=1)
    kw = dict(train_text=_text(), heldout_text=_text()[:500], log=lambda s: None, progress=False)
    marker = tmp_path / "ran"
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"meta": _Payload(marker), "step": 0}, run / "aware_state.pt")
    with pytest.raises(ValueError, match="not a resume state of this run"):
        train_aware(run, ckpt, FREQ2, sched, **kw)
    assert not marker.exists()
    # a genuine state of another schedule, and one of another model, are refused
    train_aware(tmp_path / "ok", ckpt, FREQ2, sched, **kw)
    with pytest.raises(ValueError, match="written for another meta"):
        train_aware(tmp_path / "ok", ckpt, FREQ2, AwareSchedule(warmup_steps=2, sparse_steps=1, batch=1, context=32,
                                                                eval_every=2, eval_windows=1), **kw)
    state = torch.load(tmp_path / "ok" / "aware_state.pt", weights_only=True)
    model = load_for_pattern(ckpt, FREQ2)
    assert load_resume_state(tmp_path / "ok" / "aware_state.pt", {"meta": state["meta"]}, model)["step"] == 2
    state["model"] = {k: v for k, v in state["model"].items() if "indexer" not in k}
    save_resume_state(tmp_path / "ok" / "aware_state.pt", state)
    with pytest.raises(ValueError, match="another model's tensors"):
        train_aware(tmp_path / "ok", ckpt, FREQ2, sched, **kw)
    # the plain training loop reads its state the same way
    (tmp_path / "plain").mkdir()
    torch.save({"schedule": _Payload(marker)}, tmp_path / "plain" / "train_state.pt")
    with pytest.raises(ValueError, match="not a resume state of this run"):
        train(tmp_path / "plain", TrainSchedule(dense_steps=1, warmup_steps=0, sparse_steps=0),
              config=tiny_config(**SMALL), stdlib_root=Path(indexcache.__file__).parent, max_train_bytes=20000)
    assert not marker.exists()
