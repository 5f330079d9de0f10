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

The carried state is an online softmax per window and series (running max, denominator and
numerator of each feature, fp32): every token folds into its own window's accumulator as it
arrives, in whichever forward; when a window's last token arrives its entry is the accumulator
(merged, on CSA, with the previous window's Ca series) divided out. Between forwards a request
keeps only its last two windows' accumulators, in a two-row ring at its first block's row
(``v4_cache``): memory per request, not per token.
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
from .v4_cache import LayerStore, V4Batch, comp_slots


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
        self.acc_width = 3 * m * width  # per window: running max, denominator, numerator of each series

    def update(self, x: torch.Tensor, meta: BatchMeta, v4: V4Batch, store: LayerStore, ring: torch.Tensor,
               out: torch.Tensor, base: bool) -> None:
        """Fold this forward's tokens (rows ``x [N, hidden]``) into their windows' accumulators, then
        close every window whose last token is in this forward: its entry goes to ``out`` (the pool,
        ``base``, or ``index_k``) at its compressed slot. ``ring`` fp32 ``[blocks, 2, acc_width]``
        carries each request's last two windows between forwards, at its first block's row."""
        r, pos, req = self.rate, meta.positions, meta.req_of_row.long()
        first = meta.block_table[:, 0].long()  # a request's first block: its row of the ring
        win = pos // r
        uniq, inv = torch.unique(req * (1 << 40) + win, return_inverse=True)  # (request, window) pairs here
        u_req, u_win = uniq >> 40, uniq & ((1 << 40) - 1)
        ctx = torch.tensor(meta.ctx_lens, device=pos.device)[u_req]
        acc = self._start(ring, first[u_req], u_win, u_win * r < ctx)
        self._fold(acc, inv, pos, self.kv_proj(x).float(), self.gate_proj(x).float())
        closing = ((pos + 1) % r == 0).nonzero().view(-1)
        if closing.numel():
            entries = win[closing]
            prev = self._previous(acc, ring, uniq, first, req[closing], entries)
            comp = self.kv_norm(self._entries(acc[inv[closing]], prev).to(x.dtype))
            cos, sin = v4.compress_rope(entries * r)
            slots = comp_slots(meta, store, entries.view(-1, 1), req[closing], r, base).view(-1)
            out[slots] = rope_tail(comp, cos, sin).to(out.dtype)
        last = (meta.seq_lens.long()[u_req] - 1) // r  # keep each request's last two windows for later forwards
        keep = u_win >= last - 1
        ring[first[u_req[keep]], u_win[keep] % 2] = acc[keep]

    def _start(self, ring, rows, wins, earlier) -> torch.Tensor:
        """Accumulators of the windows touched: a window begun in an earlier forward from the ring,
        a new one empty (max -inf)."""
        mw = self.acc_width // 3
        acc = torch.cat((torch.full((rows.numel(), mw), -math.inf, device=ring.device),
                         ring.new_zeros(rows.numel(), 2 * mw)), dim=1)
        acc[earlier] = ring[rows[earlier], wins[earlier] % 2]
        return acc

    def _fold(self, acc: torch.Tensor, inv: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor):
        """Online softmax over each window's tokens, per feature: ``(max, Σ e^(g - max), Σ e^(g - max) kv)``."""
        mw = kv.shape[1]
        gate = gate + self.position_bias.float()[pos % self.rate]
        old_max, den, num = acc.split(mw, dim=1)
        top = torch.full_like(old_max, -math.inf).scatter_reduce(0, inv.unsqueeze(1).expand_as(gate), gate, "amax")
        new_max = torch.maximum(old_max, top)
        keep = torch.where(old_max == -math.inf, 0.0, torch.exp(old_max - new_max))
        e = torch.exp(gate - new_max[inv])
        den = den * keep + torch.zeros_like(den).index_add_(0, inv, e)
        num = num * keep + torch.zeros_like(num).index_add_(0, inv, e * kv)
        acc.copy_(torch.cat((new_max, den, num), dim=1))

    def _previous(self, acc, ring, uniq, first, req, entries) -> torch.Tensor | None:
        """CSA: the accumulators of the windows before ``entries`` (their Ca series): touched in this
        forward, else the ring's (the last window before it); rows of entry 0 have max -inf."""
        if not self.overlap:
            return None
        key = req * (1 << 40) + (entries - 1).clamp(min=0)
        at = torch.searchsorted(uniq, key).clamp(max=uniq.numel() - 1)
        here = uniq[at] == key
        prev = torch.where(here.unsqueeze(1), acc[at], ring[first[req], (entries - 1).clamp(min=0) % 2])
        prev[entries == 0, :self.acc_width // 3] = -math.inf
        return prev

    def _entries(self, own: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        """fp32 entries ``[n, width]`` (before the norm): the window's own series (Cb when windows
        overlap) merged with the previous window's Ca."""
        w = self.width
        m = 2 if self.overlap else 1
        mx, den, num = (t[:, (m - 1) * w:] for t in own.split(m * w, dim=1))
        if prev is not None:
            pm, pd, pn = (t[:, :w] for t in prev.split(2 * w, dim=1))
            top = torch.maximum(mx, pm)
            a = torch.where(pm == -math.inf, 0.0, torch.exp(pm - top))
            b = torch.exp(mx - top)
            den, num = den * b + pd * a, num * b + pn * a
        return num / den


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
        self.fp8 = False  # fp32 scores (transformers'); the sync-free decode step refuses it (runtime/cuda_graph.py)
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

