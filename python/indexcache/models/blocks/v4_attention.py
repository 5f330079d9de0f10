"""DeepSeek-V4 attention (DESIGN.md §5, §6): shared-KV MQA over a sliding window of raw entries
plus, on CSA / HCA layers, compressed entries, with per-head sinks.

- queries: ``q_b_proj(q_a_norm(q_a_proj(x)))`` per head, RMS-normed without a weight, RoPE
  (interleaved) on the last ``qk_rope_head_dim`` dims; one K=V head ``kv_norm(kv_proj(x))``
  rotated the same way; the value is the whole rotated row, so the output's rope dims are
  rotated back by the conjugate rotation at the query position;
- the window: query ``p`` sees raw entries ``(p - sliding_window, p]``; a CSA layer adds the
  ``index_topk`` compressed entries its indexer (or, IndexCache S, the nearest earlier F CSA
  layer's indexer) picked, an HCA layer every visible compressed entry;
- the grouped low-rank output projection: heads in ``o_groups`` groups, each group's
  ``H D / g`` values projected to ``o_lora_rank`` (``o_a_proj``, block-diagonal), then
  ``o_b_proj`` mixes the ``g · o_lora_rank`` to ``hidden``.

RoPE: sliding layers use the "main" frequencies (``rope_theta``), CSA / HCA layers and their
compressors the "compress" ones (``compress_rope_theta``, YaRN when the config says so).
"""

from __future__ import annotations

import torch
from torch import nn

from indexcache import ops, reference
from indexcache.parallel import ParallelContext

from ..args import ATTN_CHUNK_ELEMS, ModelArgs
from ..state import ForwardContext, row_chunks
from .compressor import CSACompressor, HCACompressor, rope_tail, visible_entries
from .norms import RMSNorm
from .v4_cache import CSA, HCA, SLIDING, comp_slots, raw_slots, row_slots

V4_HEAD = 512  # the shared K=V head width the native attention kernel takes


def attend(q: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor, extra: torch.Tensor, scale: float,
           sinks: torch.Tensor) -> torch.Tensor:
    """Sparse attention of ``q [N, H, D]`` over pool rows ``indices`` ∪ ``extra`` (int32 slots, -1 none)
    of ``pool [rows, D]`` (K = V = the row), with sinks: ``[N, H, D]`` in q's dtype."""
    d = q.shape[-1]
    if d == V4_HEAD:
        return ops.sparse_mla(q, pool.view(-1, 1, 1, d), indices.contiguous(), scale, d, sinks=sinks,
                              extra_indices=extra.contiguous())[0]
    # widths the kernels do not take: the op's definition, one index set the union of the two
    return reference.sparse_mla(q, pool, torch.cat((indices, extra), dim=1), scale, d, sinks=sinks)[0]


class GroupedLinear(nn.Module):
    """Block-diagonal ``[g · out_g, in_g]`` weight: group i's ``in_g`` inputs -> its ``out_g`` outputs.
    Under tensor parallelism this rank's groups ``[g0, g1)`` of ``total`` (rows ``out_g`` each)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, total: int | None = None, first: int = 0):
        super().__init__()
        self.groups, self.total, self.first = groups, total or groups, first
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def param_slice(self, attr: str):
        """The loader's hook: this rank's groups' rows of the checkpoint's weight."""
        if self.total == self.groups:
            return None, None
        rows = self.weight.shape[0] // self.groups
        return 0, (self.first * rows, (self.first + self.groups) * rows)

    def param_full_shape(self, attr: str) -> tuple:
        return (self.weight.shape[0] // self.groups * self.total, self.weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, g, in_g]`` -> ``[N, g · out_g]``."""
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("ngi,goi->ngo", x, w).flatten(1)


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention block; ``compressor`` None on sliding layers. ``indexer`` (the CSA
    compressor's) is None on S CSA layers and on layers of other kinds."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, par: ParallelContext | None = None):
        super().__init__()
        self.par = par = par or ParallelContext()
        self.layer_id, self.kind = layer_id, args.v4_layer_types[layer_id]
        self.head_dim, self.window = args.head_dim, args.sliding_window
        self.eps, self.scale = args.rms_norm_eps, args.head_dim ** -0.5
        # tensor parallel: this rank's output groups [g0, g1) and so its heads (whole groups)
        self._num_heads, groups, d = args.num_attention_heads, args.o_groups, args.head_dim
        g0, g1 = par.split(groups, "o_groups") if par.tp_size > 1 else (0, groups)
        per = self._num_heads // groups
        self._head_range = (g0 * per, g1 * per)
        self.n_heads, self.groups = (g1 - g0) * per, g1 - g0
        cols = ("col", (g0 * per * d, g1 * per * d)) if par.tp_size > 1 else (None, None)
        rows = ("row", (g0 * args.o_lora_rank, g1 * args.o_lora_rank)) if par.tp_size > 1 else (None, None)
        self.q_a_proj = par.linear(args.hidden_size, args.q_lora_rank, "q_a_proj")
        self.q_a_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.q_b_proj = par.linear(args.q_lora_rank, self._num_heads * d, "q_b_proj", *cols)
        self.kv_proj = nn.Linear(args.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, args.rms_norm_eps)
        self.o_a_proj = GroupedLinear(per * d, self.groups * args.o_lora_rank, self.groups, groups, g0)
        self.o_b_proj = par.linear(groups * args.o_lora_rank, args.hidden_size, "o_b_proj", *rows)
        self.sinks = nn.Parameter(torch.empty(self.n_heads))
        if self.kind not in (SLIDING, CSA, HCA):
            raise ValueError(f"layer {layer_id}: unknown DeepSeek-V4 layer type {self.kind!r}")
        self.compressor = (CSACompressor(args, layer_id, build_indexer) if self.kind == CSA
                           else HCACompressor(args) if self.kind == HCA else None)

    def param_slice(self, attr: str):
        """The loader's hook: the sinks of this rank's heads."""
        if attr == "sinks" and self._num_heads != self.n_heads:
            return 0, self._head_range
        return None, None

    def param_full_shape(self, attr: str) -> tuple:
        return (self._num_heads,)

    @property
    def indexer(self):
        return None if self.compressor is None else self.compressor.indexer

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        meta, v4, n = ctx.meta, ctx.v4, x.shape[0]
        cos, sin = v4.rope["main" if self.kind == SLIDING else "compress"]
        with ctx.stage(self.layer_id, "attn_proj"):
            qr = self.q_a_norm(self.q_a_proj(x))
            q = self.q_b_proj(qr).view(n, self.n_heads, self.head_dim)
            q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
            q = rope_tail(q, cos, sin)
            kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)
            store = v4.store.layer(self.layer_id)
            slots = row_slots(meta)
            store.pool[slots] = kv.to(store.pool.dtype)
        entries_of, width = self._compressed(x, qr, ctx, store)
        with ctx.stage(self.layer_id, "attn"):
            out = self._attend(q, meta, store, entries_of, width)
            out = rope_tail(out, cos, -sin)
            out = self.o_b_proj(self.o_a_proj(out.reshape(n, self.groups, -1)))
            return self.par.all_reduce(out, "attn_all_reduce")  # the ranks' groups' shares

    def _attend(self, q: torch.Tensor, meta, store, entries_of, width: int) -> torch.Tensor:
        """Row chunk by row chunk (bounded index and score memory in long prefills): the chunk's
        compressed entries' pool slots and its window's raw slots, then ``attend``."""
        n, h, d = q.shape
        out = q.new_empty(n, h, d)
        offs = torch.arange(-self.window + 1, 1, device=q.device)
        sinks = self.sinks.float().contiguous()
        for r0, r1 in row_chunks(n, (width + self.window) * (d + h), ATTN_CHUNK_ELEMS):
            req = meta.req_of_row[r0:r1]
            pos = meta.positions[r0:r1].unsqueeze(1) + offs
            extra = raw_slots(meta, torch.where(pos >= 0, pos, -1), req).int()
            if width:
                idx = comp_slots(meta, store, entries_of(r0, r1), req, self.compressor.rate).int()
            else:
                idx = torch.empty(r1 - r0, 0, dtype=torch.int32, device=q.device)
            out[r0:r1] = attend(q[r0:r1], store.pool, idx, extra, self.scale, sinks)
        return out

    def _compressed(self, x, qr, ctx: ForwardContext, store) -> tuple:
        """(rows ``r0:r1`` -> the compressed entry ids they attend, int ``[r1 - r0, k]`` -1 padded; the
        widest ``k``), after this forward's windows have been compressed into the pool; width 0 on
        sliding layers."""
        meta = ctx.meta
        comp = self.compressor
        if comp is None:
            return None, 0
        with ctx.stage(self.layer_id, "compress"):
            comp.update(x, meta, ctx.v4, store, store.acc, store.pool, base=True)
            if comp.indexer is not None:  # its keys stay current even in a forward that reuses rows
                comp.indexer.update(x, meta, ctx.v4, store, store.index_acc, store.index_k, base=False)
        if self.kind == HCA:  # every visible entry, built per row chunk
            width = int(((meta.positions + 1) // comp.rate).max()) if meta.num_tokens else 0
            return (lambda r0, r1: visible_entries(meta.positions[r0:r1], comp.rate)), max(width, 1)
        if ctx.is_full(self.layer_id):
            if comp.indexer is None:
                raise RuntimeError(f"layer {self.layer_id} is F in this forward but was built without an indexer")
            with ctx.stage(self.layer_id, "indexer"):
                entries = comp.indexer.select(x, qr, ctx, store)
        else:  # IndexCache S: the entries the nearest earlier F CSA layer picked in this forward
            if not ctx.topk_valid:
                raise RuntimeError(f"layer {self.layer_id} reuses top-k rows but no F CSA layer wrote them")
            entries = ctx.topk_rows
        return (lambda r0, r1: entries[r0:r1]), entries.shape[1]
