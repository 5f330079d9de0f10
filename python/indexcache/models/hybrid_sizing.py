"""Per-GPU memory of the hybrid families (GLM-5.3-Flash ``glm5_next``, Qwen3.8-Flash-Next
``qwen4_exp``) under tensor and pipeline parallelism (``indexcache plan --gpu-mem``).

Everything is counted from the family's own modules, built on the meta device for the first
tensor-parallel rank of each pipeline stage with the plan: weight bytes are the parameters that
rank holds; cache bytes per token are what the family's paged cache allocates per token for the
stage's indexed layers (latent or K/V pages, plus the index cache of F layers only: an S layer
holds none); the linear-attention state (KDA, Gated DeltaNet, PLE windows) is per request and
constant in context, so it is given apart and subtracted ``num_seqs`` times before the tokens
that fit are counted."""

from __future__ import annotations

import torch

from .blocks.decoder import AbsentLayer
from .registry import model_class

HYBRID_TYPES = ("glm5_next", "glm5_next_text", "qwen4_exp", "qwen4_exp_text")
_DTYPES = {"auto": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}


def is_hybrid(config: dict) -> bool:
    return config.get("model_type") in HYBRID_TYPES


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _glm_stage(model, kv_dtype: torch.dtype) -> tuple[float, int]:
    """(cache bytes per token, linear state bytes per request) of a GLM-5.3-Flash stage, as
    ``Glm5NextPagedCache`` holds them: the latent per indexed layer, per F layer the raw ``k | gate``
    rows (fp32, 2 index_head_dim a token) and one pooled fp32 key per ``index_kpool`` tokens; per
    KDA layer fp32 conv ``[conv_dim, kernel - 1]`` and recurrent ``[heads, d_k, d_v]``."""
    from .blocks.kda import KimiDeltaAttention
    from .glm5_next import Glm5NextAttention

    d, pool = model.args.index_head_dim, model.args.index_kpool
    per_token, state = 0.0, 0
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, Glm5NextAttention):
            per_token += attn.latent * _size(kv_dtype)
            if attn.indexer is not None:
                per_token += 4 * 2 * d + 4 * d / pool
        elif isinstance(attn, KimiDeltaAttention):
            conv_dim, kernel, heads, dk, dv = attn.state_spec()
            state += 4 * (conv_dim * (kernel - 1) + heads * dk * dv)
    return per_token, state


def _qwen_stage(model, kv_dtype: torch.dtype) -> tuple[float, int]:
    """(cache bytes per token, state bytes per request) of a Qwen3.8-Flash-Next stage, as
    ``Qwen4ExpPagedCache`` holds them: K and V ``[kv_heads, head_dim]`` per indexed layer (this
    rank's heads), the raw index key ``[indexer_head_dim]`` per F layer; per Gated DeltaNet layer
    the conv window (weight dtype) and fp32 recurrent state, per PLE layer the int64 token history
    and the conv window (weight dtype)."""
    b, w = _size(kv_dtype), _size(model.dtype)
    per_token, state = 0.0, 0
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            per_token += 2 * attn.n_kv_heads * model.args.gqa_head_dim * b
            if attn.indexer is not None:
                per_token += model.args.index_head_dim * b
        if getattr(layer, "linear_attn", None) is not None:
            conv, rec = layer.linear_attn.state_shapes()
            state += w * _numel(conv) + 4 * _numel(rec)
        if getattr(layer, "ple", None) is not None:
            hist, win = layer.ple.state_shapes()
            state += 8 * _numel(hist) + w * _numel(win)
    return per_token, state


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def hybrid_budget(config: dict, pattern: str, tp: int, pp: int, gpu_bytes: float,
                  kv_cache_dtype: str = "auto", num_seqs: int = 1) -> dict:
    """Per-GPU memory of one plan (``pattern``: one F/S per indexed layer, main then MTP) for
    every pipeline stage; the tightest stage bounds the pipeline. Weights in bf16 (these families
    run no FP8 linears); activations and workspace are not counted."""
    from indexcache.parallel import ParallelContext

    if kv_cache_dtype not in _DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: {config.get('model_type')} caches its "
                         f"attention in {', '.join(_DTYPES)} (no FP8 MLA format)")
    if num_seqs < 1:
        raise ValueError(f"--num-seqs must be >= 1, got {num_seqs}")
    cls = model_class(config)
    glm = config["model_type"].startswith("glm5_next")
    stages = []
    for s in range(pp):
        par = ParallelContext(tp_size=tp, pp_size=pp, rank=s * tp)
        model = cls.from_config(config, {"use_index_cache": True, "index_topk_pattern": pattern},
                                dtype=torch.bfloat16, init="meta", parallel=par)
        kv_dtype = _DTYPES[kv_cache_dtype]
        per_token, state = (_glm_stage if glm else _qwen_stage)(model, kv_dtype)
        weights = model.resident_weight_bytes()
        free = gpu_bytes - weights - num_seqs * state
        layers = [i for i, layer in enumerate(model.model.layers) if not isinstance(layer, AbsentLayer)]
        stages.append({"stage": s, "layers": [layers[0], layers[-1] + 1] if layers else [0, 0],
                       "weight_bytes": weights, "cache_bytes_per_token": per_token,
                       "linear_state_bytes_per_request": state,
                       "tokens_fit": max(0, int(free // per_token)) if per_token else (None if free >= 0 else 0)})
    bounded = [st for st in stages if st["tokens_fit"] is not None]  # None: no per-token cache, and it fits
    if not bounded:
        raise ValueError(f"{config['model_type']}: no pipeline stage holds an indexed layer (nothing is cached per token)")
    tight = min(bounded, key=lambda st: st["tokens_fit"])
    return {"tp": tp, "pp": pp, "gpu_bytes": gpu_bytes, "kv_cache_dtype": kv_cache_dtype, "num_seqs": num_seqs,
            "pattern": pattern, "stages": stages, "tokens_fit": tight["tokens_fit"], "bounding_stage": tight["stage"]}


def hybrid_scaleout(config: dict, pattern: str, tp: int, pp: int, gpu_gb: float, kv_cache_dtype: str,
                    num_seqs: int) -> dict:
    """The plan's per-GPU memory and that of all indexed layers F."""
    run = lambda p: hybrid_budget(config, p, tp, pp, gpu_gb * 1e9, kv_cache_dtype, num_seqs)  # noqa: E731
    return {"tp": tp, "pp": pp, "plan_memory": run(pattern), "all_f_memory": run("F" * len(pattern))}


def print_hybrid_scaleout(so: dict) -> None:
    base, m = so["all_f_memory"], so["plan_memory"]
    print(f"\nPer GPU: tp {so['tp']} x pp {so['pp']}, {base['gpu_bytes'] / 1e9:g} GB, cache {base['kv_cache_dtype']}, "
          f"{base['num_seqs']} request(s) of linear-attention state; activations not counted:")
    print(f"    {'plan':<8} {'stage':>5} {'layers':>9} {'weights':>12} {'cache B/token':>14} "
          f"{'state B/request':>16} {'tokens fit':>12}")
    for name, mem in (("all F", base), ("plan", m)):
        for st in mem["stages"]:
            print(f"    {name:<8} {st['stage']:>5} {str(st['layers']):>9} {st['weight_bytes']:>12} "
                  f"{st['cache_bytes_per_token']:>14g} {st['linear_state_bytes_per_request']:>16} {str(st['tokens_fit']):>12}")
    more = m["tokens_fit"] - base["tokens_fit"]
    print(f"    plan: {m['tokens_fit']} tokens of context per GPU, {more:+d} against all F "
          f"({100 * more / max(base['tokens_fit'], 1):+.1f}%)")


def hybrid_sequence_cache(config: dict, pattern: str, context: int, kv_cache_dtype: str = "auto") -> dict:
    """One request's paged cache at ``context`` tokens under ``pattern`` (one F/S per indexed layer)
    and with every indexed layer F (``indexcache plan --config``), one process, counted as
    ``hybrid_budget`` counts it: the indexed layers' pages grow with the context (an S layer keeps
    its latent or K/V, not its index cache), the linear-attention state does not. Bytes per token
    are exact where ``context`` fills whole blocks (GLM-5.3-Flash's pooled rows: one per pool)."""
    if kv_cache_dtype not in _DTYPES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: {config.get('model_type')} caches its "
                         f"attention in {', '.join(_DTYPES)} (no FP8 MLA format)")
    cls = model_class(config)
    glm = config["model_type"].startswith("glm5_next")
    stage = _glm_stage if glm else _qwen_stage
    nested = isinstance(config.get("text_config"), dict)
    text = config["text_config"] if nested else config
    # no cache depends on the MLPs: built without routed experts (GLM-5.3-Flash's 256 per layer as
    # meta modules took 10 s a build, now about 1 s)
    cheap = {"mlp_layer_types": ["dense"] * int(text["num_hidden_layers"])} if glm else \
        {"num_experts": 1, "num_experts_per_tok": 1}
    config = {**config, **{k: v for k, v in cheap.items() if k in config or not nested}}
    if nested:
        config["text_config"] = {**text, **cheap}
    out = {}
    for name, p in (("all_f", "F" * len(pattern)), ("plan", pattern)):
        model = cls.from_config(config, {"use_index_cache": True, "index_topk_pattern": p}, dtype=torch.bfloat16,
                                init="meta")
        per_token, state = stage(model, _DTYPES[kv_cache_dtype])
        out[name] = int(round(state + context * per_token))
    removed = out["all_f"] - out["plan"]
    return {**out, "removed": removed, "removed_fraction": removed / out["all_f"] if out["all_f"] else 0.0,
            "linear_state_bytes": state, "kv_cache_dtype": kv_cache_dtype}
