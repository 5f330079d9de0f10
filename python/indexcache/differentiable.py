"""The blocks' differentiable forms: what the model blocks run when gradients are needed
(training, training-aware distillation; a ``TorchPass`` in ``models.state`` switches them on).

The same quantities as the op definitions of :mod:`indexcache.reference` (the causal window,
the indexer's score, top-k with ties toward the lower position, softmax attention over the
selected keys), over batches of B requests of T tokens, on unquantized fp32 scores, in
query-row chunks so that no [T, T] matrix per layer is ever whole.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def row_chunks(batch: int, heads: int, seq: int, chunk_elems: int) -> list:
    """Query-row ranges ``[(r0, r1)]`` with at most ``chunk_elems`` scores ``[B, H, rows, keys]`` each."""
    rows = max(1, min(seq, chunk_elems // max(1, batch * heads * seq)))
    return [(r0, min(seq, r0 + rows)) for r0 in range(0, seq, rows)]


def allowed_keys(selection: Optional[torch.Tensor], r0: int, r1: int, batch: int, device) -> torch.Tensor:
    """Bool ``[B, r1 - r0, r1]``: query rows r0..r1 may attend to key s. The causal window when
    ``selection`` is None, else the selected positions (int64 ``[B, T, k]``, -1 = none) inside it."""
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    causal = torch.arange(r1, device=device).unsqueeze(0) <= rows
    if selection is None:
        return causal.expand(batch, -1, -1)
    s = selection[:, r0:r1]
    m = torch.zeros(batch, r1 - r0, r1 + 1, dtype=torch.bool, device=device)
    m.scatter_(-1, torch.where((s >= 0) & (s < r1), s, r1), True)
    return m[..., :r1] & causal


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention rows fp32 ``[B, H, rows, keys]`` of q ``[B, H, rows, d]`` over k
    ``[B, H, keys, d]``, restricted to ``allowed`` ``[B, rows, keys]``."""
    s = (q @ k.transpose(-1, -2)).float() * scale
    return torch.softmax(s.masked_fill(~allowed.unsqueeze(1), -math.inf), dim=-1)


def _attention_rows(q, k, v, scale, allowed):
    return attention_probs(q, k, scale, allowed).to(v.dtype) @ v


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     selection: Optional[torch.Tensor], chunks: list, recompute: bool = False) -> torch.Tensor:
    """MLA in its unabsorbed form: ``[B, H, T, v_dim]``, each query row attending over its causal
    window (``selection`` None) or over the selected positions in it, chunk by chunk (``recompute``:
    each chunk's probabilities are recomputed in backward instead of kept). The causal window is
    torch's fused causal attention, which keeps no [T, T] matrix either."""
    from torch.utils.checkpoint import checkpoint

    if selection is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    b = q.shape[0]
    outs = []
    for r0, r1 in chunks:
        args = (q[:, :, r0:r1], k[:, :, :r1], v[:, :, :r1], scale, allowed_keys(selection, r0, r1, b, q.device))
        outs.append(checkpoint(_attention_rows, *args, use_reentrant=False) if recompute else _attention_rows(*args))
    return torch.cat(outs, dim=2)


def dense_indexer_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[B, rows, keys]``: Σ_h weights[t, h] · ReLU(q[t, h] · k[s]) (the op's score, batched, no
    window): q ``[B, rows, H, d]``, k ``[B, keys, d]``, weights ``[B, rows, H]`` with the softmax
    constants folded in (:func:`indexcache.reference.indexer_weights`). One head at a time keeps
    memory at one matrix."""
    out = None
    for h in range(q.shape[2]):
        term = (q[:, :, h] @ k.transpose(1, 2)).relu() * weights[:, :, h:h + 1]
        out = term if out is None else out + term
    return out


@torch.no_grad()
def dense_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, chunks: list) -> torch.Tensor:
    """Each query row's top-k positions in its causal window, int64 ``[B, T, min(topk, T)]`` (-1
    where the window is shorter), ties toward the lower position (the op's total order)."""
    b, t = q.shape[:2]
    kk = min(topk, t)
    sel = torch.full((b, t, kk), -1, dtype=torch.long, device=q.device)
    for r0, r1 in chunks:
        logits = dense_indexer_logits(q[:, r0:r1], k[:, :r1], weights[:, r0:r1])
        logits = logits.masked_fill(~allowed_keys(None, r0, r1, b, q.device), -math.inf)
        n = min(kk, r1)
        vals, idx = logits.sort(dim=-1, descending=True, stable=True)
        sel[:, r0:r1, :n] = torch.where(torch.isfinite(vals[..., :n]), idx[..., :n], -1)
    return sel
