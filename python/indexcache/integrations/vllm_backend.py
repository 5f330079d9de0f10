"""The vLLM-side classes of the indexcache plugin (imported only by ``register()`` on vLLM's CPU).

What the plugin adds through vLLM's own extension points:

* ``IndexCacheSparseMLABackend`` (registered with ``register_backend`` as ``INDEXCACHE_SPARSE_MLA``):
  metadata builder + MLA impl. ``do_kv_cache_update`` writes the latent cache with
  ``indexcache.mla_kv_cache_insert``; ``forward_mqa`` turns the shared top-k rows (request-relative
  positions) into physical slots (``positions_to_slots``) and runs ``sparse_mla`` for every token
  of the step, prefill and decode alike (absorbed form).
* ``IndexCacheIndexerBackend``: the index-K cache's metadata (slot mapping, block table, per-request
  query and sequence lengths), built without vLLM's CUDA/Triton indexer builder.

The model classes are in :mod:`indexcache.integrations.vllm_models`; what has no extension point and
is therefore patched (this module's indexer forward among it) in
:data:`indexcache.integrations.vllm_patches.PATCHES`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from indexcache import ops
from indexcache.formats import FP8_DS_MLA_BYTES, INDEX_K_BYTES, MLA_LATENT, MLA_ROPE
from indexcache.models import step_reuse
from indexcache.models.blocks.indexer import fp8_query_inputs, paged_fp8_topk
from indexcache.parallel.linear import few_rows

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

from . import vllm_step_reuse

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
    shared buffer. Under ``index_reuse_steps`` > 1 (``vllm_step_reuse``) only the rows that recompute
    project queries and score keys; every row's key enters the cache."""
    buf = self.topk_indices_buffer
    meta = _indexer_metadata(self)
    if meta is None:  # profiling / dummy run: nothing to index
        return buf
    plan = vllm_step_reuse.plan_layer(self, meta, positions, buf)
    kw, _ = self.wk_weights_proj(hidden_states)
    k = self.k_norm(kw[:, : self.head_dim])
    r = self.rope_dim
    k_rot = k[..., :r].unsqueeze(1).contiguous()
    every = plan is None or plan.rows is None
    q = weights = None
    if every or plan.meta is not None:  # some rows compute (vLLM's rotary modules take q and k together)
        sub = slice(None) if every else plan.rows
        q, _ = self.wq_b(qr[sub])
        q = q.view(-1, self.n_head, self.head_dim)
        q_pe, k_pe = rotary_emb(positions[sub], q[..., :r].contiguous(), k_rot[sub])
        q = torch.cat([q_pe.reshape(-1, self.n_head, r), q[..., r:]], dim=-1)
        weights = kw[sub, self.head_dim:]
    if not every:  # every row's key enters the cache, the reusing rows' too
        _, k_pe = rotary_emb(positions, k_rot.clone(), k_rot)
    k = torch.cat([k_pe.reshape(-1, r), k[..., r:]], dim=-1)
    return indexer_topk(self, meta, q, k, weights, plan)


# The indexer as one opaque op. vLLM's CPU platform compiles a model (torch.compile, traced once:
# CompilationMode.DYNAMO_TRACE_ONCE) unless told otherwise; a trace through indexer_forward would freeze
# what it read from the step's metadata at trace time (the profile run's "no metadata: nothing to index"
# among it) into every later step. As an op it runs eagerly inside the compiled graph, as vLLM's own
# indexer op (vllm::sparse_attn_indexer) does; the op finds its Indexer through the index-K cache layer
# that vLLM registers under ``layer_name`` in the forward context (``bind_indexer_op``).


def _indexer_op(hidden_states, qr, positions, topk_indices_buffer, layer_name):
    cache_layer = get_forward_context().no_compile_layers.get(layer_name)
    bound = getattr(cache_layer, "ic_indexer_op", None)
    indexer, rotary_emb = (bound[0](), bound[1]()) if bound is not None else (None, None)
    if indexer is None or indexer.topk_indices_buffer.data_ptr() != topk_indices_buffer.data_ptr():
        raise RuntimeError(f"indexcache: no indexer is bound to the index-K cache layer {layer_name!r}")
    indexer_forward(indexer, hidden_states, qr, positions, rotary_emb)


def _indexer_op_fake(hidden_states, qr, positions, topk_indices_buffer, layer_name):
    return None


def _define_indexer_op():
    """The op's library. A reload of this module keeps the library it made before (its namespace still
    holds it): the op lives as long as that object, and a second definition would raise."""
    if globals().get("_LIB") is not None:
        return globals()["_LIB"]
    lib = torch.library.Library("indexcache_vllm", "FRAGMENT")
    lib.define("indexer(Tensor hidden_states, Tensor qr, Tensor positions, Tensor(a!) topk_indices_buffer, "
               "str layer_name) -> ()")
    lib.impl("indexer", _indexer_op, "CPU")
    lib._register_fake("indexer", _indexer_op_fake)
    return lib


_LIB = _define_indexer_op()


def bind_indexer_op(model) -> int:
    """Let ``indexcache_vllm::indexer`` find every indexer of ``model`` (and the rotary module its MLA layer
    hands it) from its index-K cache layer's name; returns how many were bound. Weak references: the
    cache layer is the indexer's own submodule, a strong one would be a cycle in the module tree."""
    import weakref

    n = 0
    for mod in model.modules():
        indexer = getattr(mod, "indexer", None)
        if indexer is None or not hasattr(indexer, "k_cache") or not hasattr(mod, "indexer_rope_emb"):
            continue
        rope = mod.indexer_rope_emb
        indexer.k_cache.__dict__["ic_indexer_op"] = (weakref.ref(indexer),
                                                     weakref.ref(rope) if rope is not None else (lambda: None))
        n += 1
    return n


def indexer_op_forward(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary_emb):
    """vLLM's ``Indexer.forward`` as the plugin runs it: the whole indexer through the opaque op."""
    torch.ops.indexcache_vllm.indexer(hidden_states, qr, positions, self.topk_indices_buffer, self.k_cache.prefix)
    return self.topk_indices_buffer


def _indexer_metadata(self) -> Optional[IndexCacheIndexerMetadata]:
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    meta = attn_metadata.get(self.k_cache.prefix)
    if not isinstance(meta, IndexCacheIndexerMetadata):
        raise RuntimeError(f"indexcache: layer {self.k_cache.prefix} has metadata {type(meta).__name__}, "
                           "expected the plugin's indexer metadata")
    return meta


def indexer_topk(self, meta: IndexCacheIndexerMetadata, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                 plan=None) -> torch.Tensor:
    """Keys of every row into the index-K cache; the top-k rows of the step into the shared buffer (the
    rows of ``plan.rows`` scored, the others by the reuse rule; every row without a plan). ``q`` None:
    no row computes."""
    buf = self.topk_indices_buffer
    n = meta.num_actual_tokens
    if n > buf.shape[0]:
        raise ValueError(f"indexcache: {n} tokens in one step exceed the shared top-k buffer's "
                         f"{buf.shape[0]} rows (max_num_batched_tokens)")
    if self.head_dim != 128:
        raise NotImplementedError(f"indexcache: index_head_dim {self.head_dim}: the fp8 indexer takes 128")
    hadamard = _indexer_hadamard(self)
    every = plan is None or plan.rows is None
    if q is not None:  # q and weights: every row's (``every``) or those of plan.rows
        rows_q = slice(None, n) if every else slice(None)
        q_fp8, w = fp8_query_inputs(q[rows_q].float(), weights[rows_q].float(), hadamard)
    cache = self.k_cache.kv_cache
    cache = cache.reshape(cache.shape[0], -1)
    ops.index_k_cache_insert(k[:n].float().contiguous(), meta.slot_mapping[:n].to(torch.int64), cache, hadamard)
    ops.fill_topk_buffer_(buf, n)
    if every:
        paged_fp8_topk(q_fp8, w, cache, meta.block_table, meta.seq_lens, meta.q_lens_cpu, meta.seq_lens_cpu,
                       self.topk_tokens, buf)
    else:
        if plan.meta is not None:  # the requests that compute, as a batch of their own
            sub = plan.meta
            out = torch.full((plan.rows.numel(), self.topk_tokens), -1, dtype=buf.dtype, device=buf.device)
            paged_fp8_topk(q_fp8, w, cache, sub.block_table, sub.seq_lens, sub.q_lens,
                           vllm_step_reuse.host_seq_lens(sub), self.topk_tokens, out)
            buf[plan.rows] = out
        step_reuse.write_reused(plan, buf[:n])
    if plan is not None:
        step_reuse.check(plan, buf[:n])
        step_reuse.save(plan, buf[:n])
    return buf
