"""The indexcache plugin's lightning indexer for vLLM (imported only by ``register()`` on vLLM's CPU).

* ``IndexCacheIndexerBackend``: the index-K cache's metadata (slot mapping, block table, per-request
  query and sequence lengths), built without vLLM's CUDA/Triton indexer builder.
* ``indexer_op_forward``, which replaces vLLM's ``Indexer.forward`` (a row of
  :data:`indexcache.integrations.vllm_patches.PATCHES`): the queries, keys and head weights traced into
  vLLM's compiled graph, the index-K cache insert and the fused fp8 top-k into vLLM's shared top-k buffer
  through the opaque op ``indexcache_vllm::indexer_topk``; under step reuse the whole indexer through
  ``indexcache_vllm::indexer``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from indexcache import ops
from indexcache.formats import INDEX_K_BYTES
from indexcache.models import step_reuse
from indexcache.models.blocks.indexer import fp8_query_inputs, paged_fp8_topk

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from . import vllm_step_reuse

INDEX_ROW_BYTES = INDEX_K_BYTES  # 128 e4m3 values + one fp32 scale per key


def _env_hadamard() -> Optional[bool]:
    raw = os.environ.get("INDEXCACHE_INDEXER_HADAMARD")
    if raw is None:
        return None
    return raw.strip().lower() not in ("0", "false", "no", "off")


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
    """Replaces vLLM's ``Indexer.forward`` under step reuse (``index_reuse_steps`` > 1,
    ``vllm_step_reuse``), as one opaque op: q/k/weights as vLLM computes them, only for the rows that
    recompute, then this package's fp8 quantization, index-K cache insert and fused top-k into the
    shared buffer. Every row's key enters the cache."""
    buf = self.topk_indices_buffer
    meta = _indexer_metadata(self)
    if meta is None:  # profiling / dummy run: nothing to index
        return buf
    plan = vllm_step_reuse.plan_layer(self, meta, positions, buf)
    every = plan is None or plan.rows is None
    k, kw = _indexer_keys(self, hidden_states)
    r = self.rope_dim
    k_rot = k[..., :r].unsqueeze(1).contiguous()
    q = weights = None
    if every or plan.meta is not None:  # some rows compute (vLLM's rotary modules take q and k together)
        sub = slice(None) if every else plan.rows
        q, k_pe = _indexer_queries(self, qr[sub], positions[sub], k_rot[sub], rotary_emb)
        weights = kw[sub, self.head_dim:]
    if not every:  # every row's key enters the cache, the reusing rows' too
        _, k_pe = rotary_emb(positions, k_rot.clone(), k_rot)
    k = torch.cat([k_pe.reshape(-1, r), k[..., r:]], dim=-1)
    q_fp8 = w = None
    if q is not None:  # q and weights: every row's (``every``) or those of plan.rows
        rows_q = slice(None, meta.num_actual_tokens) if every else slice(None)
        q_fp8, w = fp8_query_inputs(q[rows_q].float(), weights[rows_q].float(), _indexer_hadamard(self))
    return cache_and_topk(self, meta, q_fp8, w, k, plan)


def _indexer_keys(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normed index key before RoPE ``[T, 128]``, the fused key + head-weight projection)."""
    kw, _ = self.wk_weights_proj(hidden_states)
    return self.k_norm(kw[:, : self.head_dim]), kw


def _indexer_queries(self, qr: torch.Tensor, positions: torch.Tensor, k_rot: torch.Tensor, rotary_emb):
    """(q ``[T, H, 128]`` with RoPE on its first ``rope_dim`` lanes, k's rotated lanes)."""
    r = self.rope_dim
    q, _ = self.wq_b(qr)
    q = q.view(-1, self.n_head, self.head_dim)
    q_pe, k_pe = rotary_emb(positions, q[..., :r].contiguous(), k_rot)
    return torch.cat([q_pe.reshape(-1, self.n_head, r), q[..., r:]], dim=-1), k_pe


def indexer_inputs(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rotary_emb):
    """Every row's fp8 queries ``[T, H, 128]``, folded head weights ``[T, H]`` and fp32 keys ``[T, 128]``:
    the indexer's metadata-free half, which vLLM's compiled graph traces (its linears, norm and RoPE
    fuse there as in vLLM's own indexer; the quantization is this package's op)."""
    k, kw = _indexer_keys(self, hidden_states)
    r = self.rope_dim
    q, k_pe = _indexer_queries(self, qr, positions, k[..., :r].unsqueeze(1).contiguous(), rotary_emb)
    k = torch.cat([k_pe.reshape(-1, r), k[..., r:]], dim=-1)
    q_fp8, w = fp8_query_inputs(q.float(), kw[:, self.head_dim:].float(), _indexer_hadamard(self))
    return q_fp8, w, k.float().contiguous()


# The indexer's metadata half as opaque ops. vLLM's CPU platform compiles a model (torch.compile, traced
# once: CompilationMode.DYNAMO_TRACE_ONCE) unless told otherwise; a trace through code that reads the step's
# metadata would freeze what it read at trace time (the profile run's "no metadata: nothing to index" among
# it) into every later step. So the queries, keys and head weights are traced (``indexer_inputs``) and the
# cache insert and top-k run as ``indexcache_vllm::indexer_topk``, eagerly inside the compiled graph, as
# vLLM's own indexer op (vllm::sparse_attn_indexer) does. Under step reuse the rows that compute are chosen
# from the metadata, so the whole indexer is one op there (``indexcache_vllm::indexer``). Either op finds
# its Indexer through the index-K cache layer that vLLM registers under ``layer_name`` in the forward
# context (``bind_indexer_op``). The attention op reads the top-k buffer through its impl, not as an argument;
# ``topk_ready`` (below, applied in vllm_patches' MLAAttention.forward wrapper) is the graph edge that orders
# it after the op that fills the buffer (docs/vllm.md, "Compiled").


def _bound(layer_name: str, topk_indices_buffer: torch.Tensor) -> tuple:
    cache_layer = get_forward_context().no_compile_layers.get(layer_name)
    bound = getattr(cache_layer, "ic_indexer_op", None)
    indexer, rotary_emb = (bound[0](), bound[1]()) if bound is not None else (None, None)
    if indexer is None or indexer.topk_indices_buffer.data_ptr() != topk_indices_buffer.data_ptr():
        raise RuntimeError(f"indexcache: no indexer is bound to the index-K cache layer {layer_name!r}")
    return indexer, rotary_emb


def _indexer_op(hidden_states, qr, positions, topk_indices_buffer, layer_name):
    indexer, rotary_emb = _bound(layer_name, topk_indices_buffer)
    indexer_forward(indexer, hidden_states, qr, positions, rotary_emb)


def _indexer_topk_op(q_fp8, weights, k, topk_indices_buffer, layer_name):
    indexer, _ = _bound(layer_name, topk_indices_buffer)
    meta = _indexer_metadata(indexer)
    if meta is not None:  # None: profiling / dummy run, nothing to index
        cache_and_topk(indexer, meta, q_fp8, weights, k)


def _no_output(*args):
    return None


def _topk_ready(x, topk_indices_buffer):
    return x.clone()


def _topk_ready_fake(x, topk_indices_buffer):
    return torch.empty_like(x)


def _define_indexer_ops():
    """The ops' library. A reload of this module keeps the library it made before (its namespace still
    holds it): the ops live as long as that object, and a second definition would raise."""
    if globals().get("_LIB") is not None:
        return globals()["_LIB"]
    lib = torch.library.Library("indexcache_vllm", "FRAGMENT")
    lib.define("indexer(Tensor hidden_states, Tensor qr, Tensor positions, Tensor(a!) topk_indices_buffer, "
               "str layer_name) -> ()")
    lib.define("indexer_topk(Tensor q_fp8, Tensor weights, Tensor k, Tensor(a!) topk_indices_buffer, "
               "str layer_name) -> ()")
    lib.impl("indexer", _indexer_op, "CPU")
    lib.impl("indexer_topk", _indexer_topk_op, "CPU")
    lib._register_fake("indexer", _no_output)
    lib._register_fake("indexer_topk", _no_output)
    lib.define("topk_ready(Tensor x, Tensor(a!) topk_indices_buffer) -> Tensor")
    lib.impl("topk_ready", _topk_ready, "CPU")
    lib._register_fake("topk_ready", _topk_ready_fake)
    return lib


_LIB = _define_indexer_ops()


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
    """vLLM's ``Indexer.forward`` as the plugin runs it: the queries, keys and weights in the caller's
    graph and the cache insert and top-k through the opaque op; the whole indexer through the other op
    under step reuse."""
    if self.head_dim != 128:
        raise NotImplementedError(f"indexcache: index_head_dim {self.head_dim}: the fp8 indexer takes 128")
    buf, name = self.topk_indices_buffer, self.k_cache.prefix
    if getattr(self, "ic_reuse", None) is not None:
        torch.ops.indexcache_vllm.indexer(hidden_states, qr, positions, buf, name)
    else:
        q_fp8, w, k = indexer_inputs(self, hidden_states, qr, positions, rotary_emb)
        torch.ops.indexcache_vllm.indexer_topk(q_fp8, w, k, buf, name)
    return buf


def _indexer_metadata(self) -> Optional[IndexCacheIndexerMetadata]:
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None
    meta = attn_metadata.get(self.k_cache.prefix)
    if not isinstance(meta, IndexCacheIndexerMetadata):
        raise RuntimeError(f"indexcache: layer {self.k_cache.prefix} has metadata {type(meta).__name__}, "
                           "expected the plugin's indexer metadata")
    return meta


def cache_and_topk(self, meta: IndexCacheIndexerMetadata, q_fp8: Optional[torch.Tensor], w: Optional[torch.Tensor],
                   k: torch.Tensor, plan=None) -> torch.Tensor:
    """Keys of every row into the index-K cache; the top-k rows of the step into the shared buffer (the
    rows of ``plan.rows`` scored, the others by the reuse rule; every row without a plan). ``q_fp8`` and
    ``w`` (``fp8_query_inputs``): at least the scored rows' (every row's, or those of plan.rows); None:
    no row computes."""
    buf = self.topk_indices_buffer
    n = meta.num_actual_tokens
    if n > buf.shape[0]:
        raise ValueError(f"indexcache: {n} tokens in one step exceed the shared top-k buffer's "
                         f"{buf.shape[0]} rows (max_num_batched_tokens)")
    hadamard = _indexer_hadamard(self)
    every = plan is None or plan.rows is None
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


def topk_ready(x: torch.Tensor, topk_indices_buffer: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that, in a compiled graph, comes after every earlier write of the shared top-k buffer
    (the op declares a write of its own, so the buffer's versions form one chain: indexer, then this, then
    the next layer's indexer) and before whatever consumes it: the ordering edge from a layer's indexer to
    its attention op, which reads the buffer through its impl (vllm_patches, ``MLAAttention.forward``)."""
    return torch.ops.indexcache_vllm.topk_ready(x, topk_indices_buffer)
