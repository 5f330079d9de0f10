"""One forward: training (``tools.train``), training-aware distillation (``tools.aware``) and the
pattern tools (``tools.patterns``) run the model's own blocks, with the plan handed to them as
data. Each test wraps the blocks' ``forward`` (or makes it fail) and checks the tool went
through it, layer by layer; and the torch form the training tools run gives the same loss as
the kernels' form of the same model (fp32 scoring, windows no longer than index_topk, so the
selection is the causal window on both sides)."""

import pytest
import torch
import torch.nn.functional as F

from indexcache.models import BatchMeta
from indexcache.models.blocks import MLA, DecoderLayer, Indexer
from indexcache.models.blocks.hyper import HyperDecoderLayer
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.hy_v4 import HYV4ForCausalLM
from indexcache.models.tiny import tiny_config
from indexcache.tools.aware import aware_forward
from indexcache.tools.aware_loss import serving_groups
from indexcache.tools.patterns import PatternRunner
from indexcache.tools.train import train_forward

SMALL = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
             n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, index_n_heads=2, index_topk=8,
             max_position_embeddings=256, num_nextn_predict_layers=1)
# HY-V4's block: sinks, output gate, hyper-connections, fused clamped experts (its defaults)
HY_SMALL = dict(model_type="hy_v4", vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1,
                index_n_heads=2, index_head_dim=16, index_topk=8, max_position_embeddings=256,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"])


def _model(pattern=None, seed=0):
    ov = {"use_index_cache": True, "index_topk_pattern": pattern} if pattern else None
    return DeepseekV32ForCausalLM.from_config(tiny_config(**SMALL), ov, dtype=torch.float32, seed=seed,
                                              indexer_fp8=False)


@pytest.fixture
def calls(monkeypatch):
    """Counts of each block method called, by layer id."""
    seen = {"decoder": [], "mla": [], "indexer": [], "select": []}
    for cls, name, key in ((DecoderLayer, "forward", "decoder"), (HyperDecoderLayer, "forward", "decoder"),
                           (MLA, "forward", "mla"),
                           (Indexer, "forward", "indexer"), (Indexer, "select", "select")):
        orig = getattr(cls, name)

        def wrapped(self, *a, _orig=orig, _key=key, **k):
            seen[_key].append(self.layer_id)
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, name, wrapped)
    return seen


def test_training_runs_the_blocks(calls):
    model = _model()
    ids = torch.randint(0, 256, (2, 13))
    lm, kl, mtp = train_forward(model, ids, "sparse")
    assert calls["decoder"] == [0, 1, 2, 3, 4] and calls["mla"] == [0, 1, 2, 3, 4]  # MTP layer 4 included
    assert calls["select"] == [0, 1, 2, 3, 4] and calls["indexer"] == []            # torch form, no kernel
    assert kl is not None and kl > 0 and mtp is not None


def test_training_aware_runs_the_blocks_under_the_plan(calls):
    model = _model("FSSF")
    groups = serving_groups(list(model.plan.source_layer), 4)
    aware_forward(model, torch.randint(0, 256, (2, 13)), "sparse", groups)
    assert calls["mla"] == [0, 1, 2, 3] and calls["select"] == [0, 3]  # S layers reuse, as at inference


def test_pattern_tools_run_the_blocks_with_the_pattern_as_data(calls):
    model = _model()
    runner = PatternRunner(model, torch.randint(0, 256, (2, 13)))
    runner.run("FSFS")
    assert calls["mla"] == [0, 1, 2, 3] and calls["indexer"] == [0, 2]
    assert all(layer.self_attn.indexer is not None for layer in model.model.layers)  # nothing flipped or dropped
    calls["indexer"].clear()
    runner.run("FFFF")
    assert calls["indexer"] == [0, 1, 2, 3]


@pytest.mark.parametrize("tool", ["train", "aware", "patterns"])
def test_a_bypassed_block_fails_the_tool(monkeypatch, tool):
    model = _model()
    ids = torch.randint(0, 256, (1, 9))

    def broken(self, *a, **k):
        raise RuntimeError("MLA.forward bypassed?")

    monkeypatch.setattr(MLA, "forward", broken)
    with pytest.raises(RuntimeError, match="bypassed"):
        if tool == "train":
            train_forward(model, ids, "dense")
        elif tool == "aware":
            aware_forward(model, ids, "warmup", serving_groups(list(model.plan.source_layer), 4))
        else:
            PatternRunner(model, ids).run("FFFF")


@pytest.mark.parametrize("pattern", [None, "FSSF"])
def test_torch_form_equals_kernel_form(pattern):
    """The differentiable forward and the inference forward of one model give the same loss."""
    model = _model(pattern, seed=5)
    assert_torch_form_equals_kernel_form(model, torch.randint(0, 256, (2, 9)))  # 8 positions <= index_topk


def assert_torch_form_equals_kernel_form(model, ids: torch.Tensor) -> None:
    """``model``'s training forward (sparse and dense) gives its inference forward's loss on ``ids``,
    whose windows are no longer than index_topk (so the selection is the whole causal window)."""
    logits = model(ids[:, :-1])
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    with torch.no_grad():
        got, _, _ = train_forward(model, ids, "sparse", mtp_weight=0, with_kl=False)
        dense, _, _ = train_forward(model, ids, "dense", mtp_weight=0)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(dense) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("pattern", [None, "FSFS"])
def test_hy_v4_torch_form_equals_kernel_form(pattern, calls):
    """The same for HY-V4's block: the torch form handles sinks, the gate and the hyper-connections."""
    ov = {"use_index_cache": True, "index_topk_pattern": pattern} if pattern else None
    model = HYV4ForCausalLM.from_config(HY_SMALL, ov, dtype=torch.float32, seed=3, indexer_fp8=False)
    assert model.model.layers[0].self_attn.sinks is not None and model.model.hc_head is not None
    ids = torch.randint(0, 256, (2, 9))
    logits = model(ids[:, :-1])
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    for key in calls:
        calls[key].clear()
    with torch.no_grad():
        got, _, _ = train_forward(model, ids, "sparse", mtp_weight=0, with_kl=False)
    assert calls["decoder"] == [0, 1, 2, 3] and calls["mla"] == [0, 1, 2, 3]
    assert calls["select"] == ([0, 2] if pattern else [0, 1, 2, 3])
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    runner = PatternRunner(HYV4ForCausalLM.from_config(HY_SMALL, dtype=torch.float32, seed=3, indexer_fp8=False),
                           torch.randint(0, 256, (2, 13)))
    calls["indexer"].clear()
    runner.run("FSSF")
    assert calls["indexer"] == [0, 3]


def test_mtp_reuse_is_data_not_a_flip():
    """A draft step that reuses rows leaves no state behind on the MTP layer."""
    model = _model()
    meta = BatchMeta.dense(1, 6, "cpu")
    ids = torch.randint(0, 256, (6,))
    h = model.forward_tokens(ids, meta)
    rows = model.topk_buffer[:6].clone()
    h1, l1 = model.forward_mtp(ids, h, meta, reuse_topk=rows)
    h2, l2 = model.forward_mtp(ids, h, meta)  # runs its own indexer: with a window <= top-k, the same rows
    assert torch.equal(l1, l2)
    with pytest.raises(ValueError, match="full names 3 layers"):
        model.forward_context(meta, full=[True] * 3)
