"""Families vLLM's CPU platform has no model for, served on this package's own model (blocks and kernels).

vLLM 0.32 ships HY-V4 and MiniMax-M3 model code under ``nvidia/`` and ``amd/`` only. For those families
the plugin registers, with vLLM's ``ModelRegistry``, a class built on :class:`NativeForCausalLM`: a
vLLM model whose layers are this package's (``indexcache.models``: ``blocks.*`` on ``indexcache.ops``)
and whose state lives where vLLM keeps it:

* **caches**: the package model's own paged-cache layout (``allocate_cache``: per layer, per tensor,
  ``[num_blocks, ...]``) is declared to vLLM tensor by tensor, each as a cache layer
  (:class:`PagedCacheLayer`) with one full-attention spec of that tensor's bytes per token. vLLM's KV
  cache manager sizes them from ``--kv-cache-memory-bytes`` / ``gpu_memory_utilization``, puts them in
  one block table (one KV cache group: every tensor is full-attention, of one block size), allocates
  them and binds them; every forward views vLLM's tensors back as the package layout;
* **batch metadata**: vLLM's scheduler output (per-request query and sequence lengths, block table,
  slot mapping, positions) becomes the package's ``BatchMeta`` (request-major rows, as vLLM orders
  them), so prefill, chunked prefill, prefix-cache hits and decode of every request of a step run in
  one ``forward_tokens``;
* **IndexCache**: the plan is the package's (``IndexCacheConfig`` over the family's indexed layers,
  from the checkpoint's config.json and the ``--hf-overrides`` of DESIGN §2, ``indexer_types``
  honoured); S layers are built without an indexer and get no index-K cache.

Weights are read by the package's loader from the checkpoint directory (its tensor names, renames,
fp8 blocks, S-layer indexer tensors passed over), not from vLLM's iterator. Tensor parallelism
(``--tensor-parallel-size``) is the package model's own (``indexcache.parallel``: heads and experts split
by rank, its all-reduces and the logits' all-gather) over vLLM's tensor-parallel process group: each of
vLLM's workers builds its rank's shard, reads its slice of the weights and declares its shard's caches.
No pipeline parallelism (refused in one line). ``index_reuse_steps`` > 1 for the families whose indexer
reuses across steps (HY-V4; ``DSAForCausalLM.reuses_across_steps``, the others refused at construction by
the package's own check), keyed by vLLM's request ids (:mod:`.vllm_step_reuse`).

A family is one small module: a subclass naming the package class (``family``), the architecture it
serves and, if its config needs it, what to read from vLLM's config (see ``vllm_hy_v4.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import ClassVar, Optional

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import KVCacheSpec, MLAAttentionSpec

from indexcache.models.state import BatchMeta

from . import vllm_step_reuse
from .vllm_indexer import IndexCacheIndexerBackend, IndexCacheIndexerMetadata

logger = logging.getLogger("indexcache.vllm")

_plans_logged: set = set()


class NativeCacheBackend(IndexCacheIndexerBackend):
    """The metadata builder of the package-model cache layers (the indexer cache's: slot mapping, block
    table, per-request query and sequence lengths); any per-token width."""

    @staticmethod
    def get_name() -> str:
        return "INDEXCACHE_NATIVE_CACHE"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []


class PagedCacheLayer(nn.Module, AttentionLayerBase):
    """One paged tensor of the package model's cache (e.g. layer 3's latent cache), as vLLM sees a cache
    layer: ``bytes_per_token`` bytes per token, in vLLM's blocks of ``block_size`` tokens."""

    def __init__(self, prefix: str, bytes_per_token: int, block_size: int):
        super().__init__()
        self.prefix, self.bytes_per_token, self.block_size = prefix, int(bytes_per_token), int(block_size)
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        # One latent-style vector per token (no separate V): the page is block_size * bytes_per_token.
        return MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=self.bytes_per_token, dtype=torch.uint8)

    def get_attn_backend(self):
        return NativeCacheBackend

    def as_package_tensor(self, one_block: tuple, block_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """vLLM's bound tensor as the package's tensor of ``num_blocks`` blocks: ``one_block`` is its shape
        for one block, and ``num_blocks`` of them are ``(num_blocks * one_block[0], *one_block[1:])``
        (block-major in the first dimension, as every package cache lays its tensors out). The package
        only needs the layer's bytes to be its own and contiguous: its slot arithmetic (block table ->
        rows) decides where in them a block's rows lie."""
        raw = self.kv_cache
        if not raw.is_contiguous():
            raise RuntimeError(f"indexcache: vLLM laid out cache {self.prefix} with strides {tuple(raw.stride())}; "
                               "the package kernels take each layer's cache contiguous (the default KV cache layout)")
        num_blocks = raw.shape[0]
        flat = raw.reshape(-1)[: num_blocks * block_bytes]
        return flat.view(dtype).view(num_blocks * one_block[0], *one_block[1:])


def cache_tensors(template) -> list:
    """(path, shape for one block, dtype) of every paged tensor of a package cache allocated with one block.
    ``path`` is (attribute, layer id) for the lists of one tensor or None per layer (``kv``, ``index_k``,
    ``k``, ``v``...) and (attribute, layer id, field) for lists of per-layer stores (DeepSeek-V4's
    ``LayerStore``: ``pool``, ``acc``, ``index_k``, ``index_acc``)."""
    out = []
    for attr, value in vars(template).items():
        if not isinstance(value, list):
            continue
        for i, t in enumerate(value):
            if isinstance(t, torch.Tensor):
                out.append(((attr, i), tuple(t.shape), t.dtype))
            elif t is not None and dataclasses.is_dataclass(t):
                out.extend(((attr, i, f.name), tuple(v.shape), v.dtype) for f in dataclasses.fields(t)
                           for v in [getattr(t, f.name)] if isinstance(v, torch.Tensor))
    return out


def tensor_parallel_context(tp_size: int):
    """The package's ``ParallelContext`` for this vLLM worker's place in vLLM's tensor-parallel group
    (its gloo device group on the CPU platform); None for one process."""
    if tp_size == 1:
        return None
    from vllm.distributed import get_tp_group

    from indexcache.parallel import ParallelContext

    group = get_tp_group()
    if group.world_size != tp_size:
        raise RuntimeError(f"indexcache: vLLM's tensor-parallel group has {group.world_size} ranks, its config "
                           f"says {tp_size}")
    return ParallelContext(tp_size=tp_size, rank=group.rank_in_group, tp_group=group.device_group)


class NativeForCausalLM(nn.Module):
    """A vLLM text-generation model running this package's model of ``family`` over vLLM's caches."""

    family: ClassVar[Optional[type]] = None  # the package class (a DSAForCausalLM subclass)
    architecture: ClassVar[str] = ""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        from .vllm_models import _checkpoint_config

        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ValueError(f"indexcache: {self.architecture} serves on vLLM's CPU platform without pipeline "
                             f"parallelism; drop --pipeline-parallel-size {pc.pipeline_parallel_size} "
                             "(--tensor-parallel-size is supported)")
        par = tensor_parallel_context(pc.tensor_parallel_size)
        config = dict(_checkpoint_config(mc))
        overrides = dict(mc.hf_overrides) if isinstance(mc.hf_overrides, dict) else {}
        # the shared top-k buffer holds one row per token of a step
        config["max_num_batched_tokens"] = int(vllm_config.scheduler_config.max_num_batched_tokens)
        family = self.family
        if family is None:  # one architecture, several model_types (a text tower or its VL checkpoint)
            from indexcache.models.registry import model_class

            family = model_class(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan is logged below, once
            try:
                self.ic = family.from_config(config, overrides, dtype=mc.dtype, init="empty", parallel=par)
            except ValueError as e:
                if par is None:
                    raise
                raise ValueError(f"indexcache: {self.architecture} with --tensor-parallel-size {par.tp_size}: {e}") \
                    from None
        self.path = str(mc.model)
        key = (self.path, self.ic.plan.pattern)
        if key not in _plans_logged:
            _plans_logged.add(key)
            logger.warning("indexcache: %s on this package's model; %s", self.architecture,
                           self.ic.plan_summary().replace("\n", "; "))
        cc = vllm_config.cache_config
        self.block_size = int(cc.block_size)
        kv_dtype = {"auto": "auto", "bfloat16": "bf16", "float32": "fp32"}.get(cc.cache_dtype, cc.cache_dtype)
        self.template = self.ic.allocate_cache(1, kv_dtype, self.block_size)  # the layout; 1 block each
        self.slots = []  # (path, shape for one block, bytes per block, dtype, cache layer)
        layers = nn.ModuleDict()
        for path, shape, dtype in cache_tensors(self.template):
            block_bytes = math.prod(shape) * dtype.itemsize
            name = "_".join(str(x) for x in (path[0], *path[2:]))
            # a page of whole tokens (vLLM's unit); the bytes past block_bytes per block are unused
            layer = PagedCacheLayer(f"{prefix}model.layers.{path[1]}.self_attn.{name}_cache",
                                    -(-block_bytes // self.block_size), self.block_size)
            layers[f"{name}_{path[1]}"] = layer
            self.slots.append((path, shape, block_bytes, dtype, layer))
        self.cache_layers = layers
        self._first = self.slots[0][4].prefix if self.slots else None

    # ------------------------------------------------------------------ vLLM's model interface

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ic.model.embed(input_ids)

    def _cache(self):
        """The package cache object over vLLM's bound tensors."""
        cache = self.template
        num_blocks = self.slots[0][4].kv_cache.shape[0]
        for path, shape, block_bytes, dtype, layer in self.slots:
            t = layer.as_package_tensor(shape, block_bytes, dtype)
            entry = getattr(cache, path[0])
            if len(path) == 2:
                entry[path[1]] = t
            else:
                setattr(entry[path[1]], path[2], t)
        cache.num_blocks = num_blocks
        self.resize_cache(cache, num_blocks)
        return cache

    def resize_cache(self, cache, num_blocks: int) -> None:
        """A family's sizes other than the tensors that follow the number of blocks (default: none)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        n_in = input_ids.shape[0]
        hidden = self.ic.args.hidden_size
        attn_metadata = get_forward_context().attn_metadata
        meta = attn_metadata.get(self._first) if isinstance(attn_metadata, dict) else None
        if meta is None:  # profiling / dummy run: no cache bound, nothing to compute
            return torch.zeros(n_in, hidden, dtype=self.ic.compute_dtype, device=input_ids.device)
        if not isinstance(meta, IndexCacheIndexerMetadata):
            raise RuntimeError(f"indexcache: cache layer {self._first} has metadata {type(meta).__name__}")
        n = meta.num_actual_tokens
        q_lens = [int(q) for q in meta.q_lens_cpu]
        seq_lens = [int(s) for s in meta.seq_lens_cpu]
        device = input_ids.device
        batch = BatchMeta(
            positions=positions[:n].to(torch.int64),
            req_of_row=torch.repeat_interleave(torch.arange(len(q_lens), dtype=torch.int32),
                                               torch.tensor(q_lens)).to(device),
            q_lens=q_lens, ctx_lens=[s - q for s, q in zip(seq_lens, q_lens)],
            seq_lens=meta.seq_lens.to(torch.int32), block_table=meta.block_table, block_size=self.block_size,
            slot_mapping=meta.slot_mapping[:n].to(torch.int64))
        h = self._forward_tokens(input_ids[:n], batch, self._cache())
        if n < n_in:  # rows vLLM padded the step with
            h = torch.cat((h, h.new_zeros(n_in - n, hidden)))
        return h

    @torch.no_grad()
    def _forward_tokens(self, input_ids: torch.Tensor, batch: BatchMeta, cache) -> torch.Tensor:
        """The package model's forward over vLLM's batch; under ``index_reuse_steps`` > 1 keyed by vLLM's
        request ids, with the step-reuse rules of ``vllm_step_reuse`` (prompt rows compute, the selections
        of finished requests dropped). A forward without the runner's requests computes every row."""
        if self.ic.index_reuse_steps <= 1:
            return self.ic.forward_tokens(input_ids, batch, cache)
        step = vllm_step_reuse.current()
        if step is not None:
            batch = dataclasses.replace(batch, rids=step.rids)
            vllm_step_reuse.prune(cache.selections, step)
        ctx = self.ic.forward_context(batch, cache)  # step reuse off (every row computes) unless begun here
        if step is not None:
            vllm_step_reuse.begin(ctx, self.ic.index_reuse_steps, self.ic.min_recall, step)
        return self.ic.hidden_states(input_ids, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.ic.compute_logits(hidden_states)

    def load_weights(self, weights) -> set:
        from indexcache import loader

        loader.load_weights(self.ic, self.path)
        self.ic.eval()
        return {name for name, _ in self.named_parameters()}
