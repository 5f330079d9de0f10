"""The checkpoint configuration of a DSA model: ``ModelArgs`` and the fixed widths of the native
kernels. The family defaults live in each family's file. Nothing here imports the blocks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch

from indexcache.config import INDEX_CACHE_KEYS, parse_overrides

# The kernels' fixed widths, the cache layouts and the quantization floors (indexcache.formats),
# under the names this module has always exported.
from indexcache.formats import (BLOCK_SIZE, FP8_DS_MLA_BYTES, INDEX_HEAD_DIM, INDEX_K_EPS, INDEX_K_NORM_EPS,  # noqa: F401
                                INDEX_Q_EPS, LATENT_NORM_EPS, MLA_LATENT, MLA_ROPE)

# Per-call working-set caps (elements: rows x keys x heads for scoring, rows x topk x (576 + heads)
# for attention) so that long prefills run in row chunks of bounded memory.
INDEXER_CHUNK_ELEMS = 1 << 26
ATTN_CHUNK_ELEMS = 1 << 26


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
_DSA_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
# config.json keys the model reads or knowingly ignores (override keys outside these warn).
_OTHER_KNOWN_KEYS = {
    "model_type", "architectures", "rope_scaling", "rope_parameters", "scoring_func", "topk_method",
    "hidden_act", "quantization_config", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "attention_bias", "attention_dropout", "initializer_range", "pretraining_tp", "ep_size", "auto_map",
    "num_key_value_heads", "aux_loss_alpha", "seq_aux", "indexcache_tokenizer", "pad_token_id",
    "head_dim", "layer_types", "mlp_bias", "output_router_logits", "qk_head_dim", "num_local_experts",
    "learnable_sink_init",
    # DeepSeek-V4 keys its family file reads into the fields below (or knowingly ignores)
    "compress_rates", "partial_rotary_factor", "router_aux_loss_coef", "router_jitter_noise", "expert_dtype",
}

@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    model_type: str = "deepseek_v32"
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    mlp_layer_types: Optional[list] = None  # "dense" / "sparse" per main layer (transformers' spelling)
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # normalised YaRN parameters, or None
    indexer_rope_interleave: bool = False
    # HY-V4's departures from the DeepSeek-V3.2 block (the defaults keep V3.2 / GLM as they are):
    mla_rope_interleave: bool = True     # MLA RoPE pairs (2i, 2i+1); False: NeoX split-half (HY-V4)
    indexer_rope_tail: bool = False      # the indexer rotates its last qk_rope_head_dim dims (HY-V4), not its first
    index_k_norm_eps: float = INDEX_K_NORM_EPS  # the indexer's key LayerNorm (HY-V4: rms_norm_eps)
    attn_sinks: bool = False             # a learned fp32 logit per head joins the attention softmax (``self_attn.sinks``)
    attn_gate: bool = False              # sigmoid output gate per head and value dim (``self_attn.gate_proj``)
    hc_mult: int = 0                     # independent hyper-connections: residual streams (0: a single residual)
    hc_magnitude: float = 2.0
    hc_eps: float = 1e-6
    fused_experts: bool = False          # routed experts stored as experts.gate_up_proj [E, 2I, D] / down_proj [E, D, I]
    swiglu_limit: float = 0.0            # routed-expert SwiGLU clamp (<= 0: none)
    # MiniMax-M3 (GQA attention, block-sparse indexer, SwiGLU-OAI MoE; the family file sets them,
    # zero / None for the DSA families)
    attn_layer_types: Optional[list] = None  # per main layer: "full_attention" / "minimax_m3_sparse"
    num_kv_heads: int = 0                # GQA key/value heads (== index_n_heads: one selection per KV head)
    gqa_head_dim: int = 0                # GQA head width (128 in MiniMax-M3)
    index_block_size: int = 0            # keys per scored block
    index_topk_blocks: int = 0           # blocks kept per query and indexer head
    index_local_blocks: int = 0          # blocks ending at the query, always kept
    swiglu_alpha: float = 0.0            # SwiGLU-OAI sigmoid gain (MiniMax-M3's experts and dense MLPs)
    shared_intermediate_size: int = 0    # width of the (one) shared expert, when it differs from the routed ones
    # DeepSeek-V4 (models/deepseek_v4.py sets them from its config.json; empty for the DSA families):
    v4_layer_types: Optional[list] = None  # per main layer: "sliding_attention" / CSA / HCA
    csa_rate: int = 4                    # tokens per CSA compressed entry
    hca_rate: int = 128                  # tokens per HCA compressed entry
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: Optional[dict] = None  # YaRN of the compressed branches (cos/sin factor 1)
    sliding_window: int = 128
    head_dim: int = 512                  # the shared K=V head (RoPE on its last qk_rope_head_dim)
    o_groups: int = 1
    o_lora_rank: int = 0
    hc_sinkhorn_iters: int = 0           # > 0: manifold hyper-connections (Sinkhorn-normalised mixing)
    moe_scoring: str = "sigmoid"         # "sqrtsoftplus": DeepSeek-V4's router
    hash_moe_layers: int = 0             # the first layers route by the token id (``mlp.gate.tid2eid``)
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None
    # Runtime knobs (not architecture), settable through hf_overrides.
    max_num_batched_tokens: int = 8192   # rows of the shared top-k buffer
    indexer_hadamard: bool = True        # 128-point rotation before fp8 (DeepSeek reference, DESIGN §4; vLLM: off)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any]) -> "ModelArgs":
        """Build from a config.json dict (overrides already merged) of family ``model_type``, whose
        ``defaults`` fill the fields the file omits (the family file's ``config_defaults``). Raises ValueError."""
        c = dict(config)
        missing_dsa = [k for k in _DSA_KEYS if c.get(k) is None]
        if missing_dsa:
            raise ValueError(f"config has no DSA indexer fields ({', '.join(missing_dsa)} missing): "
                             "not a DeepSeek Sparse Attention checkpoint")
        missing = [k for k in _REQUIRED if c.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
            if c.get(key) not in (None, want):
                raise ValueError(f"{key} {c[key]!r} is not supported (DSA models use {want!r})")
        theta, scaling = _rope_from_config(c)
        names = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling", "model_type"}
        values = {k: c[k] if c.get(k) is not None else defaults[k] for k in names
                  if c.get(k) is not None or k in defaults}
        args = cls(**values, model_type=model_type, rope_theta=theta, rope_scaling=scaling)
        args.validate()
        return args

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        need(self.kv_lora_rank >= 1 and self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
             f"kv_lora_rank {self.kv_lora_rank} must be >= 1 and qk_rope_head_dim {self.qk_rope_head_dim} even and >= 2")
        need(self.index_head_dim >= self.qk_rope_head_dim,
             f"index_head_dim {self.index_head_dim} must be >= qk_rope_head_dim {self.qk_rope_head_dim} "
             "(the indexer rotates qk_rope_head_dim of its dims)")
        need(self.hc_mult >= 0, f"hc_mult {self.hc_mult} must be >= 0")
        need(not (self.hc_mult and self.num_nextn_predict_layers),
             "MTP layers with hyper-connections are not supported (set num_nextn_predict_layers to 0)")
        need(self.index_topk >= 1 and self.index_n_heads >= 1, "index_topk and index_n_heads must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        if self.mlp_layer_types is not None:
            need(isinstance(self.mlp_layer_types, list) and len(self.mlp_layer_types) == self.num_hidden_layers
                 and all(t in ("dense", "sparse") for t in self.mlp_layer_types),
                 f"mlp_layer_types must list 'dense'/'sparse' for each of the {self.num_hidden_layers} layers, "
                 f"got {self.mlp_layer_types!r}")
            need(self.n_routed_experts or "sparse" not in self.mlp_layer_types,
                 "mlp_layer_types names 'sparse' layers but n_routed_experts is 0")
        if self.n_routed_experts:
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0 with routed experts")
            need(self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
            need(1 <= self.topk_group <= self.n_group, f"topk_group {self.topk_group} must be in [1, n_group]")
            per_group = self.n_routed_experts // self.n_group
            need(1 <= self.num_experts_per_tok <= per_group * self.topk_group,
                 f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of {self.topk_group} groups")

    @property
    def native_mla(self) -> bool:
        """The latent widths of every production DSA model (512 + 64), which the native MLA kernels take."""
        return self.kv_lora_rank == MLA_LATENT and self.qk_rope_head_dim == MLA_ROPE

    @property
    def native_indexer(self) -> bool:
        """index_head_dim 128: one fp8 scale group per key, the width the native indexer kernels take."""
        return self.index_head_dim == INDEX_HEAD_DIM

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.mlp_layer_types is not None and layer_id < self.num_hidden_layers:
            return self.mlp_layer_types[layer_id] == "sparse"
        return bool(self.n_routed_experts) and layer_id >= self.first_k_dense_replace \
            and layer_id % self.moe_layer_freq == 0


def _rope_from_config(c: Mapping[str, Any]) -> tuple[float, Optional[dict]]:
    """(theta, YaRN parameters or None) from ``rope_theta`` + ``rope_scaling`` or ``rope_parameters``."""
    params = c.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta, scaling = c.get("rope_theta", 10000.0), c.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (DSA models use 'default' or 'yarn')")
    out = {"factor": float(scaling.get("factor", 1.0)),
           "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 4096)),
           "beta_fast": float(scaling.get("beta_fast", 32)), "beta_slow": float(scaling.get("beta_slow", 1)),
           "mscale": float(scaling.get("mscale", 1.0)), "mscale_all_dim": float(scaling.get("mscale_all_dim", 0.0))}
    return float(theta), out


def split_overrides(config: Mapping[str, Any], hf_overrides) -> tuple[dict, dict]:
    """(config with model overrides merged, IndexCache-only overrides). Warns on unknown keys."""
    overrides = parse_overrides(hf_overrides)
    known = {f.name for f in fields(ModelArgs)} | _OTHER_KNOWN_KEYS | set(INDEX_CACHE_KEYS)
    unknown = sorted(k for k in overrides if k not in known and k not in config)
    if unknown:
        warnings.warn(f"--hf-overrides keys unknown to the DSA model / IndexCache (ignored): {', '.join(unknown)}",
                      UserWarning, stacklevel=3)
    ic = {k: v for k, v in overrides.items() if k in INDEX_CACHE_KEYS}
    merged = {**config, **{k: v for k, v in overrides.items() if k not in INDEX_CACHE_KEYS and k not in unknown}}
    return merged, ic



def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(table)}")
    return table[dtype]
