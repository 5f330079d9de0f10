"""``indexcache plan --gpu-mem`` for the hybrid families (issue 34): GLM-5.3-Flash (``glm5_next``)
and Qwen3.8-Flash-Next (``qwen4_exp_text``). The tool builds each stage on the meta device; here
each figure is measured on the real model built on the CPU for that rank layout from a tiny
transformers-written checkpoint: the bytes of its parameters, and the tensors of the paged cache it
allocates (per token: the pages divided by the blocks times the block size; per request: the
linear-attention state of one slot), with and without IndexCache, for tp 1, tp 2 and pp 2."""

import json

import pytest
import torch

from indexcache.cli.app import build_parser, main
from indexcache.loader import load_config
from indexcache.models import model_class
from indexcache.models.hybrid_sizing import hybrid_budget
from indexcache.parallel import ParallelContext

transformers = pytest.importorskip("transformers")
if not (hasattr(transformers, "Glm5NextForConditionalGeneration") and hasattr(transformers, "Qwen4ExpForCausalLM")):
    pytest.skip("this transformers lacks GLM-5.3-Flash or Qwen3.8-Flash-Next", allow_module_level=True)
import test_glm5_next as glm  # noqa: E402  (the families' checkpoint writers)
import test_qwen4_exp as qwen  # noqa: E402

BLOCKS, BLOCK = 3, 16
# (family, IndexCache pattern over the indexed layers); None: no IndexCache (every indexed layer F)
CASES = [("glm", "FFSFS"), ("glm", None), ("qwen", "FFSF"), ("qwen", None)]
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    g = tmp_path_factory.mktemp("glm5_next_size")
    glm.hf_model(seed=int(torch.randint(0, 1 << 30, ()))).save_pretrained(g)
    q = tmp_path_factory.mktemp("qwen4_exp_size")
    qwen.hf_text(q, seed=int(torch.randint(0, 1 << 30, ())), ple_layer_ids=[1, 6])
    return {"glm": g, "qwen": q}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measured(cfg: dict, pattern, tp: int, pp: int, stage: int) -> tuple:
    """(parameter bytes, cache bytes per token, state bytes per request) of the real model of
    ``stage``'s first tensor-parallel rank and of the paged cache it allocates."""
    overrides = {} if pattern is None else {"use_index_cache": True, "index_topk_pattern": pattern}
    model = model_class(cfg).from_config(cfg, overrides, dtype=torch.bfloat16,
                                         parallel=ParallelContext(tp_size=tp, pp_size=pp, rank=stage * tp))
    params = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    cache = model.allocate_cache(BLOCKS, block_size=BLOCK, max_num_seqs=1)
    if hasattr(cache, "linear"):  # GLM: KDA state slots are handed out on demand
        cache.linear.slots(["r"], [0])
        pages = _nbytes(cache.kv) + _nbytes(cache.index_raw) + _nbytes(cache.index_pool)
        state = _nbytes(cache.linear.conv) + _nbytes(cache.linear.recurrent)
    else:
        pages = _nbytes(cache.k) + _nbytes(cache.v) + _nbytes(cache.index_k)
        state = _nbytes(t for st in cache.states for ts in st.values() for t in ts)
    return params, pages / (BLOCKS * BLOCK), state


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("family,pattern", CASES)
def test_figures_equal_the_built_model_and_cache(ckpts, family, pattern, tp, pp):
    cfg = load_config(ckpts[family])
    n = len(model_class(cfg).indexed_layers(model_class(cfg).args_class.from_config(
        model_class(cfg).family_config(cfg), model_class(cfg).model_type, model_class(cfg).config_defaults)))
    gpu = 3e6
    got = hybrid_budget(cfg, pattern or "F" * n, tp, pp, gpu, num_seqs=3)
    assert len(got["stages"]) == pp
    for st in got["stages"]:
        params, per_token, state = measured(cfg, pattern, tp, pp, st["stage"])
        assert st["weight_bytes"] == params
        assert st["cache_bytes_per_token"] == pytest.approx(per_token, rel=0, abs=1e-9)
        assert st["linear_state_bytes_per_request"] == state
        assert st["tokens_fit"] == int((gpu - params - 3 * state) // per_token)
    assert got["tokens_fit"] == min(st["tokens_fit"] for st in got["stages"])


def test_shared_layers_hold_no_index_cache(ckpts):
    """An S layer's index cache is gone (the plan needs fewer bytes per token than all F) and
    its latent / K/V stays; the linear state does not depend on the plan."""
    for family, pattern in (("glm", "FFSFS"), ("qwen", "FFSF")):
        cfg = load_config(ckpts[family])
        plan = hybrid_budget(cfg, pattern, 1, 1, 1e9)["stages"][0]
        all_f = hybrid_budget(cfg, "F" * len(pattern), 1, 1, 1e9)["stages"][0]
        assert plan["cache_bytes_per_token"] < all_f["cache_bytes_per_token"]
        assert plan["linear_state_bytes_per_request"] == all_f["linear_state_bytes_per_request"] > 0
        assert plan["tokens_fit"] > all_f["tokens_fit"]


def test_a_stage_without_indexed_layers_bounds_nothing(ckpts):
    """pp 2 over layers linear x4 | indexed x3: stage 0 has no per-token cache (tokens_fit None) but
    holds the KDA state; stage 1 bounds the pipeline, and its figures are the built model's."""
    cfg = load_config(ckpts["glm"])
    cfg["text_config"] = {**cfg["text_config"], "layer_types": ["linear_attention"] * 4 + ["indexed_attention"] * 3}
    got = hybrid_budget(cfg, "FSF", 1, 2, 1e7, num_seqs=2)
    s0, s1 = got["stages"]
    assert s0["cache_bytes_per_token"] == 0 and s0["tokens_fit"] is None and s0["linear_state_bytes_per_request"] > 0
    params, per_token, state = measured(cfg, "FSF", 1, 2, 1)
    assert (s1["weight_bytes"], s1["cache_bytes_per_token"], s1["linear_state_bytes_per_request"]) == \
        (params, per_token, state)
    assert got["bounding_stage"] == 1 and got["tokens_fit"] == int((1e7 - params - 2 * state) // per_token)
    tight = hybrid_budget(cfg, "FSF", 1, 2, s0["weight_bytes"] + 2 * s0["linear_state_bytes_per_request"] - 1, num_seqs=2)
    assert tight["stages"][0]["tokens_fit"] == 0 and tight["bounding_stage"] == 0  # its weights + state do not fit


def test_cli_prints_the_measured_figures(ckpts, capsys):
    cfg = load_config(ckpts["qwen"])
    assert main(["plan", "--config", str(ckpts["qwen"]), "--tp", "2", "--gpu-mem", "0.004", "--num-seqs", "2",
                 "--hf-overrides", json.dumps({"use_index_cache": True, "index_topk_pattern": "FFSF"}),
                 "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["scaleout"]["plan_memory"]
    params, per_token, state = measured(cfg, "FFSF", 2, 1, 0)
    st = mem["stages"][0]
    assert (st["weight_bytes"], st["cache_bytes_per_token"], st["linear_state_bytes_per_request"]) == \
        (params, per_token, state)
    assert mem["tokens_fit"] == int((4e6 - params - 2 * state) // per_token)
    assert main(["plan", "--config", str(ckpts["glm"]), "--pp", "2", "--gpu-mem", "1"]) == 0
    assert "tokens of context per GPU" in capsys.readouterr().out


def plan(*argv):
    """``indexcache plan ARGV`` letting its ValueError through (``main`` prints it and returns 2)."""
    args = build_parser().parse_args(["plan", *argv])
    return args.func(args)


def test_configs_it_cannot_size_are_refused(ckpts, tmp_path):
    g = str(ckpts["glm"])
    assert main(["plan", "--config", g, "--gpu-mem", "1", "--kv-cache-dtype", "fp8_ds_mla"]) == 2
    with pytest.raises(ValueError, match="no FP8 MLA format"):
        plan("--config", g, "--gpu-mem", "1", "--kv-cache-dtype", "fp8_ds_mla")
    with pytest.raises(ValueError, match=r"num_attention_heads 2 is not divisible by tp_size 4"):
        plan("--config", g, "--tp", "4", "--gpu-mem", "1")
    with pytest.raises(ValueError, match="--num-seqs must be >= 1"):
        plan("--config", g, "--gpu-mem", "1", "--num-seqs", "0")
    with pytest.raises(ValueError, match="prints its per-GPU memory only"):
        plan("--config", g, "--tp", "2")
    flat = tmp_path / "config.json"
    flat.write_text(json.dumps({"num_hidden_layers": 4, "index_topk_freq": 2, "use_index_cache": True}))
    with pytest.raises(ValueError, match="only the hybrid families"):
        plan("--config", str(flat), "--gpu-mem", "1", "--num-seqs", "2")
    with pytest.raises(ValueError, match="a DSA latent cache is fp8_ds_mla or bf16"):
        plan("--config", str(flat), "--gpu-mem", "1", "--kv-cache-dtype", "fp32")


@pytest.mark.parametrize("family,pattern", CASES)
def test_plan_reports_the_whole_sequence_cache(ckpts, family, pattern, capsys):
    """``plan --config`` (no --gpu-mem): one request's whole cache at the context, all F and under
    the plan, equals the paged cache the real model allocates (pages per token x context + one
    slot of linear-attention state); IndexCache removes only the S layers' index caches."""
    path = ckpts[family]
    cfg = load_config(path)
    context = BLOCKS * BLOCK * 7
    overrides = [] if pattern is None else ["--hf-overrides", json.dumps({"use_index_cache": True,
                                                                            "index_topk_pattern": pattern})]
    assert main(["plan", "--config", str(path), "--json", "--context", str(context), *overrides]) == 0
    costs = json.loads(capsys.readouterr().out)["costs"]
    seq = costs["sequence_cache_bytes"]
    _, per_token, state = measured(cfg, pattern, 1, 1, 0)
    _, all_f_token, all_f_state = measured(cfg, None, 1, 1, 0)
    assert seq["linear_state_bytes"] == state == all_f_state > 0
    assert seq["plan"] == round(state + context * per_token) and seq["all_f"] == round(state + context * all_f_token)
    assert seq["removed"] == costs["index_k_cache_bytes_per_sequence"]["removed"]  # the index caches, nothing else
    assert (seq["removed"] > 0) == (pattern is not None)
    assert main(["plan", "--config", str(path), "--context", str(context), *overrides]) == 0
    out = capsys.readouterr().out
    assert "whole cache per sequence (attention in bf16)" in out and "of which linear-attention state" in out
