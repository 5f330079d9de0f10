"""IndexCache across decode steps (``index_reuse_steps``, DESIGN.md §2; docs/model.md: step reuse).

An F layer's selection on a request's plain decode row (one row for the request in the forward)
is recomputed every ``index_reuse_steps`` positions and otherwise rebuilt from the last one it
computed for that request plus the positions decoded since. Prefill, chunked prefill and rows of
requests with more than one row in the forward (MTP verify) always compute. Every computed
forward saves, per request and per F layer, the request's last row and its position in the
paged cache's ``SelectionStore`` (models/state.py); the store drops a request when the cache frees it.

The reuse rule (``reused_row``): with ``m = pos - saved_pos`` new positions ``saved_pos + 1 ..
pos``, the row keeps every new position (the most recent ``k`` when ``m >= k``) and the
``k - m`` smallest positions of the saved selection; the row is ascending, then ``-1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .state import BatchMeta, ForwardContext

_NONE = torch.iinfo(torch.int32).max  # stands for -1 while rows are sorted


@dataclass
class ReusePlan:
    """One F layer's rows in one forward under step reuse. ``rows`` None: every row computes;
    else the int64 rows that compute (``meta``: their sub-batch, None if none) and ``reused``:
    (request index in the batch, its row, saved position, saved selection) for the others."""
    ctx: ForwardContext
    layer_id: int
    rows: Optional[torch.Tensor]
    meta: Optional[BatchMeta]
    reused: list


def plan_forward(ctx: ForwardContext, layer_id: int) -> Optional[ReusePlan]:
    """Which rows of F layer ``layer_id`` compute in this forward (None: step reuse is off here)."""
    steps, meta = ctx.reuse_steps, ctx.meta
    if steps <= 1 or ctx.torch_pass is not None or not meta.paged:
        return None
    if ctx.sync_free or meta.rids is None:
        raise ValueError(f"index_reuse_steps {steps} decides on the host per request: it needs an eager "
                         "forward over a BatchMeta.paged_batch (request ids known)")
    store, offs = ctx.cache.selections, meta.row_offsets()
    compute, reused = [], []
    for b, rid in enumerate(meta.rids):
        saved = store.get(rid, layer_id) if meta.q_lens[b] == 1 and ctx.decode_reuse else None
        pos = meta.ctx_lens[b]
        if saved is not None and 0 < pos - saved[0] < steps:
            reused.append((b, offs[b], saved[0], saved[1]))
        else:
            compute.append(b)
    if not reused:
        return ReusePlan(ctx, layer_id, None, meta, [])
    rows = [r for b in compute for r in range(offs[b], offs[b] + meta.q_lens[b])]
    rows_t = torch.tensor(rows, dtype=torch.long, device=meta.positions.device)
    return ReusePlan(ctx, layer_id, rows_t, sub_batch(meta, compute, rows_t) if compute else None, reused)


def sub_batch(meta: BatchMeta, reqs: list, rows: torch.Tensor) -> BatchMeta:
    """The requests ``reqs`` (indices into ``meta``) of a paged batch as a batch of their own."""
    q_lens = [meta.q_lens[b] for b in reqs]
    idx = torch.tensor(reqs, dtype=torch.long, device=meta.block_table.device)
    req = torch.repeat_interleave(torch.arange(len(reqs), dtype=torch.int32), torch.tensor(q_lens))
    return BatchMeta(meta.positions[rows], req.to(meta.req_of_row.device), q_lens, [meta.ctx_lens[b] for b in reqs],
                     meta.seq_lens[idx], meta.block_table[idx], meta.block_size, meta.slot_mapping[rows],
                     tuple(meta.rids[b] for b in reqs))


def reused_row(saved: torch.Tensor, saved_pos: int, pos: int, k: int) -> torch.Tensor:
    """The row of a decode step at ``pos`` from the selection ``saved`` computed at ``saved_pos``:
    the new positions ``saved_pos + 1 .. pos`` (the last ``k`` of them at most), then the
    smallest ``k - m`` saved positions; ascending, ``-1``-padded to ``k``."""
    lo = max(saved_pos + 1, pos + 1 - k)
    new = torch.arange(lo, pos + 1, dtype=torch.int32, device=saved.device)
    keep = k - new.numel()
    old = torch.where(saved < 0, _NONE, saved).sort().values[:keep]
    row = torch.cat((old, new)).sort().values
    return torch.where(row == _NONE, -1, row)


def write_reused(plan: ReusePlan, rows: torch.Tensor) -> None:
    """Fill the reused rows of ``rows`` (the shared buffer's rows of this forward)."""
    meta, k = plan.ctx.meta, rows.shape[1]
    for b, row, saved_pos, saved in plan.reused:
        rows[row] = reused_row(saved, saved_pos, meta.ctx_lens[b], k)


def save(plan: ReusePlan, rows: torch.Tensor) -> None:
    """Keep each computing request's last row of this forward as its layer's last selection."""
    meta, store = plan.ctx.meta, plan.ctx.cache.selections
    reused = {b for b, *_ in plan.reused}
    offs = meta.row_offsets()
    last = [(b, offs[b] + meta.q_lens[b] - 1) for b in range(len(meta.q_lens)) if b not in reused]
    if not last:
        return
    kept = rows[[r for _, r in last]].clone()
    for (b, _), row in zip(last, kept.unbind(0)):
        store.put(meta.rids[b], plan.layer_id, meta.ctx_lens[b] + meta.q_lens[b] - 1, row)
