"""Scale-out (DESIGN.md §11): tensor, expert and pipeline parallel over torch.distributed (gloo, CPU,
spawned processes), FP8 weights resident, per-rank loading and its errors.

Every parallel layout loads the same fp32 checkpoint as a single-process model and must give its
logits (rel < 1e-5), its greedy tokens (prefill, paged decode, MTP drafting), bit-identical logits
and top-k rows on every rank, and hold only its share of the parameters. One spawn of 2 processes
runs all world-size-2 layouts in turn; one spawn of 4 runs TP 2 x PP 2.
"""

import json
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import indexcache

from indexcache.runtime import generate
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.state import BatchMeta
from indexcache.models.tiny import tiny_config
from indexcache.parallel import ParallelContext, ShardedLinear, stage_bounds, stage_start_full_pattern

CFG = tiny_config(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=6,
    num_nextn_predict_layers=1, num_attention_heads=2, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, index_n_heads=4, index_topk=16, max_position_embeddings=512,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    bos_token_id=None, eos_token_id=None, max_num_batched_tokens=256,
)
FREQ2 = {"use_index_cache": True, "index_topk_freq": 2}   # 6 layers -> FFSFSF
FREQ4 = {"use_index_cache": True, "index_topk_freq": 4}   # 6 layers -> FFSSSF: stage 1 of PP 2 starts on S (layer 3)
# step reuse (docs/model.md): fixed under TP; adaptive under PP, where the probe (layer 0, stage 0)
# must tell stage 1's F layer 5 which requests it sent back to computing (a bar of 0.99 sends most)
REUSE_TP = {**FREQ2, "index_reuse_steps": 3, "index_reuse_min_recall": 0.5}
REUSE_PP = {**FREQ4, "index_reuse_steps": 3, "index_reuse_min_recall": 0.99}
PROMPTS = [[(7 * i + 3) % 97 for i in range(30)], [(5 * i + 11) % 97 for i in range(21)]]  # > index_topk 16
IDS = torch.tensor([[(3 * i + 1) % 97 for i in range(40)]])
LOAD = dict(dtype=torch.float32, indexer_fp8=False)

# (name, overrides, tp, pp, extra from_pretrained keywords) run in one world of 2
LAYOUTS_2 = [
    ("tp2", None, 2, 1, {}),
    ("tp2_freq2", FREQ2, 2, 1, {}),
    ("pp2_s_start", FREQ4, 1, 2, {}),
    ("pp2_stage_full", FREQ4, 1, 2, {"pp_stage_starts_full": True}),
    ("tp2_fp8", FREQ2, 2, 1, {"weights": "fp8"}),
    ("tp2_step_reuse", REUSE_TP, 2, 1, {}),
    ("pp2_step_reuse", REUSE_PP, 1, 2, {}),
]
LAYOUTS_4 = [("tp2pp2", FREQ4, 2, 2, {})]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _paged_decode(model, steps=8):
    """PROMPTS[0] prefilled, then ``steps`` fixed tokens decoded one forward each over a paged cache
    (step reuse in force where the overrides ask): every step's logits and last top-k row."""
    cache = model.allocate_cache(8, "auto", 16)
    cache.manager.allocate(0, 128)
    prompt = PROMPTS[0]
    model.forward_tokens(torch.tensor(prompt), BatchMeta.paged_batch(cache, [0], [0], [len(prompt)]), cache,
                         reuse=False)
    logits, rows = [], []
    for i in range(steps):
        meta = BatchMeta.paged_batch(cache, [0], [len(prompt) + i], [1])
        h = model.forward_tokens(torch.tensor([(11 * i + 5) % 97]), meta, cache)
        logits.append(model.compute_logits(h))
        rows.append(model.topk_buffer[:1].clone())
    return torch.cat(logits), torch.cat(rows)


def _outputs(model):
    logits = model(IDS)
    rows = model.topk_buffer[:IDS.numel()].clone()
    plain = generate(model, PROMPTS, 5).tokens
    mtp = generate(model, PROMPTS, 5, num_speculative_tokens=2).tokens
    paged_logits, paged_rows = _paged_decode(model)
    return {"logits": logits, "rows": rows, "plain": plain, "mtp": mtp, "paged_logits": paged_logits,
            "paged_rows": paged_rows}


def _worker(rank, world, tmp, layouts, errors_too):
    import torch.distributed as dist
    torch.set_num_threads(1)
    out = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init{world}", rank=rank, world_size=world)
        for name, ov, tp, pp, kw in layouts:
            path = tmp / ("fp8" if kw.get("weights") == "fp8" else "ckpt")
            model = DeepseekV32ForCausalLM.from_pretrained(path, hf_overrides=ov, tp_size=tp, pp_size=pp, **LOAD, **kw)
            res = _outputs(model)
            res["bytes"] = model.resident_weight_bytes()
            res["params"] = sorted(n for n, _ in model.named_parameters())
            res["pattern"] = model.plan.pattern
            res["q_b_rows"] = [tuple(l.self_attn.q_b_proj.weight.shape) for l in model.model.layers
                               if l.self_attn is not None]
            res["comm"] = dict(model.par.comm_bytes)
            out[name] = res
        if errors_too:
            out["errors"] = _error_cases(tmp)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out["failure"] = traceback.format_exc()
    torch.save(out, tmp / f"rank{rank}_{world}.pt")


def _error_cases(tmp):
    """Each mismatch as (keywords, message): raised before any weight is read."""
    got = {}
    cases = {
        "world": dict(tp_size=2, pp_size=2),
        "layers": dict(path="few_layers", tp_size=1, pp_size=2),
        "heads": dict(path="odd_heads", tp_size=2),
        "experts": dict(path="odd_experts", tp_size=2),
        "shard": dict(path="missing_shard", tp_size=2),
    }
    for key, kw in cases.items():
        path = tmp / kw.pop("path", "ckpt")
        try:
            DeepseekV32ForCausalLM.from_pretrained(path, **LOAD, **kw)
            got[key] = None
        except ValueError as e:
            got[key] = str(e)
    return got


def _spawn(tmp, world, layouts, errors_too=False):
    mp.start_processes(_worker, args=(world, tmp, layouts, errors_too), nprocs=world, join=True, start_method="spawn")
    outs = [torch.load(tmp / f"rank{r}_{world}.pt", weights_only=True) for r in range(world)]
    for r, o in enumerate(outs):
        assert "failure" not in o, f"rank {r}:\n{o['failure']}"
    return outs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    torch.manual_seed(0)
    src = DeepseekV32ForCausalLM.from_config(CFG, dtype=torch.float32, indexer_fp8=False, seed=1)
    src.save_pretrained(tmp / "ckpt", max_shard_bytes=300_000)
    src.save_pretrained(tmp / "fp8", fp8=True)
    # mismatching checkpoints for the error checks: config.json and no weights at all, so an error
    # that comes "before any weight is read" is the only error they can give
    for name, change in (("few_layers", {"num_hidden_layers": 1, "num_nextn_predict_layers": 0}),
                         ("odd_heads", {"num_attention_heads": 3}),
                         ("odd_experts", {"n_routed_experts": 5, "n_group": 1, "topk_group": 1})):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(tiny_config(**{**CFG, **change})))
    src.save_pretrained(tmp / "missing_shard", max_shard_bytes=300_000)
    shards = sorted((tmp / "missing_shard").glob("model-*.safetensors"))
    shards[-1].unlink()
    refs, by_setting = {}, {}
    for name, ov, _, _, kw in LAYOUTS_2 + LAYOUTS_4:
        if kw.get("pp_stage_starts_full"):
            ov = FREQ2  # the fallback turns FFSSSF into FFSFSF, which is freq 2's plan: compare with that model
        weights = kw.get("weights", "auto")
        key = (repr(ov), weights)
        if key not in by_setting:
            path = tmp / ("fp8" if weights == "fp8" else "ckpt")
            single = DeepseekV32ForCausalLM.from_pretrained(path, hf_overrides=ov, **LOAD, weights=weights)
            by_setting[key] = {**_outputs(single), "bytes": single.resident_weight_bytes(),
                               "pattern": single.plan.pattern}
        refs[name] = by_setting[key]
    return tmp, refs


def _check_layout(name, outs, ref, tp, pp):
    res = [o[name] for o in outs]
    for r, o in enumerate(res):
        # the same logits and top-k rows on every rank, bit for bit
        assert torch.equal(o["logits"], res[0]["logits"]), (name, r)
        assert torch.equal(o["rows"], res[0]["rows"]), (name, r)
        assert rel(o["logits"], ref["logits"]) < 1e-5, (name, r, rel(o["logits"], ref["logits"]))
        assert torch.equal(o["rows"], ref["rows"]), (name, r)
        assert o["plain"] == ref["plain"], (name, r)
        assert o["mtp"] == ref["mtp"], (name, r)
        assert rel(o["paged_logits"], ref["paged_logits"]) < 1e-5, (name, r)
        assert torch.equal(o["paged_rows"], ref["paged_rows"]), (name, r)
        # its share of the parameters
        assert o["bytes"] < ref["bytes"] * (0.8 if tp * pp == 2 else 0.5), (name, r, o["bytes"], ref["bytes"])
    return res


def test_world_2_tp_ep_pp(setup):
    tmp, refs = setup
    outs = _spawn(tmp, 2, LAYOUTS_2, errors_too=True)
    for name, ov, tp, pp, kw in LAYOUTS_2:
        res = _check_layout(name, outs, refs[name], tp, pp)
        if tp == 2:
            # heads split: q_b_proj holds 1 of 2 heads; experts split 4 + 4 under their global ids
            assert all(rows[0] == (16 + 64) for rows in res[0]["q_b_rows"]), res[0]["q_b_rows"]
            experts = [{n.split(".experts.")[1].split(".")[0] for n in o["params"] if ".mlp.experts." in n}
                       for o in res]
            assert experts == [{"0", "1", "2", "3"}, {"4", "5", "6", "7"}]
            assert res[0]["comm"]["attn_all_reduce"] > 0 and res[0]["comm"]["moe_all_reduce"] > 0
        if pp == 2:
            stage0, stage1 = (set(o["params"]) for o in res)
            assert "lm_head.weight" in stage1 and "lm_head.weight" not in stage0
            assert not any(n.startswith(("model.layers.3.", "model.layers.6.")) for n in stage0)
            assert not any(n.startswith(("model.layers.2.", "model.embed_tokens")) for n in stage1)
    # the hand-off: stage 1 begins on S layer 3 and reuses layer 1's rows; the plan is unchanged
    assert refs["pp2_s_start"]["pattern"] == outs[0]["pp2_s_start"]["pattern"] == "FFSSSF"
    assert outs[0]["pp2_s_start"]["comm"]["stage_send"] > outs[0]["pp2_stage_full"]["comm"]["stage_send"]
    # the engines' fallback forces layer 3 to F: a different plan, still the single-process result of that plan
    assert outs[0]["pp2_stage_full"]["pattern"] == "FFSFSF"
    errors = outs[0]["errors"]
    shards = sorted((tmp / "ckpt").glob("model-*.safetensors"))  # the same sharding as missing_shard's
    assert "world size 2 != tp_size 2 x pp_size 2" in errors["world"]
    assert "num_hidden_layers 1 is fewer than pp_size 2" in errors["layers"]
    assert "num_attention_heads 3 is not divisible by tp_size 2" in errors["heads"]
    assert "n_routed_experts 5 is not divisible by tp_size 2" in errors["experts"]
    assert "which is missing" in errors["shard"] and shards[-1].name in errors["shard"]


def test_world_4_tp2_pp2(setup):
    tmp, refs = setup
    outs = _spawn(tmp, 4, LAYOUTS_4)
    _check_layout("tp2pp2", outs, refs["tp2pp2"], 2, 2)


def test_stage_bounds_and_fallback_pattern():
    assert stage_bounds(61, 8) == [0, 7, 14, 22, 30, 38, 46, 54, 61]  # remainder to the stages before the last
    assert stage_bounds(6, 2) == [0, 3, 6]
    with pytest.raises(ValueError, match="fewer|cannot form"):
        stage_bounds(3, 4)
    assert stage_start_full_pattern("FFSSSF", 6, 2) == "FFSFSF"


def test_single_process_needs_no_group():
    with pytest.raises(ValueError, match="initialised torch.distributed"):
        ParallelContext.create(2, 1)
    assert ParallelContext.create(None, 1).world_size == 1


def test_fp8_resident_single_process(setup):
    tmp, _ = setup
    fp8_dir = tmp / "fp8"
    file_bytes = sum(f.stat().st_size for f in fp8_dir.glob("*.safetensors"))
    auto = DeepseekV32ForCausalLM.from_pretrained(fp8_dir, **LOAD)             # "auto": FP8 stays FP8
    deq = DeepseekV32ForCausalLM.from_pretrained(fp8_dir, **LOAD, weights="bf16")
    assert isinstance(auto.model.layers[2].self_attn.q_b_proj, ShardedLinear)
    assert auto.model.layers[2].self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert auto.model.layers[2].mlp.experts[3].down_proj.weight.dtype == torch.float8_e4m3fn
    assert abs(auto.resident_weight_bytes() - file_bytes) < 0.1 * file_bytes, (auto.resident_weight_bytes(), file_bytes)
    assert deq.resident_weight_bytes() > 1.5 * auto.resident_weight_bytes()
    ids = IDS
    assert rel(auto(ids), deq(ids)) < 1e-5  # same dequantized values; only the matmul blocking differs
    # in bf16 compute: the block-row dequant path against weights dequantized once at load
    a16 = DeepseekV32ForCausalLM.from_pretrained(fp8_dir, dtype=torch.bfloat16, indexer_fp8=False, weights="fp8")
    d16 = DeepseekV32ForCausalLM.from_pretrained(fp8_dir, dtype=torch.bfloat16, indexer_fp8=False, weights="bf16")
    assert rel(a16(ids), d16(ids)) < 2e-2
    # weights="fp8" on a bf16/fp32 checkpoint quantizes at load; "bf16" keeps today's behaviour
    q = DeepseekV32ForCausalLM.from_pretrained(tmp / "ckpt", **LOAD, weights="fp8")
    assert q.model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert rel(q(ids), auto(ids)) < 1e-5
    with pytest.raises(ValueError, match="weights 'int4'"):
        DeepseekV32ForCausalLM.from_pretrained(fp8_dir, **LOAD, weights="int4")


def _config_key_bytes(c: dict, tp: int, pp: int, skip: list, fp8: bool) -> list:
    """Per-stage weight bytes counted by hand from config.json keys (an independent count of what
    the model holds: FP8 linears + 4 B per 128x128 block, bf16 norms / embedding / router / LM
    heads (a bf16 model without a checkpoint), fp32 indexer head weights and router bias; S layers without an indexer)."""
    import math

    from indexcache.parallel import stage_bounds

    h, L = c["hidden_size"], c["num_hidden_layers"]
    nh, qk, v = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kl, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    E, mi, ns = c.get("n_routed_experts", 0), c.get("moe_intermediate_size", 0), c.get("n_shared_experts", 0)
    inter, dense, vocab, mtp = c["intermediate_size"], c.get("first_k_dense_replace", 0), c["vocab_size"], \
        c.get("num_nextn_predict_layers", 0)

    def lin(o, i, q=True):
        q = q and fp8
        return o * i * (1 if q else 2) + (math.ceil(o / 128) * math.ceil(i / 128) * 4 if q else 0)

    def layer(i, indexer):
        b = lin(ql, h) + lin(nh // tp * qk, ql) + lin(kl + rope, h) + lin(nh // tp * (qk - rope + v), kl) \
            + lin(h, nh // tp * v) + 2 * (ql + kl) + 2 * 2 * h
        if indexer:
            b += lin(ih * idim, ql) + lin(idim, h) + 2 * 2 * idim + 4 * ih * h
        if E and i >= dense:
            return b + 2 * E * h + 4 * E + E // tp * 3 * lin(mi, h) + (3 * lin(mi * ns // tp, h) if ns else 0)
        return b + 3 * lin(inter // tp, h)

    bounds, vshard, out = stage_bounds(L, pp), -(-vocab // tp), []
    for s in range(pp):
        b = sum(layer(i, not skip[i]) for i in range(bounds[s], bounds[s + 1]))
        b += vshard * h * 2 if s == 0 else 0
        if s == pp - 1:
            b += vshard * h * 2 + 2 * h + mtp * (layer(L, True) + 2 * 3 * h + 2 * h * 2 * h + vshard * h * 2)
        out.append(b)
    return out


@pytest.mark.parametrize("tp,pp,fp8", [(8, 1, True), (8, 2, True), (4, 2, False)])
def test_sizing_counts_the_model_modules(tp, pp, fp8):
    """``indexcache plan --gpu-mem`` weight bytes come from the model's own modules (meta device) and
    agree with a count by hand from the config keys, for DeepSeek-V3.2 under freq 4."""
    import json
    from pathlib import Path

    from indexcache.models.sizing import weight_bytes_per_gpu

    config = json.loads((Path(__file__).resolve().parents[1] / "bench" / "configs" / "deepseek-v3.2.json").read_text())
    plan = indexcache.build_layer_plan(61, 1, use_index_cache=True, index_topk_freq=4)
    got = weight_bytes_per_gpu(config, tp, pp, list(plan.skip_topk), fp8)
    assert got == _config_key_bytes(config, tp, pp, list(plan.skip_topk), fp8)
