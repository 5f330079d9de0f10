"""IndexCache across decode steps (``index_reuse_steps``, DESIGN.md §2; docs/model.md: step reuse).

An F layer's selection on a request's plain decode row (one row for the request in the forward)
is recomputed every ``index_reuse_steps`` positions and otherwise rebuilt from the last one it
computed for that request plus the positions decoded since. Prefill, chunked prefill and rows of
requests with more than one row in the forward (MTP verify) always compute. Every computed
forward saves, per request and per F layer, the request's last row and its position in the
paged cache's ``SelectionStore`` (models/state.py); the store drops a request when the cache frees it.

Adaptive reuse (``index_reuse_min_recall`` r): the probe layer, the first F layer of the plan,
computes every decode row. Where a request would reuse, its reused row is checked against the
fresh one: the recall is the share of the fresh selection's positions that the reused row also
holds. Below r, every later F layer recomputes that request in this forward and all F layers save
anew (the schedule restarts); at or above r they reuse, and the probe keeps its older saved row so
that the next check compares against the selection the other layers still reuse. The check costs
the probe layer's indexer (one F layer's scoring per step, not all of them) and one comparison of
two k-rows per request; ``SelectionStore.checked`` / ``.recomputed`` count the outcomes.

The reuse rule (``reused_row``): with ``m = pos - saved_pos`` new positions ``saved_pos + 1 ..
pos``, the row keeps every new position (the most recent ``k`` when ``m >= k``) and the
``k - m`` smallest positions of the saved selection; the row is ascending, then ``-1``.

Indexers that select units of ``unit`` consecutive positions (GLM-5.3-Flash's pools, QSA's blocks)
run the same decisions and the same rule over unit ids (``plan_forward(..., unit=)``): the rows
handed to ``write_reused`` / ``check`` / ``save`` hold unit ids, and the "new" units are those that
became complete since the saved position (``(saved_pos + 1) // unit .. (pos + 1) // unit - 1``);
the family adds what is not a complete unit (the query's own unfinished pool / block) itself.
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
    probed: list = ()  # the probe layer: (request index, its row, saved position, saved selection) to check
    unit: int = 1      # positions per selected unit (1: the rows hold positions; else pool / block ids)

    def computing(self) -> list:
        """The batch's request indices whose rows compute, in order (every request when ``rows`` is None)."""
        reused = {b for b, *_ in self.reused}
        return [b for b in range(len(self.ctx.meta.q_lens)) if b not in reused]


def check_family(cls, steps: int) -> None:
    """Refuse ``index_reuse_steps`` > 1 for a family whose indexer does not reuse across steps
    (``DSAForCausalLM.reuses_across_steps`` False) rather than print a plan its forward would ignore."""
    if steps > 1 and not cls.reuses_across_steps:
        raise ValueError(f"index_reuse_steps {steps}: {cls.__name__} ({cls.model_type}) reuses selections across "
                         "layers only; across decode steps only the lightning-indexer families (deepseek_v32, "
                         "glm_moe_dsa, hy_v4) and the hybrids (glm5_next, qwen4_exp) do: use 1")


def verdicts(ctx: ForwardContext) -> list:
    """Under adaptive reuse, per request of the forward 1 where the probe layer sent it back to
    computing: a pipeline stage hands them to the next with the residual stream, so F layers of
    later stages follow the probe as in one process (both sides know the batch; [] otherwise)."""
    if ctx.reuse_steps <= 1 or ctx.reuse_min_recall is None or ctx.meta.rids is None:
        return []
    return [int(rid in ctx.reuse_forced) for rid in ctx.meta.rids]


def take_verdicts(ctx: ForwardContext, flags: list) -> None:
    """The previous stage's ``verdicts``."""
    ctx.reuse_forced |= {rid for rid, f in zip(ctx.meta.rids or (), flags) if f}


def probe_layer(ctx: ForwardContext) -> Optional[int]:
    """The layer whose fresh rows check the others' reuse (None: adaptive reuse is off)."""
    if ctx.reuse_min_recall is None:
        return None
    return next((i for i, f in enumerate(ctx.full) if f), None)


def plan_forward(ctx: ForwardContext, layer_id: int, unit: int = 1) -> Optional[ReusePlan]:
    """Which rows of F layer ``layer_id`` compute in this forward (None: step reuse is off here).
    ``unit``: positions per selected unit of the layer's indexer (1: it selects positions)."""
    steps, meta = ctx.reuse_steps, ctx.meta
    if steps <= 1 or ctx.torch_pass is not None or not meta.paged:
        return None
    if ctx.sync_free or meta.rids is None:
        raise ValueError(f"index_reuse_steps {steps} decides on the host per request: it needs an eager "
                         "forward over a BatchMeta.paged_batch (request ids known)")
    store, offs = ctx.cache.selections, meta.row_offsets()
    probing = layer_id == probe_layer(ctx)
    compute, reused, probed = [], [], []
    for b, rid in enumerate(meta.rids):
        saved = store.get(rid, layer_id) if meta.q_lens[b] == 1 and ctx.decode_reuse else None
        pos = meta.ctx_lens[b]
        if saved is None or not 0 < pos - saved[0] < steps or rid in ctx.reuse_forced:
            compute.append(b)
        elif probing:
            probed.append((b, offs[b], saved[0], saved[1]))
            compute.append(b)
        else:
            reused.append((b, offs[b], saved[0], saved[1]))
    if not reused:
        return ReusePlan(ctx, layer_id, None, meta, [], probed, unit)
    rows = [r for b in compute for r in range(offs[b], offs[b] + meta.q_lens[b])]
    rows_t = torch.tensor(rows, dtype=torch.long, device=meta.positions.device)
    return ReusePlan(ctx, layer_id, rows_t, sub_batch(meta, compute, rows_t) if compute else None, reused, (), unit)


def sub_batch(meta: BatchMeta, reqs: list, rows: torch.Tensor) -> BatchMeta:
    """The requests ``reqs`` (indices into ``meta``) of a paged batch as a batch of their own."""
    q_lens = [meta.q_lens[b] for b in reqs]
    idx = torch.tensor(reqs, dtype=torch.long, device=meta.block_table.device)
    req = torch.repeat_interleave(torch.arange(len(reqs), dtype=torch.int32), torch.tensor(q_lens))
    return BatchMeta(meta.positions[rows], req.to(meta.req_of_row.device), q_lens, [meta.ctx_lens[b] for b in reqs],
                     meta.seq_lens[idx], meta.block_table[idx], meta.block_size, meta.slot_mapping[rows],
                     tuple(meta.rids[b] for b in reqs))


def reused_row(saved: torch.Tensor, saved_pos: int, pos: int, k: int, unit: int = 1) -> torch.Tensor:
    """The row of a decode step at ``pos`` from the selection ``saved`` computed at ``saved_pos``:
    the new positions ``saved_pos + 1 .. pos`` (the last ``k`` of them at most), then the
    smallest ``k - m`` saved positions; ascending, ``-1``-padded to ``k``. With ``unit`` > 1 the
    entries are unit ids and the new ones the units complete at ``pos`` but not at ``saved_pos``."""
    hi = (pos + 1) // unit  # units complete at pos: ids below hi (unit 1: positions up to pos)
    lo = max((saved_pos + 1) // unit, hi - k)
    new = torch.arange(lo, hi, dtype=torch.int32, device=saved.device)
    keep = k - new.numel()
    old = torch.where(saved < 0, _NONE, saved).sort().values[:keep]
    row = torch.cat((old, new)).sort().values
    return torch.where(row == _NONE, -1, row)


def write_reused(plan: ReusePlan, rows: torch.Tensor) -> None:
    """Fill the reused rows of ``rows`` (the shared buffer's rows of this forward)."""
    meta, k = plan.ctx.meta, rows.shape[1]
    for b, row, saved_pos, saved in plan.reused:
        rows[row] = reused_row(saved, saved_pos, meta.ctx_lens[b], k, plan.unit)


def recall(reused: torch.Tensor, fresh: torch.Tensor) -> float:
    """The share of ``fresh``'s valid positions that ``reused`` holds too (1.0 when fresh has none)."""
    f = fresh[fresh >= 0]
    if f.numel() == 0:
        return 1.0
    return torch.isin(f, reused[reused >= 0]).sum().item() / f.numel()


def check(plan: ReusePlan, rows: torch.Tensor) -> None:
    """The probe layer's check (``rows`` its fresh rows of this forward): the requests whose reused
    row would hold less than ``index_reuse_min_recall`` of the fresh one recompute in every later F
    layer of this forward."""
    ctx, meta = plan.ctx, plan.ctx.meta
    store, k = ctx.cache.selections, rows.shape[1]
    for b, row, saved_pos, saved in plan.probed:
        store.checked += 1
        if recall(reused_row(saved, saved_pos, meta.ctx_lens[b], k, plan.unit), rows[row]) < ctx.reuse_min_recall:
            store.recomputed += 1
            ctx.reuse_forced.add(meta.rids[b])


def save(plan: ReusePlan, rows: torch.Tensor) -> None:
    """Keep each computing request's last row of this forward as its layer's last selection (a probed
    request whose reuse passed the check keeps the probe's older row)."""
    meta, store = plan.ctx.meta, plan.ctx.cache.selections
    reused = {b for b, *_ in plan.reused}
    reused |= {b for b, *_ in plan.probed if meta.rids[b] not in plan.ctx.reuse_forced}
    offs = meta.row_offsets()
    last = [(b, offs[b] + meta.q_lens[b] - 1) for b in range(len(meta.q_lens)) if b not in reused]
    if not last:
        return
    kept = rows[[r for _, r in last]].clone()
    for (b, _), row in zip(last, kept.unbind(0)):
        store.put(meta.rids[b], plan.layer_id, meta.ctx_lens[b] + meta.q_lens[b] - 1, row)
