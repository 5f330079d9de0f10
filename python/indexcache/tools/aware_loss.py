"""The indexer distillation loss, single-layer (the DSA recipe, ``tools.train``) and multi-layer
(training-aware IndexCache, ``tools.aware``).

Each F layer's indexer is distilled toward the mean, over the layers it serves (itself and the
S layers whose ``plan.source_layer`` it is), of their head-mean attention distributions,

    target[t] = 1/|L_f| * sum_{l in L_f} 1/H * sum_h softmax(scores_l,h[t] over the allowed keys)
    loss_f    = mean_t KL(target[t] || softmax(indexer_f logits[t] over the allowed keys))

with the allowed keys the causal window (dense attention) or the top-k the F indexer selected
(every layer it serves attends over exactly that selection, as at inference). With one layer
per group this is the DSA recipe's own indexer loss.

``IndexerKL`` is a ``TorchPass`` observer: the model's blocks hand it each layer's record as the
forward runs, and it takes a group's KL as soon as the group's last layer has run, in query
chunks, so that at most one group's tensors and one chunk's ``[rows, keys]`` matrices live.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from indexcache import differentiable
from indexcache.models.state import ForwardContext, LayerRecord

# Scores per attention/indexer chunk ([B, H, rows, keys] fp32): 64 MB.
CHUNK_ELEMS = 1 << 24


def serving_groups(source_layer: Sequence[int], num_layers: int) -> dict:
    """F layer -> the main layers that read its indices (itself first), from ``plan.source_layer``."""
    groups: dict = {}
    for layer in range(num_layers):
        groups.setdefault(int(source_layer[layer]), []).append(layer)
    for f, served in groups.items():
        if served[0] != f:
            raise ValueError(f"layer {served[0]} reads layer {f}, which is not an F layer below it")
    return groups


def served_target(layer_probs) -> torch.Tensor:
    """The multi-layer target ``[B, rows, keys]``: the mean over layers of each layer's head-mean
    attention distribution (``layer_probs``: per served layer ``[B, H, rows, keys]``, rows summing
    to 1; any iterable, consumed one layer at a time)."""
    target, count = None, 0
    for p in layer_probs:
        t = p.float().mean(1)
        target = t if target is None else target + t
        count += 1
    if count == 0:
        raise ValueError("an indexer must serve at least one layer")
    target = target / count
    return target / target.sum(-1, keepdim=True).clamp_min(1e-30)


def kl_rows(index_logits: torch.Tensor, target: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Per row ``KL(target || softmax(index_logits over allowed))``: ``[B, rows]`` (nats)."""
    logp = torch.log_softmax(index_logits.float().masked_fill(~allowed, -math.inf), dim=-1)
    terms = target * (torch.log(target.clamp_min(1e-12)) - logp.clamp_min(-1e4))
    return terms.masked_fill(~allowed, 0).sum(-1)


def multi_layer_kl(index_logits: torch.Tensor, layer_probs: Sequence[torch.Tensor], allowed: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the multi-layer loss of one indexer (the module docstring's ``loss_f``)."""
    return kl_rows(index_logits, served_target(layer_probs), allowed).mean()


def group_kl(indexer, records: dict, served: Sequence[int], cos: torch.Tensor, sin: torch.Tensor, chunks,
             *, backward: bool = False, weight: float = 1.0) -> float:
    """Multi-layer KL of the indexer of F layer ``served[0]`` (nats, mean over query rows), from the
    layers' records. The indexer's queries, keys and weights come from its own ``dense_inputs``
    once; with ``backward`` each chunk's share of ``weight * loss`` is back-propagated as soon as it
    is computed, and the gathered gradients go through the projections once at the end."""
    rec = records[served[0]]
    b, t = rec.x.shape[:2]
    with torch.set_grad_enabled(backward):
        qkw = indexer.dense_inputs(rec.x, rec.qr, cos, sin)
    q, k, w = (a.detach().requires_grad_(backward) for a in qkw)
    total = 0.0
    for r0, r1 in chunks:
        allowed = differentiable.allowed_keys(rec.selection, r0, r1, b, rec.x.device)
        with torch.no_grad():
            target = served_target(differentiable.attention_probs(records[l].q[:, :, r0:r1], records[l].k[:, :, :r1],
                                                             records[l].scale, allowed) for l in served)
        with torch.set_grad_enabled(backward):
            logits = differentiable.dense_indexer_logits(q[:, r0:r1], k[:, :r1], w[:, r0:r1])
            part = kl_rows(logits, target, allowed).sum() / (b * t)
            if backward:
                (part * weight).backward()
        total += float(part.detach())
        del target, allowed, logits, part
    if backward:
        torch.autograd.backward(list(qkw), [q.grad, k.grad, w.grad])
    return total


class IndexerKL:
    """``TorchPass`` observer taking each group's multi-layer KL (``groups``: F layer -> the layers
    it serves, itself first) as soon as its last layer has run; ``kls`` F layer -> nats. Unless
    ``keep``, a group's records are dropped once its KL is taken."""

    def __init__(self, model, groups: dict, ctx: ForwardContext, *, backward: bool = False, weight: float = 1.0,
                 keep: bool = False):
        self.model, self.groups, self.ctx = model, groups, ctx
        self.backward, self.weight, self.keep = backward, weight, keep
        self.src = {layer: f for f, served in groups.items() for layer in served}
        self.last_of = {served[-1]: f for f, served in groups.items()}
        self.records: dict = {}
        self.kls: dict = {}

    def __call__(self, rec: LayerRecord) -> None:
        if rec.layer_id not in self.src:
            return
        self.records[rec.layer_id] = rec
        f = self.last_of.get(rec.layer_id)
        if f is None:
            return
        served = self.groups[f]
        indexer = self.model.model.layers[f].self_attn.indexer
        self.kls[f] = group_kl(indexer, self.records, served, self.ctx.cos, self.ctx.sin,
                               self.ctx.torch_pass.chunks, backward=self.backward, weight=self.weight)
        if not self.keep:
            for layer in served:
                del self.records[layer]
