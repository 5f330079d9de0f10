"""Per-GPU memory of a plan under tensor and pipeline parallelism (``indexcache plan --tp --pp``):
resident weight bytes per stage (from the model's own modules, built on the meta device for
each stage), KV and index-K cache bytes per token, tokens that fit."""

from __future__ import annotations

import torch

from indexcache.formats import INDEX_K_BYTES, MLA_LATENT
from indexcache.parallel import MLA_KV_BYTES, ParallelContext, stage_bounds

from .registry import model_class


def weight_bytes_per_gpu(config: dict, tp: int, pp: int, plan_skip: list, fp8: bool = True) -> list:
    """Resident weight bytes of each pipeline stage's first tensor-parallel rank, counted from the
    model's own modules: the family class of ``config`` built on the meta device for that rank
    with this plan (``plan_skip``: main layers then MTP, as ``LayerPlan.skip_topk``), bf16 with
    FP8 linears + their 128x128 block scales when ``fp8``, the heads (bf16), indexer head weights and
    router bias as the model holds them. S layers hold no indexer."""
    L = config["num_hidden_layers"]
    pattern = "".join("S" if s else "F" for s in plan_skip[:L])
    cls = model_class(config)
    out = []
    for stage in range(pp):
        par = ParallelContext(tp_size=tp, pp_size=pp, rank=stage * tp, fp8=fp8)
        model = cls.from_config(config, {"use_index_cache": True, "index_topk_pattern": pattern},
                                dtype=torch.bfloat16, init="meta", parallel=par)
        out.append(model.resident_weight_bytes())
    return out




def scaleout_budget(config: dict, skip_topk: list, tp: int, pp: int, gpu_bytes: float,
                    kv_cache_dtype: str = "fp8_ds_mla", fp8_weights: bool = True) -> dict:
    """Per-GPU memory of one plan: weight bytes, KV and index-K cache bytes per token of context,
    and how many tokens fit beside the weights, for every pipeline stage (the tightest one bounds
    the whole pipeline). Tensor-parallel ranks each hold the whole latent and index-K caches of
    their stage (DESIGN §11). Activations and workspace are not counted."""
    L = config["num_hidden_layers"]
    mtp = config.get("num_nextn_predict_layers", 0)
    kv_layer = MLA_KV_BYTES[kv_cache_dtype] if config.get("kv_lora_rank", MLA_LATENT) == MLA_LATENT else \
        (2 if kv_cache_dtype == "bf16" else 1) * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    bounds = stage_bounds(L, pp)
    weights = weight_bytes_per_gpu(config, tp, pp, skip_topk, fp8_weights)
    stages = []
    for s in range(pp):
        layers = list(range(bounds[s], bounds[s + 1])) + (list(range(L, L + mtp)) if s == pp - 1 else [])
        kv = kv_layer * len(layers)
        ik = INDEX_K_BYTES * sum(1 for i in layers if not skip_topk[i])
        free = gpu_bytes - weights[s]
        stages.append({"stage": s, "layers": [bounds[s], bounds[s + 1]], "weight_bytes": weights[s],
                       "kv_bytes_per_token": kv, "index_k_bytes_per_token": ik,
                       "tokens_fit": max(0, int(free // (kv + ik)))})
    tight = min(stages, key=lambda st: st["tokens_fit"])
    return {"tp": tp, "pp": pp, "gpu_bytes": gpu_bytes, "kv_cache_dtype": kv_cache_dtype, "stages": stages,
            "tokens_fit": tight["tokens_fit"], "bounding_stage": tight["stage"]}
