"""Scale-out of the two hybrid families (DESIGN.md §11, issue 34): GLM-5.3-Flash (``glm5_next``) and
Qwen3.8-Flash-Next (``qwen4_exp_text``) over 2 gloo processes on the CPU, each layout against the
one-process model built from the same checkpoint (the reference; it equals transformers in
tests/test_glm5_next.py and tests/test_qwen4_exp.py): logits, the shared top-k rows a prompt
leaves, and greedy tokens through the paged decode path, for tp 2, pp 2, pp 2 with the engines'
fallback (``pp_stage_starts_full``) and tp 2 x pp 2 on 4 ranks; parameter shapes per rank.

The checkpoints are the families' own tiny transformers-written ones. The patterns make pipeline
stage 1 (layers 4..6 of 7) begin on an S indexed layer, which attends the selection an F layer of
stage 0 made; the Qwen checkpoint moves one PLE layer onto stage 1 (PLE reads the token ids)."""

import warnings

import pytest
import torch
from gloo_ranks import model_outputs, run_on_ranks

from indexcache.models import from_pretrained

transformers = pytest.importorskip("transformers")
if not (hasattr(transformers, "Glm5NextForConditionalGeneration") and hasattr(transformers, "Qwen4ExpForCausalLM")):
    pytest.skip("this transformers lacks GLM-5.3-Flash or Qwen3.8-Flash-Next", allow_module_level=True)
import test_glm5_next as glm  # noqa: E402  (the families' checkpoint writers)
import test_qwen4_exp as qwen  # noqa: E402

# indexed layers: GLM 1 2 | 4 5 6, Qwen 1 3 | 4 6 ("|": the stage boundary of pp 2)
GLM_OVERRIDES = {"use_index_cache": True, "index_topk_pattern": "FFSFS"}
QWEN_OVERRIDES = {"use_index_cache": True, "index_topk_pattern": "FFSF"}
IDS = torch.tensor([[(5 * i + 3) % 120 + 3 for i in range(33)]])
PROMPTS = [[(7 * i + 3) % 120 + 3 for i in range(21)], [(5 * i + 11) % 120 + 3 for i in range(14)]]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next_par")
    glm.hf_model(seed=int(torch.randint(0, 1 << 30, ()))).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp_par")
    qwen.hf_text(path, seed=int(torch.randint(0, 1 << 30, ())), ple_layer_ids=[1, 6])
    return path


def one_process(path, overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every checkpoint tensor used or knowingly passed over
        model = from_pretrained(path, hf_overrides=overrides, dtype=torch.float32)
    return model, model_outputs(model, IDS, PROMPTS)


def _layouts(runs):
    """On each rank: for each (path, overrides, layouts), each layout's outputs and parameter shapes."""
    out = []
    for path, overrides, layouts in runs:
        got = {}
        for name, tp, pp in layouts:
            model = from_pretrained(path, hf_overrides=overrides, dtype=torch.float32, tp_size=tp, pp_size=pp,
                                    pp_stage_starts_full=name.endswith("_stage_full"))
            got[name] = {**model_outputs(model, IDS, PROMPTS), "pattern": model.plan.pattern,
                         "params": {n: tuple(p.shape) for n, p in model.named_parameters()}}
        out.append(got)
    return {"runs": out}


def check_equal(outs, want, layouts, i):
    for r, o in enumerate(outs):
        for name, _, _ in layouts:
            got = o["runs"][i][name]
            assert rel(got["logits"], want["logits"]) < 1e-5, (name, r)
            assert torch.equal(got["rows"], want["rows"]), (name, r)
            assert got["tokens"] == want["tokens"], (name, r)


PP, TP, PP_FULL = ("pp2", 1, 2), ("tp2", 2, 1), ("pp2_stage_full", 1, 2)
GLM_LAYOUTS, QWEN_LAYOUTS = [PP, TP, PP_FULL], [PP, TP, PP_FULL]


def test_tensor_and_pipeline_parallel_equal_one_process(glm_ckpt, qwen_ckpt, tmp_path):
    glm_model, glm_want = one_process(glm_ckpt, GLM_OVERRIDES)
    qwen_model, qwen_want = one_process(qwen_ckpt, QWEN_OVERRIDES)
    assert glm_model.plan.pattern == "FFSFS" and qwen_model.plan.pattern == "FFSF"
    runs = [(glm_ckpt, GLM_OVERRIDES, GLM_LAYOUTS), (qwen_ckpt, QWEN_OVERRIDES, QWEN_LAYOUTS)]
    outs = run_on_ranks(_layouts, (runs,), tmp_path)
    check_equal(outs, glm_want, [PP, TP], 0)
    check_equal(outs, qwen_want, [PP, TP], 1)
    # the engines' fallback forces stage 1's first indexed layer (4) to F: the one-process model of that plan
    for i, (path, pattern, base) in enumerate(((glm_ckpt, "FFFFS", glm_want), (qwen_ckpt, "FFFF", qwen_want))):
        want = one_process(path, {"use_index_cache": True, "index_topk_pattern": pattern})[1]
        assert rel(want["logits"], base["logits"]) > 1e-4  # layer 4's own selection changes the output
        assert [o["runs"][i]["pp2_stage_full"]["pattern"] for o in outs] == [pattern] * 2
        check_equal(outs, want, [PP_FULL], i)
    # GLM tp2: MLA and KDA heads split (1 of 2 each), the latent and the pooled indexer replicated,
    # routed experts 2 + 2, the dense MLP column/row split, hyper-connections replicated
    t = [o["runs"][0]["tp2"]["params"] for o in outs]
    one = {n: tuple(p.shape) for n, p in glm_model.named_parameters()}
    assert t[0]["model.layers.1.self_attn.q_b_proj.weight"] == (8, 24)
    assert t[0]["model.layers.1.self_attn.kv_b_proj.weight"] == (16, 16)
    assert t[1]["model.layers.1.self_attn.o_proj.weight"] == (32, 8)
    for name in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.q_a_proj.weight",
                 "model.layers.0.self_attn.forget_gate.f_a_proj.weight", "model.layers.0.self_attn.g_a_proj.weight",
                 "model.layers.0.self_attn.o_norm.weight", "model.layers.0.attn_hc.fn"):
        assert t[1][name] == one[name], name
    assert [n for n in t[0] if ".indexer." in n] == [n for n in one if ".indexer." in n]
    assert all(t[0][n] == one[n] for n in one if ".indexer." in n)
    assert t[0]["model.layers.0.self_attn.q_proj.weight"] == (8, 32)
    assert t[1]["model.layers.0.self_attn.v_conv1d.weight"] == (8, 1, 4)
    assert t[0]["model.layers.0.self_attn.forget_gate.f_b_proj.weight"] == (8, 8)
    assert t[0]["model.layers.0.self_attn.forget_gate.dt_bias"] == (8,)
    assert t[1]["model.layers.0.self_attn.forget_gate.A_log"] == (1,)
    assert t[0]["model.layers.0.self_attn.b_proj.weight"] == (1, 32)
    assert t[1]["model.layers.0.self_attn.g_b_proj.weight"] == (8, 8)
    assert t[0]["model.layers.0.self_attn.o_proj.weight"] == (32, 8)
    assert t[0]["model.layers.0.mlp.gate_proj.weight"] == (12, 32)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in t[1] and "model.layers.1.mlp.experts.2.up_proj.weight" \
        not in t[0] and "model.layers.1.mlp.experts.1.up_proj.weight" in t[0]
    assert t[0]["model.layers.1.mlp.shared_experts.down_proj.weight"] == (32, 4)
    # Qwen tp2: query heads 2 of 4 with their gates, kv heads 1 of 2, the fused [q | k | v] of Gated
    # DeltaNet as this rank's three ranges (key heads 1 of 2, value heads 2 of 4), experts 2 + 2,
    # the QSA indexer, the residual mixers and PLE replicated
    t = [o["runs"][1]["tp2"]["params"] for o in outs]
    one = {n: tuple(p.shape) for n, p in qwen_model.named_parameters()}
    assert t[0]["model.layers.1.self_attn.q_proj.weight"] == (64, 32)
    assert t[1]["model.layers.1.self_attn.k_proj.weight"] == (16, 32)
    assert t[1]["model.layers.1.self_attn.o_proj.weight"] == (32, 32)
    assert t[0]["model.layers.0.linear_attn.in_proj_qkv.weight"] == (32, 32)
    assert t[1]["model.layers.0.linear_attn.conv1d.weight"] == (32, 1, 4)
    assert t[0]["model.layers.0.linear_attn.dt_bias"] == (2,) and t[1]["model.layers.0.linear_attn.A_log"] == (2,)
    assert t[0]["model.layers.0.linear_attn.in_proj_z.weight"] == (16, 32)
    assert t[1]["model.layers.0.linear_attn.in_proj_b.weight"] == (2, 32)
    assert t[0]["model.layers.0.linear_attn.out_proj.weight"] == (32, 16)
    assert t[0]["model.layers.0.mlp.shared_expert.gate_proj.weight"] == (12, 32)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in t[1] and \
        "model.layers.0.mlp.experts.3.down_proj.weight" not in t[0]
    for name in [n for n in one if any(k in n for k in (".indexer.", "hyper_connection", ".ple.", "hc_head",
                                                          "linear_attn.norm", "mlp.gate.", "shared_expert_gate"))]:
        assert t[0][name] == one[name] == t[1][name], name
    # GLM: layers 0..3 with the embedding on stage 0, 4..6 with the LM head on stage 1 (the mean of
    # the streams has no parameters); an S layer holds no indexer on either stage
    g = [set(o["runs"][0]["pp2"]["params"]) for o in outs]
    assert "model.embed_tokens.weight" in g[0] and "model.embed_tokens.weight" not in g[1]
    assert "lm_head.weight" in g[1] and "lm_head.weight" not in g[0]
    assert not any(n.startswith("model.layers.4.") for n in g[0]) and any(n.startswith("model.layers.4.") for n in g[1])
    assert not any(n.startswith("model.layers.4.self_attn.indexer.") for n in g[1])
    assert any(n.startswith("model.layers.5.self_attn.indexer.") for n in g[1])
    # Qwen: the final stream mixer and the PLE of layer 5 on stage 1 only
    q = [set(o["runs"][1]["pp2"]["params"]) for o in outs]
    mixer = [n for n in q[1] if n.startswith("model.hc_head.")]
    assert mixer and not any(n.startswith("model.hc_head.") for n in q[0])
    assert any(n.startswith("model.layers.5.ple.") for n in q[1])
    assert any(n.startswith("model.layers.0.ple.") for n in q[0])


def test_pipeline_stage_caches_skip_other_stages_layers(glm_ckpt, qwen_ckpt):
    """A stage's paged cache holds nothing for the layers another stage runs (built in one process
    with a stand-in ParallelContext for stage 1; no weights are read)."""
    from indexcache.loader import load_config
    from indexcache.models import model_class
    from indexcache.parallel import ParallelContext

    stage1 = ParallelContext(tp_size=1, pp_size=2, rank=1)
    for path, overrides in ((glm_ckpt, GLM_OVERRIDES), (qwen_ckpt, QWEN_OVERRIDES)):
        cfg = load_config(path)
        model = model_class(cfg).from_config(cfg, overrides, parallel=stage1)
        cache = model.allocate_cache(4, block_size=16)
        held = [i for i in range(7) if cache.layer_bytes(i) != (0, 0)]
        assert held and min(held) >= 4, (path, held)


def test_glm_tensor_parallel_refuses_a_width_it_cannot_split(glm_ckpt):
    """Every width tp does not divide, named, before any weight is read (no process group needed)."""
    from indexcache.loader import load_config
    from indexcache.models import Glm5NextForCausalLM
    from indexcache.parallel import ParallelContext

    cfg = load_config(glm_ckpt)
    cfg["text_config"] = {**cfg["text_config"], "linear_num_heads": 3}
    cfg["text_config"].pop("linear_attn_config", None)
    with pytest.raises(ValueError, match=r"linear_num_heads 3 is not divisible by tp_size 2"):
        Glm5NextForCausalLM.from_config(cfg, parallel=ParallelContext(tp_size=2), init="meta")
    with pytest.raises(ValueError, match=r"num_attention_heads 2 is not divisible by tp_size 4"):
        Glm5NextForCausalLM.from_config(load_config(glm_ckpt), parallel=ParallelContext(tp_size=4), init="meta")


def test_qwen_tensor_parallel_refuses_a_width_it_cannot_split(qwen_ckpt):
    from indexcache.loader import load_config
    from indexcache.models.qwen4_exp import Qwen4ExpForCausalLM
    from indexcache.parallel import ParallelContext

    with pytest.raises(ValueError, match=r"num_key_value_heads 2 is not divisible by tp_size 4; "
                                         r"linear_num_key_heads 2 is not divisible by tp_size 4$"):
        Qwen4ExpForCausalLM.from_config(load_config(qwen_ckpt), parallel=ParallelContext(tp_size=4), init="meta")


def test_tensor_times_pipeline_parallel_equals_one_process(glm_ckpt, qwen_ckpt, tmp_path):
    """tp 2 x pp 2 on 4 ranks: each stage's pair splits its layers' heads; stage 1 begins on S."""
    both = [("tp2pp2", 2, 2)]
    runs = [(glm_ckpt, GLM_OVERRIDES, both), (qwen_ckpt, QWEN_OVERRIDES, both)]
    outs = run_on_ranks(_layouts, (runs,), tmp_path, world=4)
    check_equal(outs, one_process(glm_ckpt, GLM_OVERRIDES)[1], both, 0)
    check_equal(outs, one_process(qwen_ckpt, QWEN_OVERRIDES)[1], both, 1)
    glm_params = [o["runs"][0]["tp2pp2"]["params"] for o in outs]
    assert [p.get("model.layers.5.self_attn.q_b_proj.weight") for p in glm_params] == [None, None, (8, 24), (8, 24)]
    assert [p.get("model.layers.0.self_attn.q_proj.weight") for p in glm_params] == [(8, 32), (8, 32), None, None]


def test_row_ranges_read_their_rows_and_refuse_fp8(tmp_path):
    """A weight of several row ranges (Gated DeltaNet's fused [q | k | v] under tp) gets exactly those
    rows in order; an fp8 tensor read that way is refused by name."""
    from safetensors.torch import save_file

    from indexcache import loader
    from indexcache.models.blocks.gdn import RowRanges

    full = torch.randn(10, 3)
    save_file({"w.weight": full, "q.weight": full.to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    reader = loader._Reader(loader._weight_files(tmp_path), (128, 128))
    mod = RowRanges((10, 3), [(1, 3), (6, 9)])
    mod.weight.data.fill_(float("nan"))
    used = set()
    with torch.no_grad():  # as load_weights runs it
        loader._copy_param(reader, "w.weight", mod, "weight", used)
        assert torch.equal(mod.weight, torch.cat((full[1:3], full[6:9]))) and used == {"w.weight"}
        with pytest.raises(ValueError, match="q.weight is stored in fp8"):
            loader._copy_param(reader, "q.weight", mod, "weight", used)
