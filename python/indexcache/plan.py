"""The layer plan (DESIGN.md §2): which layers run their indexer (F) and which reuse (S).

The rules live in C++ (``csrc/plan.cpp``) so that engines and ctest use the same code;
this module gives them the Python signature of DESIGN.md §10.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from . import _C

LayerPlan = _C.LayerPlan


def build_layer_plan(
    num_hidden_layers: int,
    num_nextn_predict_layers: int = 0,
    *,
    use_index_cache: bool = False,
    index_topk_freq: int = 1,
    index_topk_pattern: Optional[str] = None,
    index_skip_topk_offset: int = 2,
    indexer_types: Optional[Sequence[str]] = None,
) -> LayerPlan:
    """Build the F/S plan for ``num_hidden_layers`` main layers plus MTP layers.

    Raises ``ValueError`` naming the offending value for any malformed setting; warns (the
    Python ``warnings`` filter shows each message once per call site) when a pattern
    overrides ``freq > 1`` or when settings are given with ``use_index_cache`` off.
    """
    for name, value in (
        ("num_hidden_layers", num_hidden_layers),
        ("num_nextn_predict_layers", num_nextn_predict_layers),
        ("index_topk_freq", index_topk_freq),
        ("index_skip_topk_offset", index_skip_topk_offset),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not isinstance(use_index_cache, bool):
        raise ValueError(f"use_index_cache must be a bool, got {type(use_index_cache).__name__} {use_index_cache!r}")
    if index_topk_pattern is not None and not isinstance(index_topk_pattern, str):
        raise ValueError(
            f"index_topk_pattern must be a string of 'F'/'S', got {type(index_topk_pattern).__name__}"
        )
    if indexer_types is not None:
        if isinstance(indexer_types, str) or not all(isinstance(t, str) for t in indexer_types):
            raise ValueError(f"indexer_types must be a list of \"full\"/\"shared\" strings, got {indexer_types!r}")
        indexer_types = list(indexer_types)
    plan = _C._build_layer_plan(
        num_hidden_layers,
        num_nextn_predict_layers,
        use_index_cache,
        index_topk_freq,
        index_topk_pattern,
        index_skip_topk_offset,
        indexer_types,
    )
    for message in plan.warnings:
        warnings.warn(message, UserWarning, stacklevel=2)
    return plan


def build_info() -> dict:
    """How the native library was built: torch versions, CUDA kernels and archs, compilers."""
    info = dict(_C._build_info())
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_archs"] = [a for a in info["cuda_archs"].replace(";", " ").split() if a]
    return info


# DeepSeek-V3.2's indexer dimensions (DESIGN.md §4), the defaults for cost estimates.
V32_DIMS = {"hidden_size": 7168, "q_lora_rank": 1536, "index_n_heads": 64, "index_head_dim": 128}
INDEX_K_BYTES_PER_TOKEN = 128 + 4  # e4m3 key + one fp32 scale (DESIGN.md §4)


def indexer_costs(plan: LayerPlan, context: int, dims: Optional[dict] = None) -> dict:
    """What the plan removes against all-F at ``context`` tokens (main layers only).

    FLOPs count the indexer's projections (wq_b, wk, weights_proj) and its scoring
    (q·k per head, then the ReLU-weighted head sum); top-k selection is not counted.
    """
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    d = {**V32_DIMS, **(dims or {})}
    h, hd, hidden, q_lora = d["index_n_heads"], d["index_head_dim"], d["hidden_size"], d["q_lora_rank"]
    proj = 2 * q_lora * h * hd + 2 * hidden * hd + 2 * hidden * h
    per_key = 2 * h * hd + 2 * h
    decode = proj + context * per_key
    prefill = context * proj + context * (context + 1) // 2 * per_key
    cache = context * INDEX_K_BYTES_PER_TOKEN
    layers = plan.num_hidden_layers

    def entry(per_layer):
        full = per_layer * layers
        kept = per_layer * plan.num_full
        return {"all_f": full, "plan": kept, "removed": full - kept,
                "removed_fraction": (full - kept) / full if full else 0.0}

    return {
        "context": context,
        "dims": d,
        "decode_flops_per_token": entry(decode),
        "prefill_flops": entry(prefill),
        "index_k_cache_bytes_per_sequence": entry(cache),
    }
