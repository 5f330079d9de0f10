"""DeepSeek-V4's caches: where a layer's raw window entries, compressed entries and compressor
state live, for a whole-prompt forward (``V4DenseStore``: this forward's tokens only) and for
paged serving (``V4PagedCache``), through one slot arithmetic.

One 512-wide **pool** per layer holds both kinds of attended rows, so that one sparse attention
call with ``indices`` (compressed entries) + ``extra_indices`` (the window's raw entries) reads
both:

- raw entry of request position ``p``: ``slot = block_table[req, p // bs] * bs + p % bs`` (the
  paged block table every family uses), rows ``[0, num_blocks * bs)``;
- compressed entry ``e`` of a layer of rate ``r`` (window ``[e r, (e + 1) r)``): it belongs to the
  raw block holding the window's first token, ``j = e r // bs``, which owns ``cpb = ceil(bs / r)``
  compressed rows after the raw ones: ``slot = num_blocks * bs + block_table[req, j] * cpb +
  (e r % bs) // r``. No second block table: a request's compressed rows come and go with its
  raw blocks.

The compressors' carried state (a window closes every ``r`` tokens, CSA windows overlap the
previous one) is a request's last two windows' accumulators (``acc``: an online softmax per
series, ``blocks/compressor.py``), a two-row ring at the row of the request's **first block**
(unique among live requests): per request, not per token. The CSA indexer's compressed keys
(``index_k``) use the compressed numbering (no raw rows before it); its accumulators
(``index_acc``) a ring of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from indexcache import ops

from ..args import ModelArgs
from ..state import BatchMeta, CacheBytes, CacheManager, tensor_bytes

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def layer_rate(args: ModelArgs, layer_id: int) -> int:
    """Tokens per compressed entry of a main layer (0: a sliding-window layer)."""
    kind = args.v4_layer_types[layer_id]
    return args.csa_rate if kind == CSA else args.hca_rate if kind == HCA else 0


@dataclass
class LayerStore:
    """One layer's tensors in this forward: ``pool`` ``[raw_rows + comp_rows, head_dim]``, ``acc``
    fp32 ``[blocks, 2, W]`` (None: sliding layer), ``index_k`` fp32 ``[comp_rows, index_head_dim]``
    and ``index_acc`` fp32 ``[blocks, 2, Wi]`` (None: no indexer)."""
    pool: torch.Tensor
    raw_rows: int
    cpb: int
    acc: Optional[torch.Tensor] = None
    index_k: Optional[torch.Tensor] = None
    index_acc: Optional[torch.Tensor] = None


def _layer_widths(layer) -> tuple:
    """(accumulator width, index accumulator width, index key width) of a decoder layer (0: none)."""
    comp = layer.self_attn.compressor
    if comp is None:
        return 0, 0, 0
    idx = comp.indexer
    return comp.acc_width, (idx.acc_width if idx is not None else 0), (idx.width if idx is not None else 0)


def _allocate(layer, rate: int, blocks: int, bs: int, head_dim: int, dtype, device) -> LayerStore:
    cpb = -(-bs // rate) if rate else 0
    raw = blocks * bs
    w, wi, di = _layer_widths(layer)
    comp = blocks * cpb
    ring = lambda width: torch.zeros(blocks, 2, width, device=device) if width else None  # noqa: E731
    keys = torch.zeros(comp, di, device=device) if di else None
    return LayerStore(torch.zeros(raw + comp, head_dim, dtype=dtype, device=device), raw, cpb, ring(w), keys, ring(wi))


class V4DenseStore:
    """A whole-prompt forward's stores (``BatchMeta.dense``: request b's block is b, of ``T`` tokens),
    allocated per layer as the forward reaches it and dropped with it."""

    def __init__(self, model, meta: BatchMeta):
        self.model, self.meta = model, meta

    def layer(self, layer_id: int) -> LayerStore:
        layer = self.model.model.layers[layer_id]
        return _allocate(layer, layer_rate(self.model.args, layer_id), self.meta.block_table.shape[0],
                         self.meta.block_size, self.model.args.head_dim, self.model.dtype, self.model.device)


class V4PagedCache(CacheBytes):
    """Paged caches of a DeepSeek-V4 model: one ``CacheManager`` (the raw blocks every request holds)
    and per main layer a ``LayerStore`` (module docstring). ``kv_cache_dtype``: "auto" (the model's
    dtype), "bf16" or "fp32" for the pools; the indexer's keys are fp32 (its scores are fp32)."""

    def __init__(self, model, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = 64):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        table = {"auto": model.dtype, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
                 "float32": torch.float32}
        if kv_cache_dtype not in table:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: DeepSeek-V4 caches take {', '.join(table)}")
        self.device, self.block_size, self.num_blocks = model.device, block_size, num_blocks
        self.kv_cache_dtype = kv_cache_dtype
        self.manager = CacheManager(num_blocks, block_size)
        args = model.args
        # a layer of another pipeline stage (no self_attn) keeps its caches there
        self.layers = [None if layer.self_attn is None else
                       _allocate(layer, layer_rate(args, i), num_blocks, block_size, args.head_dim, table[kv_cache_dtype],
                                 self.device) for i, layer in enumerate(model.model.layers[:args.num_hidden_layers])]

    def layer(self, layer_id: int) -> LayerStore:
        return self.layers[layer_id]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_bytes(self, layer_id: int) -> tuple[int, int]:
        """(attention pool + compressor accumulator bytes, indexer key + accumulator bytes) of one layer."""
        s = self.layers[layer_id]
        if s is None:
            return 0, 0
        return tensor_bytes(s.pool) + tensor_bytes(s.acc), tensor_bytes(s.index_k) + tensor_bytes(s.index_acc)


@dataclass
class V4Batch:
    """What DeepSeek-V4's blocks read from a ``ForwardContext`` (``ctx.v4``): the token ids (hash
    routing), cos/sin fp32 ``[N, rope / 2]`` of the "main" (sliding layers) and "compress" (CSA /
    HCA layers and their compressors) RoPE at the rows' positions, the compress inverse
    frequencies (entries are rotated at their window's first position) and the stores."""
    store: object
    rope: dict
    compress_inv_freq: torch.Tensor
    input_ids: Optional[torch.Tensor] = None
    # () -> the ids the model's embedding read last (for callers that run the layers themselves)
    embedded_ids: Optional[object] = None

    def token_ids(self, n: int) -> Optional[torch.Tensor]:
        """The ``n`` token ids of this forward's rows (hash routing): the ones ``hidden_states`` was
        given, else those the embedding read last when they are ``n`` (the pattern tools embed and
        run the layers themselves); None when neither is known."""
        if self.input_ids is not None:
            return self.input_ids
        ids = self.embedded_ids() if self.embedded_ids is not None else None
        return ids if ids is not None and ids.numel() == n else None

    def compress_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float().unsqueeze(-1) * self.compress_inv_freq
        return angles.cos(), angles.sin()


def raw_slots(meta: BatchMeta, positions: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
    """Raw slots (int64) of request positions ``[n, k]`` (-1 kept) of rows' requests ``req [n]``."""
    return ops.positions_to_slots(positions.int().contiguous(), req.int().contiguous(), meta.block_table,
                                  meta.block_size).long()


def comp_slots(meta: BatchMeta, store: LayerStore, entries: torch.Tensor, req: torch.Tensor, rate: int,
               base: bool = True) -> torch.Tensor:
    """Compressed-entry slots (int64) of entry ids ``[n, k]`` (-1 kept): in the pool (``base``: after
    its raw rows) or, without it, in ``index_k``."""
    valid = entries >= 0
    first = entries.clamp(min=0).long() * rate
    bs = meta.block_size
    block = meta.block_table.long()[req.long().unsqueeze(1), first // bs]
    slot = block * store.cpb + (first % bs) // rate + (store.raw_rows if base else 0)
    return torch.where(valid, slot, torch.full_like(slot, -1))


def row_slots(meta: BatchMeta) -> torch.Tensor:
    """The raw slot of each row of the batch (int64 ``[N]``)."""
    if meta.slot_mapping is not None:
        return meta.slot_mapping.long()
    return raw_slots(meta, meta.positions.view(-1, 1), meta.req_of_row).view(-1)
