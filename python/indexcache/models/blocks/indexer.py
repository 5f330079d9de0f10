"""The DSA lightning indexer (DESIGN.md §4): scores every visible key of a query and keeps the
top-k positions. One ``project`` feeds both of its forms: the kernels (fp8 or fp32 scoring,
dense or paged keys, ``forward``) and the differentiable torch definition (``dense_inputs``,
``select``) that training runs. The scoring inputs (``fp8_query_inputs``, ``fp8_key_inputs``,
``fp32_query_inputs``: the eps rule, the quantization, the head weights) are defined once here,
for this model and for both engine integrations (``integrations.transformers``,
``integrations.vllm_indexer``)."""

from __future__ import annotations

import torch
from torch import nn

from indexcache import differentiable, ops, reference
from indexcache.parallel import ParallelContext
from indexcache.parallel.linear import Linear

from ..args import INDEX_HEAD_DIM, INDEX_K_EPS, INDEX_Q_EPS, INDEXER_CHUNK_ELEMS, ModelArgs
from .. import step_reuse
from ..state import ForwardContext, row_chunks
from .norms import LayerNorm
from .rope import apply_rope, rope_fuses


class Indexer(nn.Module):
    """The DSA lightning indexer: scores every visible key, writes the top-k rows (§4).

    fp8 scoring (the engines' way, DESIGN §4) needs index_head_dim 128, one scale group per key;
    other widths score in fp32 through the same top-k op (``docs/model.md``: widths).
    """

    def __init__(self, args: ModelArgs, layer_id: int, fp8: bool, par: ParallelContext | None = None):
        super().__init__()
        par = par or ParallelContext()
        self.layer_id, self.fp8, self.hadamard = layer_id, fp8 and args.native_indexer, args.indexer_hadamard
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
        self.topk, self.rope_interleave = args.index_topk, args.indexer_rope_interleave
        self.rope_tail = args.indexer_rope_tail  # HY-V4 rotates the last rope_dim dims
        # replicated on every tensor-parallel rank (DESIGN §11): identical inputs, identical top-k rows
        self.wq_b = par.linear(args.q_lora_rank, self.n_heads * self.head_dim, "wq_b")
        self.wk = par.linear(args.hidden_size, self.head_dim, "wk")
        self.k_norm = LayerNorm(self.head_dim, eps=args.index_k_norm_eps)
        self.weights_proj = Linear(args.hidden_size, self.n_heads)  # kept in fp32

    def _rope(self, t, cos, sin):
        """``t [N, (H,) D]`` with its rope dims rotated (the first ``rope_dim``, HY-V4: the last). ``t``
        is the caller's fresh projection: decode rows on the CPU rotate those dims in place."""
        r = self.rope_dim
        part = t[..., t.shape[-1] - r:] if self.rope_tail else t[..., :r]
        if rope_fuses(part, cos, sin):
            apply_rope(part, cos, sin, self.rope_interleave, out=part)
            return t
        if self.rope_tail:
            p = t.shape[-1] - r
            return torch.cat((t[..., :p], apply_rope(t[..., p:], cos, sin, self.rope_interleave)), dim=-1)
        return torch.cat((apply_rope(t[..., :r], cos, sin, self.rope_interleave), t[..., r:]), dim=-1)

    def project(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rows ``[N, hidden]`` and their query latents ``[N, q_lora_rank]`` -> (queries ``[N, H, D]``,
        keys ``[N, D]``, both rotated, in the model dtype; raw head weights fp32 ``[N, H]``)."""
        q, w = self.queries(x, qr, cos, sin)
        return q, self.keys(x, cos, sin), w

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The rotated queries ``[N, H, D]`` and raw fp32 head weights ``[N, H]`` of ``project``."""
        n = x.shape[0]
        q = self._rope(self.wq_b(qr).view(n, self.n_heads, self.head_dim), cos, sin)
        return q, self.weights_proj(x.float())

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotated keys ``[N, D]`` of ``project``."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def dense_inputs(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The torch form's inputs over ``B`` requests: x ``[B, T, hidden]``, qr ``[B, T, q_lora]``, cos/sin
        ``[B * T, rope / 2]`` -> fp32 queries ``[B, T, H, D]``, keys ``[B, T, D]`` and head weights
        ``[B, T, H]`` with the softmax constants folded in (unquantized, so the fp8 path's Hadamard
        rotation, being orthonormal, changes nothing here)."""
        b, t = x.shape[:2]
        q, k, w = self.project(x.reshape(b * t, -1), qr.reshape(b * t, -1), cos, sin)
        q, w = fp32_query_inputs(q, w, self.head_dim)
        return q.view(b, t, self.n_heads, -1), k.float().view(b, t, -1), w.view(b, t, -1)

    def select(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The torch form of ``forward``: each row's top-k positions, int64 ``[B, T, k]`` (-1: none)."""
        tp = ctx.torch_pass
        with torch.no_grad():
            q, k, w = self.dense_inputs(x.view(tp.batch, tp.seq, -1), qr.view(tp.batch, tp.seq, -1), ctx.cos, ctx.sin)
            return differentiable.dense_topk(q, k, w, self.topk, tp.chunks)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Fill rows ``[:N]`` of the shared buffer with request-relative positions; returns them.
        Under step reuse (``models/step_reuse.py``) only the rows that recompute score keys; every
        row's key enters the cache."""
        n, meta = x.shape[0], ctx.meta
        plan = step_reuse.plan_forward(ctx, self.layer_id)
        with ctx.stage(self.layer_id, "indexer"):
            k = self.keys(x, ctx.cos, ctx.sin)
            if plan is None or plan.rows is None:  # every row (no slices of all rows: 4 aten calls each)
                q, w = self.queries(x, qr, ctx.cos, ctx.sin)
            else:
                sub = plan.rows
                q, w = self.queries(x[sub], qr[sub], ctx.cos[sub], ctx.sin[sub])
            if self.fp8:
                q_in, weights = fp8_query_inputs(q, w, self.hadamard)
            else:
                q_in, weights = fp32_query_inputs(q, w, self.head_dim)
            if meta.paged:
                cache = ctx.cache.index_k[self.layer_id]
                if self.fp8:
                    ops.index_k_cache_insert(k, meta.slot_mapping, cache, self.hadamard)
                else:
                    cache.view(-1, self.head_dim)[meta.slot_mapping] = k.float()
                k_in = k_scale = None
            elif self.fp8:
                k_in, k_scale = fp8_key_inputs(k, self.hadamard)
            else:
                k_in, k_scale = k.float(), None
        with ctx.stage(self.layer_id, "topk"):
            rows = ctx.topk_rows
            ops.fill_topk_buffer_(ctx.topk_buffer, n)
            if plan is None or plan.rows is None:
                self._topk(q_in, k_in, k_scale, weights, rows, meta, ctx)
            else:
                if plan.meta is not None:
                    out = torch.full((plan.rows.numel(), self.topk), -1, dtype=rows.dtype, device=rows.device)
                    self._topk(q_in, None, None, weights, out, plan.meta, ctx)
                    rows[plan.rows] = out
                step_reuse.write_reused(plan, rows)
            if plan is not None:
                step_reuse.check(plan, rows)
                step_reuse.save(plan, rows)
        ctx.topk_valid = True
        return rows

    def _topk(self, q_in, k_in, k_scale, weights, rows, meta, ctx) -> None:
        if not meta.paged:
            self._topk_dense(q_in, k_in, k_scale, weights, rows, meta)
        elif self.fp8:
            self._topk_paged_fp8(q_in, weights, ctx.cache.index_k[self.layer_id], rows, meta, ctx)
        else:
            self._topk_paged_fp32(q_in, weights, ctx.cache.index_k[self.layer_id], rows, meta, ctx)

    def _score_topk(self, q, k, k_scale, weights, ks, ke, out):
        if k.shape[-1] == INDEX_HEAD_DIM:
            ops.indexer_topk(q, k, k_scale, weights, ks, ke, self.topk, out=out)
        else:  # widths the native kernels do not take: scores by their definition, then the top-k op
            logits = reference.indexer_logits(q, k, k_scale, weights, ks, ke)
            ops.topk_indices(logits, ks, ke, self.topk, out=out)

    def _topk_dense(self, q, k, k_scale, weights, rows, meta):
        # Each request's keys are its own tokens; prefill row t sees keys [0, t].
        seq = meta.block_size
        for off in range(0, meta.num_tokens, seq):
            for r0, r1 in row_chunks(seq, seq * self.n_heads, INDEXER_CHUNK_ELEMS):
                ks = torch.zeros(r1 - r0, dtype=torch.int32, device=q.device)
                ke = torch.arange(r0 + 1, r1 + 1, dtype=torch.int32, device=q.device)
                keys = slice(off, off + r1)
                self._score_topk(q[off + r0:off + r1], k[keys], None if k_scale is None else k_scale[keys],
                                 weights[off + r0:off + r1], ks, ke, rows[off + r0:off + r1])

    def _topk_paged_fp8(self, q, weights, cache, rows, meta, ctx):
        nq = meta.uniform_q
        if nq is not None and nq <= MAX_BATCHED_ROWS:  # decode / MTP verify: one call, no host lengths
            ops.indexer_topk_paged(q, weights, cache, meta.block_table, meta.seq_lens, nq, self.topk, out=rows)
            return
        self._need_host_lengths(ctx)
        seq_lens = [c + qn for c, qn in zip(meta.ctx_lens, meta.q_lens)]
        paged_fp8_topk(q, weights, cache, meta.block_table, meta.seq_lens, meta.q_lens, seq_lens, self.topk, rows)

    def _need_host_lengths(self, ctx):
        if ctx.sync_free:
            raise ValueError(f"layer {self.layer_id}: a sync-free forward (CUDA graph) needs the fp8 indexer and "
                             "at most 8 rows per request, all requests alike (this path reads lengths on the host)")

    def _topk_paged_fp32(self, q, weights, cache, rows, meta, ctx):
        self._need_host_lengths(ctx)
        for b, off in enumerate(meta.row_offsets()):
            c, qn = meta.ctx_lens[b], meta.q_lens[b]
            pos = torch.arange(c + qn, device=q.device, dtype=torch.int32).view(1, -1)
            req = torch.zeros(1, dtype=torch.int32, device=q.device)
            slots = ops.positions_to_slots(pos, req, meta.block_table[b:b + 1], meta.block_size).view(-1).long()
            keys = cache.view(-1, self.head_dim)[slots]
            for r0, r1 in row_chunks(qn, (c + qn) * self.n_heads, INDEXER_CHUNK_ELEMS):
                ks = torch.zeros(r1 - r0, dtype=torch.int32, device=q.device)
                ke = torch.arange(c + r0 + 1, c + r1 + 1, dtype=torch.int32, device=q.device)
                self._score_topk(q[off + r0:off + r1], keys[:c + r1], None, weights[off + r0:off + r1], ks, ke,
                                 rows[off + r0:off + r1])


MAX_BATCHED_ROWS = 8  # rows per request that the paged top-k op takes in one batched call


def paged_fp8_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, q_lens: list, seq_lens_host: list, topk: int, out: torch.Tensor) -> None:
    """The fp8 indexer's top-k over a paged index-K cache for a flattened batch of requests, into
    ``out`` ``[N, topk]`` (request-relative positions, DESIGN §3-§4); the model and the vLLM
    backend both call this. q ``[N, H, 128]`` e4m3 and weights ``[N, H]`` fp32 (``fp8_query_inputs``),
    block_table int32 ``[B, max_blocks]``, seq_lens int32 ``[B]`` on the device; q_lens and
    seq_lens_host per request on the host (a request's rows are its last q_lens tokens). A run of
    consecutive requests with the same number of rows, at most ``MAX_BATCHED_ROWS`` (decode, MTP
    verify), is one call; a longer request (a prefill or a chunk of one) goes in row chunks whose
    scores stay under ``INDEXER_CHUNK_ELEMS``, row j seeing keys ``[0, seq_len - q_len + j]``."""
    heads, row, b, nreq = q.shape[1], 0, 0, len(q_lens)
    while b < nreq:
        qn = q_lens[b]
        if qn <= MAX_BATCHED_ROWS:
            e = b
            while e < nreq and q_lens[e] == qn:
                e += 1
            rows = slice(row, row + (e - b) * qn)
            if qn:
                ops.indexer_topk_paged(q[rows], weights[rows], cache, block_table[b:e], seq_lens[b:e], qn, topk,
                                       out=out[rows])
            row, b = rows.stop, e
            continue
        ctx_len = seq_lens_host[b] - qn
        for r0, r1 in row_chunks(qn, seq_lens_host[b] * heads, INDEXER_CHUNK_ELEMS):
            # rows r0..r1 are the last r1 - r0 "decode rows" of a request holding ctx_len + r1 tokens
            lens = torch.tensor([ctx_len + r1], dtype=torch.int32, device=q.device)
            chunk = slice(row + r0, row + r1)
            ops.indexer_topk_paged(q[chunk], weights[chunk], cache, block_table[b:b + 1], lens, r1 - r0, topk,
                                   out=out[chunk])
        row, b = row + qn, b + 1


def fp8_query_inputs(q: torch.Tensor, w: torch.Tensor, hadamard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 indexer's queries (DESIGN §4): q ``[N, H, 128]`` (fp32/bf16) and raw fp32 head
    weights ``[N, H]`` -> (e4m3 queries, fp32 weights with q's scales and the softmax constants
    folded in). With the Hadamard rotation the amax floor is DeepSeek's act_quant's 1e-4 (as the
    checkpoints were trained); without it, vLLM's q quantization's 1e-10."""
    q_in, q_scale = ops.quantize_fp8(q.contiguous(), INDEX_K_EPS if hadamard else INDEX_Q_EPS, hadamard)
    return q_in, ops.indexer_weights(w, q_scale.squeeze(-1))


def fp8_key_inputs(k: torch.Tensor, hadamard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 indexer's keys: k ``[N, 128]`` -> (e4m3 ``[N, 128]``, fp32 power-of-two scales
    ``[N]``), amax floored at 1e-4; what ``ops.index_k_cache_insert`` writes into the paged cache."""
    k_in, k_scale = ops.quantize_fp8(k.contiguous(), INDEX_K_EPS, hadamard)
    return k_in, k_scale.view(-1)


def fp32_query_inputs(q: torch.Tensor, w: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unquantized indexer's queries: fp32 q, and the head weights with the softmax constants
    h^-1/2 d^-1/2 folded in, for any head width d."""
    return q.float().contiguous(), ops.indexer_weights(w) * (INDEX_HEAD_DIM / head_dim) ** 0.5
