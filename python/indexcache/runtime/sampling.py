"""Token choice: greedy or temperature / top-p sampling, and the acceptance rule of speculative
decoding (greedy prefix match, or rejection sampling against the draft distribution)."""

from __future__ import annotations

from typing import Optional

import torch


def probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution per row: softmax at ``temperature``, cut to the top-p nucleus."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = p.sort(dim=-1, descending=True)
        drop = (sp.cumsum(dim=-1) - sp) > top_p  # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, si, sp)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen) -> tuple[list, Optional[torch.Tensor]]:
    """Token per row (greedy at temperature 0) and the distribution it was drawn from."""
    if temperature == 0:
        return logits.argmax(dim=-1).tolist(), None
    p = probs(logits, temperature, top_p)
    return torch.multinomial(p, 1, generator=gen).view(-1).tolist(), p


def accept(logits: torch.Tensor, drafts: list, dprobs: list, temperature: float, top_p: float, gen) -> tuple[int, int]:
    """(accepted drafts, the token that follows them) for one request's k+1 verify rows."""
    if temperature == 0:
        target = logits.argmax(dim=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return a, target[a]
    p = probs(logits, temperature, top_p)
    for j, (d, q) in enumerate(zip(drafts, dprobs)):
        u = float(torch.rand(1, generator=gen, device=p.device))
        if u * float(q[d]) < float(p[j, d]):
            continue
        resid = (p[j] - q).clamp(min=0)
        resid = resid if float(resid.sum()) > 0 else p[j]
        return j, int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))
