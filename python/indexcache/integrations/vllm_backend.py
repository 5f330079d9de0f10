"""The vLLM-side classes of the indexcache plugin (imported only by ``register()`` on vLLM's CPU).

What the plugin adds through vLLM's own extension points:

* ``IndexCacheSparseMLABackend`` (registered with ``register_backend`` as ``INDEXCACHE_SPARSE_MLA``):
  metadata builder + MLA impl. ``do_kv_cache_update`` writes the latent cache with
  ``indexcache.mla_kv_cache_insert``; ``forward_mqa`` turns the shared top-k rows (request-relative
  positions) into physical slots (``positions_to_slots``) and runs ``sparse_mla`` for every token
  of the step, prefill and decode alike (absorbed form).
* the absorbed MLA forward for that backend's layers (``sparse_forward``, with the per-head products and
  the LM head through ``rows_matmul`` at a few rows).

The indexer is in :mod:`indexcache.integrations.vllm_indexer`, the model classes in
:mod:`indexcache.integrations.vllm_models`; what has no extension point and is therefore patched in
:data:`indexcache.integrations.vllm_patches.PATCHES`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from indexcache import ops
from indexcache.formats import FP8_DS_MLA_BYTES, MLA_LATENT, MLA_ROPE
from indexcache.parallel.linear import few_rows

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


def contiguous_absorbed_weights(layer) -> None:
    """Store an MLA layer's absorbed up-projections ``W_UK_T`` ``[N, P, L]`` and ``W_UV`` ``[N, L, V]``
    contiguous. vLLM registers them as permuted views of ``kv_b_proj``'s weight (``W_UK.permute(1, 2, 0)``,
    ``W_UV.transpose(0, 1)``); torch.bmm on the CPU copies such an operand into a contiguous buffer on
    every call, which at a decode row costs more than the product itself (measured in docs/vllm.md).
    A later weight reload copies into the contiguous parameters in place (``replace_parameter``'s
    ``prefer_copy``), so they stay contiguous."""
    from vllm.model_executor.utils import replace_parameter

    for name in ("W_UK_T", "W_UV"):
        w = getattr(layer, name, None)
        if isinstance(w, torch.Tensor) and not w.is_contiguous():
            replace_parameter(layer, name, w.contiguous())


# Row counts up to which ops.rows_matmul beats what vLLM runs, measured on the Zen 4 with the weights
# coming from memory (bench/bench_vllm_products.py, docs/performance.md): the per-head products 1.1-2x
# torch.bmm at 1-2 rows, the LM head 1.3-1.9x oneDNN; level at 4 rows, 0.6-0.8x at 8.
HEAD_PRODUCT_ROWS = 2
LM_HEAD_ROWS = 2


def head_products(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out[h] = x[h] @ w[h]`` per head (x ``[N, B, K]``, w ``[N, K, M]`` contiguous, out ``[N, B, M]``; x
    and out may be transposed views of token-major rows): up to ``HEAD_PRODUCT_ROWS`` rows through
    ``ops.rows_matmul``, which streams each head's weight once (about twice torch.bmm's rate at a
    decode row with the weight coming from memory), more rows through torch.bmm as vLLM runs them.
    Both sum in fp32 and round once to out's dtype."""
    if x.shape[-2] <= HEAD_PRODUCT_ROWS and w.is_contiguous() and few_rows(x, w):
        ops.rows_matmul(x, w, False, out=out)
    else:
        torch.bmm(x, w, out=out)


def sparse_forward_applies(layer, attn_metadata, output, options: dict) -> bool:
    """Whether :func:`sparse_forward` runs ``MLAAttention.forward_impl`` for this call (``options``: its
    keyword arguments after ``output``): a layer on the plugin's backend, a real step (not the profile
    run), no fused output quantization, no decode context parallelism, no head padding. Anything else
    goes to vLLM's own forward_impl."""
    return (isinstance(getattr(layer, "impl", None), IndexCacheSparseMLAImpl) and attn_metadata is not None
            and output is not None and options.get("output_scale") is None
            and options.get("output_block_scale") is None and options.get("q_dcp_replicated") is None
            and getattr(layer.impl, "dcp_world_size", 1) <= 1 and getattr(layer, "q_pad_num_heads", None) is None
            and not getattr(layer, "use_pcp", False))


def sparse_forward(layer, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: IndexCacheSparseMLAMetadata,
                   output: torch.Tensor) -> torch.Tensor:
    """vLLM's ``MLAAttention.forward_impl`` for the plugin's backend, where every token takes the absorbed
    sparse path (the metadata counts all as decode tokens): ``q_nope`` through ``W_UK_T`` into the query
    beside ``q_pe``, ``forward_mqa``, the latent output through ``W_UV`` into ``output``'s first rows. The
    same products and order as vLLM's method takes for these layers, without its branches for other
    backends, and with :func:`head_products` for the two per-head products."""
    n = attn_metadata.num_actual_tokens
    heads, nope, latent = layer.num_heads, layer.qk_nope_head_dim, layer.kv_lora_rank
    q = q[:n].reshape(n, heads, -1)
    mqa_q = q.new_empty(n, heads, latent + q.shape[-1] - nope)
    head_products(q[..., :nope].transpose(0, 1), layer.W_UK_T, mqa_q[..., :latent].transpose(0, 1))
    mqa_q[..., latent:].copy_(q[..., nope:])
    attn_out, _ = layer.impl.forward_mqa(mqa_q, kv_cache, attn_metadata, layer)
    head_products(attn_out.view(n, heads, latent).transpose(0, 1), layer.W_UV,
                  output[:n].view(n, heads, layer.v_head_dim).transpose(0, 1))
    return output


def few_rows_lm_head(lm_head) -> None:
    """Up to ``LM_HEAD_ROWS`` rows (a decode step of one or two requests) through the LM head by
    ``ops.rows_matmul``, other row counts by the linear vLLM chose (oneDNN on the CPU): the weight is
    streamed at 1.3-1.9x oneDNN's rate there (docs/vllm.md). vLLM keeps the LM head's weight beside its oneDNN
    handle, so nothing is copied. Logits run eagerly (outside the compiled model), so the row count
    may decide per call. Idempotent."""
    linear = getattr(lm_head, "cpu_linear", None)
    if linear is None or getattr(linear, "ic_few_rows", False):
        return

    def cpu_linear(x, weight, bias):
        if (bias is None and x.dim() == 2 and x.shape[0] <= LM_HEAD_ROWS and weight.dim() == 2
                and weight.is_contiguous() and few_rows(x, weight)):
            return ops.rows_matmul(x, weight, True)
        return linear(x, weight, bias)

    cpu_linear.ic_few_rows = True
    lm_head.cpu_linear = cpu_linear


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
