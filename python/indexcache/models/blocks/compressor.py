"""DeepSeek-V4's compressors and its lightning indexer over compressed keys (DESIGN.md §6).

A compressor folds every ``rate`` tokens into one entry: each token projects to a value ``kv``
and a gate (plus a learned per-offset ``position_bias``); an entry is the gate-softmax-weighted
sum of its window's values (softmax over the window's tokens, per feature, in fp32), RMS-normed,
then rotated (interleaved RoPE on its last ``rope`` dims) at the window's **first** position.
CSA windows overlap: each token projects two series, ``Ca`` (first half: its share of the *next*
entry) and ``Cb`` (second half: its own window's); entry ``e`` is the softmax over the ``2 rate``
rows ``Ca`` of window ``e - 1`` and ``Cb`` of window ``e`` (window 0 has no predecessor). HCA
windows do not overlap. Entry ``e`` is visible to query position ``t`` once its window has closed:
``e < (t + 1) // rate``.

Per token the projections ``[kv | gate]`` are written to the layer's ``state`` at its raw slot
(``v4_cache``); a window closes when its last token arrives, in whichever forward that is, and
reads its tokens' rows back.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from indexcache import ops, reference

from ..args import INDEX_HEAD_DIM, INDEXER_CHUNK_ELEMS, ModelArgs
from ..state import BatchMeta, ForwardContext, row_chunks
from .norms import RMSNorm
from .rope import apply_rope
from .v4_cache import LayerStore, V4Batch, comp_slots, raw_slots


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the last ``2 cos.shape[-1]`` dims of ``x [N, ..., d]`` (DeepSeek-V4's layout)."""
    r = 2 * cos.shape[-1]
    return torch.cat((x[..., :-r], apply_rope(x[..., -r:], cos, sin, True)), dim=-1)


class Compressor(nn.Module):
    """``kv_proj``/``gate_proj`` ``[hidden -> m · width]`` (m = 2 when windows overlap), fp32
    ``position_bias [rate, m · width]``, ``kv_norm`` (transformers' names)."""

    def __init__(self, args: ModelArgs, width: int, rate: int, overlap: bool):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        m = 2 if overlap else 1
        self.kv_proj = nn.Linear(args.hidden_size, m * width, bias=False)
        self.gate_proj = nn.Linear(args.hidden_size, m * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, m * width))
        self.kv_norm = RMSNorm(width, args.rms_norm_eps)
        self.state_width = 2 * m * width

    def update(self, x: torch.Tensor, meta: BatchMeta, slots: torch.Tensor, v4: V4Batch, store: LayerStore,
               state: torch.Tensor, out: torch.Tensor, base: bool) -> None:
        """Write this forward's tokens' ``[kv | gate]`` (rows ``x [N, hidden]`` at raw ``slots``) into
        ``state``, then close every window whose last token is in this forward: its entry goes to
        ``out`` (the pool, ``base``, or ``index_k``) at its compressed slot."""
        state[slots] = torch.cat((self.kv_proj(x), self.gate_proj(x)), dim=-1).to(state.dtype)
        pos = meta.positions
        closing = ((pos + 1) % self.rate == 0).nonzero().view(-1)
        if closing.numel() == 0:
            return
        entries = (pos[closing] + 1) // self.rate - 1
        req = meta.req_of_row[closing]
        comp = self.entries(state, meta, entries, req)
        cos, sin = v4.compress_rope(entries * self.rate)
        comp = rope_tail(comp, cos, sin)
        out[comp_slots(meta, store, entries.view(-1, 1), req, self.rate, base).view(-1)] = comp.to(out.dtype)

    def entries(self, state: torch.Tensor, meta: BatchMeta, entries: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
        """The compressed entries ``[n, width]`` (before RoPE) of windows ``entries [n]`` of requests ``req``."""
        r, w = self.rate, self.width
        lo = -r if self.overlap else 0
        offs = torch.arange(lo, r, device=entries.device)
        pos = entries.unsqueeze(1) * r + offs  # [n, window rows]
        slots = raw_slots(meta, torch.where(pos >= 0, pos, -1), req)
        rows = state[slots.clamp(min=0)]
        m = 2 if self.overlap else 1
        kv, gate = rows[..., :m * w], rows[..., m * w:].float() + self.position_bias.float()[(offs % r)]
        if self.overlap:  # Ca of the previous window's tokens, Cb of this window's
            kv = torch.cat((kv[:, :r, :w], kv[:, r:, w:]), dim=1)
            gate = torch.cat((gate[:, :r, :w], gate[:, r:, w:]), dim=1)
        missing = (slots < 0).unsqueeze(-1)
        kv = kv.masked_fill(missing, 0.0)
        gate = gate.masked_fill(missing, -math.inf)
        return self.kv_norm((kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1))


class IndexerScorer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weights_proj = nn.Linear(args.hidden_size, args.index_n_heads, bias=False)  # kept in fp32


class V4Indexer(Compressor):
    """The CSA lightning indexer: its own overlapping compressor at ``index_head_dim``, queries
    ``q_b_proj(qr)`` (``index_n_heads`` heads, RoPE'd at the query position) and the V3.2 score
    ``Σ_h w[t, h] · d^-½ · H^-½ · ReLU(q[t, h] · k[e])`` in fp32 over the visible entries; the top
    ``index_topk`` entry ids go to the shared top-k rows (-1 padded)."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__(args, args.index_head_dim, args.csa_rate, overlap=True)
        self.layer_id, self.n_heads, self.topk = layer_id, args.index_n_heads, args.index_topk
        self.q_b_proj = nn.Linear(args.q_lora_rank, self.n_heads * self.width, bias=False)
        self.scorer = IndexerScorer(args)

    def select(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext, store: LayerStore) -> torch.Tensor:
        """Entry ids ``[N, index_topk]`` (int32, -1 padded) written into ``ctx.topk_rows``."""
        meta, v4, n = ctx.meta, ctx.v4, x.shape[0]
        cos, sin = v4.rope["compress"]
        q = rope_tail(self.q_b_proj(qr).view(n, self.n_heads, self.width), cos, sin).float()
        w = self.scorer.weights_proj(x.float()).float() * (self.n_heads * self.width) ** -0.5
        rows = ctx.topk_rows
        ops.fill_topk_buffer_(ctx.topk_buffer, n)
        visible = (meta.positions + 1) // self.rate
        for b, off in enumerate(meta.row_offsets()):
            q_len = meta.q_lens[b]
            count = (meta.ctx_lens[b] + q_len) // self.rate
            if count == 0:
                continue
            ids = torch.arange(count, device=x.device).view(1, -1)
            req = torch.full((1,), b, dtype=torch.int32, device=x.device)
            keys = store.index_k[comp_slots(meta, store, ids, req, self.rate, base=False).view(-1)]
            for r0, r1 in row_chunks(q_len, count * self.n_heads, INDEXER_CHUNK_ELEMS):
                sl = slice(off + r0, off + r1)
                ks = torch.zeros(r1 - r0, dtype=torch.int32, device=x.device)
                self._score_topk(q[sl], keys, w[sl], ks, visible[sl].int(), rows[sl])
        ctx.topk_valid = True
        return rows

    def _score_topk(self, q, k, w, ks, ke, out):
        if k.shape[-1] == INDEX_HEAD_DIM:
            ops.indexer_topk(q, k, None, w, ks, ke, self.topk, out=out)
        else:  # widths the native kernels do not take: scores by their definition, then the top-k op
            ops.topk_indices(reference.indexer_logits(q, k, None, w, ks, ke), ks, ke, self.topk, out=out)


class CSACompressor(Compressor):
    """CSA: overlapping windows at ``head_dim``; ``indexer`` None on S layers (IndexCache)."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool):
        super().__init__(args, args.head_dim, args.csa_rate, overlap=True)
        self.indexer = V4Indexer(args, layer_id) if build_indexer else None


class HCACompressor(Compressor):
    """HCA: non-overlapping windows of ``hca_rate`` tokens at ``head_dim``; no indexer (every
    visible entry is attended)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, args.head_dim, args.hca_rate, overlap=False)
        self.indexer = None


def visible_entries(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """Entry ids ``[N, max visible]`` every entry each row sees (``e < (p + 1) // rate``), -1 padded."""
    visible = (positions + 1) // rate
    width = max(int(visible.max()) if visible.numel() else 0, 1)
    ids = torch.arange(width, device=positions.device).unsqueeze(0).expand(positions.shape[0], -1)
    return torch.where(ids < visible.unsqueeze(1), ids, -1)

