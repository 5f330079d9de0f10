"""MiniMax-M3 over tensor and pipeline parallelism (DESIGN.md §11; gloo, spawned processes): the
text layout (fused gate_up MLPs kept whole) and the VL layout (every MLP split) over TP 2, and PP 2
with the second stage starting on an S sparse layer, each equal to one process: logits (rel 1e-5,
bit-identical on both ranks), the shared block-selection rows (bit for bit), greedy tokens."""

import torch
from gloo_ranks import model_outputs, run_on_ranks
from test_minimax_m3 import TEXT, ours, rel

from indexcache.models import MiniMaxM3ForCausalLM, MiniMaxM3VLTextTower, from_pretrained


PAR_PATTERN = {"use_index_cache": True, "index_topk_pattern": "FSSF"}  # PP 2: stage 1 (layers 3-5) starts on S layer 4
PAR_LAYOUTS = [("text_tp2", "text", 2, 1), ("vl_tp2", "vl", 2, 1), ("text_pp2", "text", 1, 2)]
PAR_IDS = torch.tensor([[(3 * i + 1) % 96 for i in range(40)]])
PAR_PROMPTS = [[(7 * i + 3) % 96 for i in range(30)], [(5 * i + 11) % 96 for i in range(21)]]


def _par_outputs(model):
    return {**model_outputs(model, PAR_IDS, PAR_PROMPTS), "bytes": model.resident_weight_bytes()}


def _par_models(tmp):
    out = {}
    for name, layout, tp, pp in PAR_LAYOUTS:
        model = from_pretrained(tmp / layout, hf_overrides=PAR_PATTERN, dtype=torch.float32, tp_size=tp, pp_size=pp)
        out[name] = {**_par_outputs(model), "comm": dict(model.par.comm_bytes)}
    return out


def test_tensor_and_pipeline_parallel_equal_one_process(tmp_path):
    cfg = {**TEXT, "model_type": "minimax_m3_vl_text", "architectures": ["MiniMaxM3VLForCausalLM"],
           "bos_token_id": None, "eos_token_id": None}
    MiniMaxM3ForCausalLM.from_config(cfg, seed=1).save_pretrained(tmp_path / "text")
    vl = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
          "text_config": cfg, "vision_config": {"hidden_size": 16}}
    MiniMaxM3VLTextTower.from_config(vl, seed=2).save_pretrained(tmp_path / "vl")
    refs = {layout: _par_outputs(ours(tmp_path / layout, PAR_PATTERN)) for layout in ("text", "vl")}
    outs = run_on_ranks(_par_models, (tmp_path,), tmp_path)
    for name, layout, tp, pp in PAR_LAYOUTS:
        ref = refs[layout]
        for r, o in enumerate(outs):
            got = o[name]
            assert torch.equal(got["logits"], outs[0][name]["logits"]) and torch.equal(got["rows"], ref["rows"]), (name, r)
            assert rel(got["logits"], ref["logits"]) < 1e-5, (name, r, rel(got["logits"], ref["logits"]))
            assert got["tokens"] == ref["tokens"], (name, r)
            assert got["bytes"] < ref["bytes"] * 0.8, (name, r)  # its share of the weights
        if tp == 2:
            assert outs[0][name]["comm"]["attn_all_reduce"] > 0
    assert outs[0]["text_pp2"]["comm"]["stage_send"] > 0
