"""Per-GPU memory of a plan under tensor and pipeline parallelism (``indexcache plan --tp --pp``):
resident weight bytes per stage, KV and index-K cache bytes per token, tokens that fit."""

from __future__ import annotations

import math

from indexcache.formats import FP8_DS_MLA_BYTES, INDEX_K_BYTES, MLA_KV_WIDTH, MLA_LATENT

from .groups import stage_bounds


def weight_bytes_per_gpu(config: dict, tp: int, pp: int, plan_skip: list, fp8: bool = True) -> list:
    """Resident weight bytes of each stage's ranks (the largest tensor-parallel rank of the stage):
    FP8 for the linears the official checkpoint stores in fp8 (+ 4 B per 128x128 block), bf16 for
    the rest, fp32 for the LM head, indexer head weights and router bias, as the model holds them.
    S layers hold no indexer."""
    c = config
    h, L = c["hidden_size"], c["num_hidden_layers"]
    nh, qk, v = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kl, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    E, mi, ns = c.get("n_routed_experts", 0), c.get("moe_intermediate_size", 0), c.get("n_shared_experts", 0)
    inter, dense = c["intermediate_size"], c.get("first_k_dense_replace", 0)
    vocab, mtp = c["vocab_size"], c.get("num_nextn_predict_layers", 0)
    wb = 1 if fp8 else 2

    def lin(o, i):
        return o * i * wb + (math.ceil(o / 128) * math.ceil(i / 128) * 4 if fp8 else 0)

    def layer(i, indexer):
        b = lin(ql, h) + lin(nh // tp * qk, ql) + lin(kl + rope, h) + lin(nh // tp * (qk - rope + v), kl) \
            + lin(h, nh // tp * v) + 2 * (ql + kl) + 2 * 2 * h
        if indexer:
            b += lin(ih * idim, ql) + lin(idim, h) + 2 * 2 * idim + 4 * ih * h
        moe = E and i >= dense
        if moe:
            b += 2 * E * h + 4 * E + E // tp * 3 * lin(mi, h) + (3 * lin(mi * ns // tp, h) if ns else 0)
        else:
            b += 3 * lin(inter // tp, h)
        return b

    bounds = stage_bounds(L, pp)
    vshard = -(-vocab // tp)
    out = []
    for s in range(pp):
        b = sum(layer(i, not plan_skip[i]) for i in range(bounds[s], bounds[s + 1]))
        if s == 0:
            b += vshard * h * 2
        if s == pp - 1:
            b += vshard * h * 4 + 2 * h
            b += mtp * (layer(L, True) + 2 * 3 * h + 2 * h * 2 * h + vshard * h * 4)
        out.append(b)
    return out


MLA_KV_BYTES = {"fp8_ds_mla": FP8_DS_MLA_BYTES, "bf16": 2 * MLA_KV_WIDTH}  # per token per layer (DESIGN §5)


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
