"""MiniMax-M3 (``model_type: minimax_m3_vl_text``, transformers' ``MiniMaxM3VLForCausalLM``; and
the text tower of ``minimax_m3_vl`` checkpoints), DESIGN.md §6, on the model core of ``dsa.py``.

- Layers are ``full_attention`` (dense causal GQA) or ``minimax_m3_sparse`` (GQA over the key
  blocks a block indexer picks per KV head), ``blocks/gqa.py``; head_dim 128, per-head RMS QK-norm,
  NeoX RoPE on the first ``head_dim * partial_rotary_factor`` dims (what transformers rotates;
  ``rotary_dim`` should agree), every norm Gemma-style (``1 + weight``).
- The **indexed layers** are the sparse ones: the IndexCache plan (freq / pattern /
  ``indexer_types``) has one entry per sparse layer, in order. An S sparse layer owns no indexer
  (its tensors are never read) and attends over the per-KV-head block selection of the nearest
  earlier F sparse layer in the same forward (the shared top-k buffer, ``index_topk`` =
  KV heads x ``index_topk_blocks`` columns).
- MLPs are SwiGLU-OAI (``swiglu_alpha``, ``swiglu_limit``): dense of ``dense_intermediate_size`` or
  a sigmoid-routed MoE of ``intermediate_size`` experts plus one shared expert
  (``shared_intermediate_size``), ``blocks/moe_oai.py``.
- Checkpoints: a text checkpoint (``minimax_m3_vl_text``) uses transformers' in-memory names
  (fused ``gate_up_proj``); a VL checkpoint (``minimax_m3_vl``) holds the language model as
  ``language_model.model.*`` / ``language_model.lm_head`` in the official layout (routed experts
  ``block_sparse_moe.experts.E.w1/w3/w2``, indexer ``self_attn.index_q_proj`` ...), read from
  ``text_config``; its vision tower, projector and MTP tensors are passed over.
- Scale-out (DESIGN.md §11): tensor parallel splits the query heads and the KV heads (tp must
  divide both; the indexer and the shared selection rows are replicated, each rank attends with
  its KV heads' selections), routed experts split across ranks, dense MLPs and the shared expert
  split column/row in the VL layout (the text layout's fused ``gate_up_proj`` stays whole, added
  by the group's first rank); pipeline stages as for the other families (a stage starting on an
  S sparse layer receives the previous stage's selection rows).
- No MTP layers (transformers ignores ``mtp.*``), no differentiable torch form.
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import nn

from indexcache.config import INDEX_CACHE_KEYS
from indexcache.formats import BLOCK_SIZE
from indexcache.parallel import ParallelContext

from .args import ModelArgs
from .blocks.decoder import DecoderLayer
from .blocks.gqa import FULL, SPARSE, GQAAttention, OffsetRMSNorm
from .blocks.moe_oai import OAIMLP, OAIMoE
from .dsa import DSAForCausalLM
from .state import CacheManager, GQAPages, _kv_dtype

# the config keys of a VL config.json that describe the whole model, not its text tower
_VL_KEYS = ("text_config", "vision_config", "model_type", "architectures", "image_token_index", "video_token_index",
            "projector_hidden_size", "merged_hidden_size", "tie_word_embeddings")
# transformers' legacy sparse_attention_config spellings
_LEGACY_SPARSE = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                  "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                  "index_local_blocks": "sparse_local_block"}


class MiniMaxM3DecoderLayer(DecoderLayer):
    """Norm, GQA attention (dense or block-sparse), norm, SwiGLU-OAI MLP or MoE; ``DecoderLayer``'s forward."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool,
                 par: ParallelContext | None = None):
        nn.Module.__init__(self)  # DecoderLayer's constructor builds MLA
        self.par = par = par or ParallelContext()
        self.layer_id = layer_id
        self.input_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = GQAAttention(args, layer_id, build_indexer, par)
        self.post_attention_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = OAIMoE(args, par) if args.is_moe_layer(layer_id) else \
            OAIMLP(args.hidden_size, args.intermediate_size, args.swiglu_alpha, args.swiglu_limit, args.fused_experts,
                   par, shard=True)


class MiniMaxM3PagedCache(GQAPages):
    """Paged caches sharing one block table per request (``GQAPages``: K, V per layer, index keys per
    F sparse layer), all in the cache dtype ("auto": the model's; "bf16" or "fp32"). Layers of other
    pipeline stages hold None."""

    def __init__(self, model, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = BLOCK_SIZE):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        dtype = _kv_dtype(kv_cache_dtype, model.dtype)
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: MiniMax-M3 caches K/V as 'auto', 'bf16' or 'fp32'")
        self.device = model.topk_buffer.device
        self.block_size, self.num_blocks, self.kv_cache_dtype = block_size, num_blocks, kv_cache_dtype
        self.manager = CacheManager(num_blocks, block_size)
        self._allocate_pages(model, num_blocks, block_size, dtype)


class MiniMaxM3ForCausalLM(DSAForCausalLM):
    model_type = "minimax_m3_vl_text"
    architecture = "MiniMaxM3VLForCausalLM"
    # transformers' MiniMaxM3VLTextConfig defaults, for fields a config.json may omit
    config_defaults = {
        "rms_norm_eps": 1e-6, "max_position_embeddings": 524288, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1, "routed_scaling_factor": 2.0,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "num_nextn_predict_layers": 0, "fused_experts": True,
    }
    decoder_layer = MiniMaxM3DecoderLayer
    mla = False
    reuses_across_steps = False
    _text_defaults = {"head_dim": 128, "num_key_value_heads": 4, "index_n_heads": 4, "index_head_dim": 128,
                      "dense_intermediate_size": 12288, "shared_intermediate_size": 3072, "intermediate_size": 3072,
                      "num_local_experts": 128, "num_experts_per_tok": 4}

    def __init__(self, args: ModelArgs, plan, **kwargs):
        par = kwargs.get("parallel")
        tp = 1 if par is None else par.tp_size
        bad = [f"{what} {n} is not divisible by tp_size {tp}" for what, n in (
            ("num_key_value_heads", args.num_kv_heads), ("shared_intermediate_size", args.shared_intermediate_size))
            if n % tp]
        if bad:
            raise ValueError(f"cannot split this model over tp_size {tp}: " + "; ".join(bad))
        super().__init__(args, plan, **kwargs)
        if self.model.norm is not None:  # the final norm is 1 + weight too
            self.model.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)

    @classmethod
    def family_config(cls, config: dict) -> dict:
        return text_tower_args(config, cls._text_defaults)

    @classmethod
    def indexed_layers(cls, args: ModelArgs) -> list:
        return [i for i, t in enumerate(args.attn_layer_types) if t == SPARSE]

    def plan_summary(self) -> str:
        sparse = ", ".join(str(i) for i in self.indexed)
        return super().plan_summary() + f"\nover the sparse layers {sparse} (full_attention layers run no indexer)"

    def drops_checkpoint_tensor(self, name: str) -> bool:
        return re.search(r"(^|\.)mtp\.", name) is not None  # the MTP module: transformers does not run it either

    def allocate_cache(self, num_blocks: int, kv_cache_dtype: str = "auto",
                       block_size: int = BLOCK_SIZE) -> MiniMaxM3PagedCache:
        return MiniMaxM3PagedCache(self, num_blocks, kv_cache_dtype, block_size)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "MiniMaxM3ForCausalLM":
        """``DSAForCausalLM``'s draw; the ``1 + weight`` norms then get weights near 0 (scales near 1)."""
        super().init_random_(seed)
        for m in self.modules():
            if isinstance(m, OffsetRMSNorm):
                m.weight.sub_(1.0)
        return self


class MiniMaxM3VLTextTower(MiniMaxM3ForCausalLM):
    """The text tower of a ``minimax_m3_vl`` checkpoint (``MiniMaxM3SparseForConditionalGeneration``):
    ``text_config`` read as a text config.json, the official tensor names, the rest passed over."""
    model_type = "minimax_m3_vl"
    architecture = "MiniMaxM3SparseForConditionalGeneration"
    config_defaults = {**MiniMaxM3ForCausalLM.config_defaults, "fused_experts": False}
    checkpoint_renames = (
        (r"^model\.", "language_model.model."),
        (r"^lm_head\.", "language_model.lm_head."),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
        (r"\.mlp\.(experts|gate|shared_experts)\.", r".block_sparse_moe.\1."),
        (r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1."),
        (r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3."),
        (r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2."),
        (r"\.self_attn\.indexer\.(q_proj|k_proj|q_norm|k_norm)\.", r".self_attn.index_\1."),
    )
    _index_tensor = re.compile(r"^language_model\.model\.layers\.(\d+)\.self_attn\.index_")

    @classmethod
    def family_config(cls, config: dict) -> dict:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("a minimax_m3_vl config.json needs its text_config (the language model's settings)")
        # the outer config's own keys (hf_overrides merged there) beat text_config's
        merged = {**text, **{k: v for k, v in config.items() if k not in _VL_KEYS}, "fused_experts": False}
        return super().family_config(merged)

    @classmethod
    def index_cache_config(cls, config: dict) -> dict:
        """IndexCache settings shipped in ``text_config`` count as the file's own (the outer keys win)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        return {**{k: v for k, v in text.items() if k in INDEX_CACHE_KEYS}, **config}

    def drops_checkpoint_tensor(self, name: str) -> bool:
        if not name.startswith("language_model.") or super().drops_checkpoint_tensor(name):
            return True  # the vision tower, the projectors, the MTP module
        m = self._index_tensor.match(name)
        if m is None or int(m.group(1)) >= len(self.model.layers):
            return False
        attn = self.model.layers[int(m.group(1))].self_attn
        return attn is not None and attn.indexer is None  # an S sparse layer's indexer


def text_tower_args(config: dict, defaults: dict) -> dict:
    """A MiniMax-M3 text config.json -> the keys ``ModelArgs.from_config`` reads (the DSA-required
    ones mapped onto GQA: ``q_lora_rank`` 0, ``kv_lora_rank`` = ``v_head_dim`` = head_dim,
    ``qk_rope_head_dim`` the rotated dims; ``index_topk`` = KV heads x ``index_topk_blocks``)."""
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if config.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
    c = {**defaults, **{k: v for k, v in config.items() if v is not None}}
    for flat, legacy in _LEGACY_SPARSE.items():
        if legacy in (config.get("sparse_attention_config") or {}):
            c[flat] = config["sparse_attention_config"][legacy]
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    freq = (config.get("sparse_attention_config") or {}).get("sparse_attention_freq")
    if types is None:
        types = [SPARSE if f else FULL for f in freq] if freq is not None else [FULL] * n
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SPARSE) for t in types):
        raise ValueError(f"layer_types must list {FULL!r} / {SPARSE!r} for each of the {n} layers, got {types!r}")
    mlp = c.get("mlp_layer_types")
    if mlp is None:
        moe_freq = config.get("moe_layer_freq")
        mlp = ["sparse" if f else "dense" for f in moe_freq] if isinstance(moe_freq, list) else ["sparse"] * n
    head, kv = int(c["head_dim"]), int(c["num_key_value_heads"])
    if int(c["index_n_heads"]) != kv:
        raise ValueError(f"index_n_heads {c['index_n_heads']} must equal num_key_value_heads {kv} "
                         "(one block selection per KV head)")
    if int(c["num_attention_heads"]) % kv:
        raise ValueError(f"num_attention_heads {c['num_attention_heads']} is not a multiple of num_key_value_heads {kv}")
    if c.get("rope_parameters") is None and c.get("rope_theta") is None:
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}  # transformers' default_theta
    rotary = _rotary_dims(c, head)
    c.update(attn_layer_types=types, mlp_layer_types=mlp, num_kv_heads=kv, gqa_head_dim=head,
             q_lora_rank=0, kv_lora_rank=head, qk_nope_head_dim=head - rotary, qk_rope_head_dim=rotary,
             v_head_dim=head, index_topk=kv * int(c["index_topk_blocks"]),
             intermediate_size=c["dense_intermediate_size"], moe_intermediate_size=c["intermediate_size"],
             n_routed_experts=c["num_local_experts"], n_shared_experts=1 if c["shared_intermediate_size"] else 0,
             num_nextn_predict_layers=0)
    return c


def _rotary_dims(c: dict, head: int) -> int:
    """The rotated dims: ``head_dim * partial_rotary_factor`` as transformers computes them."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    rotary = int(head * factor)
    if c.get("rotary_dim") not in (None, rotary):
        warnings.warn(f"rotary_dim {c['rotary_dim']} disagrees with head_dim x partial_rotary_factor = {rotary}; "
                      "rotating the latter, as transformers does", UserWarning, stacklevel=4)
    if rotary < 2 or rotary % 2 or rotary > head:
        raise ValueError(f"the rotated dims ({rotary} of head_dim {head}) must be even, >= 2 and <= head_dim")
    return rotary
