"""Per-Layer Embedding (PLE) of Qwen3.8-Flash-Next's ``ple_layer_ids`` layers, as transformers'
``Qwen4ExpTextNGramEmbedding`` / ``Qwen4ExpTextPLELayer`` compute it.

N-gram embedding: for n = 2 .. ``ngram_size``, ``heads_per_ngram`` hashed heads each. Token t's
shifted ids ``s_j`` (j = 0 .. n - 1) are the token j places back, or eos when that crosses the
start of the request or an eos (segments restart after every eos); the n-gram's hash is
``XOR_j s_j * m_j`` in wrapping int64 arithmetic (``m_j``: per-layer odd multipliers from a
splitmix64 of ``seed``), reduced modulo each head's prime table size and offset into one table
stored as ``split_ngram_parts`` row shards (``ngram_embedding.shard_i.weight``, the checkpoint's
layout). The heads' rows are concatenated (``ple_embed_dim``).

PLE: a key per residual stream (``key_proj``, normed per stream) gates one value
(``value_proj``) by the signed square root of its scaled dot product with the normed stream; the
gated values go through a dilated (``ngram_size``) depthwise causal conv + SiLU over their
per-stream norm, and value + conv output is added to every stream.

Per request two states: the last ``ngram_size - 1`` token ids (eos at the start) and the conv
window (the last ``(kernel - 1) * ngram_size`` normed gated values).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .gqa import OffsetRMSNorm

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def layer_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> list:
    """The odd hash multipliers of PLE layer ``ple_index`` (0-based among the PLE layers)."""
    half = max(1, (((1 << 63) - 1) // max(vocab, 1)) // 2)
    base = seed + _LAYER_PRIME * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (j + 1)) & _MASK64) % half) + 1 for j in range(ngram_size)]


def _is_prime(v: int) -> bool:
    if v < 2 or v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def head_table_sizes(base: int, ple_index: int, n_heads: int) -> list:
    """Each head's table size: the ``(ple_index * n_heads + h + 1)``-th prime >= ``base``."""
    sizes, p, target = [], base - 1, (ple_index + 1) * n_heads
    for i in range(target):
        p += 1
        while not _is_prime(p):
            p += 1
        if i >= ple_index * n_heads:
            sizes.append(p)
    return sizes


def _group_norm(dim: int, group: int, eps: float) -> OffsetRMSNorm:
    return GroupRMSNorm(dim, group, eps)


class GroupRMSNorm(OffsetRMSNorm):
    """``1 + weight`` RMSNorm applied per group of ``group`` features (one per residual stream)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__(dim, eps)
        if dim % group:
            raise ValueError(f"hidden size {dim} is not a multiple of the group size {group}")
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.group))
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class ShardedEmbedding(nn.Module):
    """One embedding table stored as row shards ``shard_0 .. shard_{p-1}`` (``torch.chunk`` sizes)."""

    def __init__(self, rows: int, dim: int, parts: int):
        super().__init__()
        sizes = [len(c) for c in torch.arange(rows, device="cpu").chunk(parts)]
        self.starts = [0]
        for i, s in enumerate(sizes):
            self.add_module(f"shard_{i}", nn.Embedding(s, dim))
            self.starts.append(self.starts[-1] + s)
        self.parts = len(sizes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        first = getattr(self, "shard_0").weight
        out = torch.empty(flat.shape[0], first.shape[1], dtype=first.dtype, device=first.device)
        for i in range(self.parts):
            lo, hi = self.starts[i], self.starts[i + 1]
            hit = (flat >= lo) & (flat < hi)
            if bool(hit.any()):
                out[hit] = getattr(self, f"shard_{i}").weight[flat[hit] - lo]
        return out.view(*ids.shape, -1)


class NGramEmbedding(nn.Module):
    def __init__(self, vocab: int, embed_dim: int, ngram_size: int, heads_per_ngram: int, table_base: int,
                 divisor: int, parts: int, seed: int, eos: int, ple_index: int):
        super().__init__()
        self.n, self.heads_per = ngram_size, heads_per_ngram
        self.n_heads = (ngram_size - 1) * heads_per_ngram
        if ngram_size < 2 or self.n_heads < 1 or embed_dim % self.n_heads:
            raise ValueError(f"ple_embed_dim {embed_dim} must be a positive multiple of the n-gram heads "
                             f"(ngram_size - 1) x heads_per_ngram = {self.n_heads}")
        self.eos = int(eos)
        self.mult = layer_multipliers(vocab, ngram_size, ple_index, seed)
        self.sizes = head_table_sizes(table_base, ple_index, self.n_heads)
        self.offsets = [sum(self.sizes[:h]) for h in range(self.n_heads)]
        padded = math.ceil(sum(self.sizes) / divisor) * divisor
        self.ngram_embedding = ShardedEmbedding(padded, embed_dim // self.n_heads, parts)

    def forward(self, ids: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """One request's token ids ``[n]`` after ``history [ngram_size - 1]`` (updated in place) ->
        ``[n, ple_embed_dim]``."""
        c, n = self.n - 1, ids.shape[0]
        hist = torch.cat((history.to(ids.device, torch.long), ids.long()))
        history.copy_(hist[-c:])
        is_eos = hist == self.eos
        t = torch.arange(c, c + n, device=ids.device)
        shifted = [hist[t]]
        blocked = torch.zeros(n, dtype=torch.bool, device=ids.device)
        for j in range(1, self.n):
            blocked = blocked | is_eos[t - j] if j > 1 else is_eos[t - 1]
            shifted.append(torch.where(blocked, torch.full_like(hist[t], self.eos), hist[t - j]))
        sizes = torch.tensor(self.sizes, dtype=torch.long, device=ids.device)
        offsets = torch.tensor(self.offsets, dtype=torch.long, device=ids.device)
        heads = []
        for order in range(2, self.n + 1):
            mixed = shifted[0] * self.mult[0]
            for j in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[j] * self.mult[j])
            h0 = (order - 2) * self.heads_per
            sz, of = sizes[h0:h0 + self.heads_per], offsets[h0:h0 + self.heads_per]
            heads.append(torch.remainder(mixed.unsqueeze(-1), sz.view(1, -1)) + of.view(1, -1))
        return self.ngram_embedding(torch.cat(heads, dim=-1)).flatten(-2)


class PLELayer(nn.Module):
    def __init__(self, hidden: int, hc: int, embed_dim: int, conv_kernel: int, eps: float, ngram: dict):
        super().__init__()
        self.hidden, self.hc = hidden, hc
        self.dilation = ngram["ngram_size"]
        self.window = (conv_kernel - 1) * self.dilation
        self.ple_embedding = NGramEmbedding(embed_dim=embed_dim, **ngram)
        self.key_proj = nn.Linear(embed_dim, hc * hidden, bias=False)
        self.value_proj = nn.Linear(embed_dim, hidden, bias=False)
        self.norm_key = _group_norm(hc * hidden, hidden, eps)
        self.norm_query = _group_norm(hc * hidden, hidden, eps)
        self.norm_conv = _group_norm(hc * hidden, hidden, eps)
        self.conv1d = nn.Conv1d(hc * hidden, hc * hidden, conv_kernel, groups=hc * hidden, dilation=self.dilation,
                                bias=False)

    def state_shapes(self) -> tuple[tuple, tuple]:
        """Per request: (token history ``[ngram_size - 1]`` int64, conv window ``[window, hc * hidden]``)."""
        return (self.dilation - 1,), (self.window, self.hc * self.hidden)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, history: torch.Tensor, window: torch.Tensor,
                slots: list, q_lens: list) -> torch.Tensor:
        """The PLE term ``[N, hc * hidden]`` for streams ``h`` and token ids ``ids [N]``; request b's
        rows ``q_lens[b]`` continue state row ``slots[b]`` of ``history`` and ``window``."""
        embs, off = [], 0
        for slot, qn in zip(slots, q_lens):
            embs.append(self.ple_embedding(ids[off:off + qn], history[slot]))
            off += qn
        emb = torch.cat(embs, dim=0).to(h.dtype)
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(emb)
        query = self.norm_query(h).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * value.unsqueeze(-2)
        normed = self.norm_conv(gated.flatten(-2))
        gated = gated.flatten(-2)
        outs, off = [], 0
        w = self.conv1d.weight
        for slot, qn in zip(slots, q_lens):
            full = torch.cat((window[slot].to(normed.dtype), normed[off:off + qn]), dim=0)
            if self.window:
                window[slot].copy_(full[-self.window:].to(window.dtype))
            y = F.conv1d(full.t().unsqueeze(0).to(w.dtype), w, groups=w.shape[0], dilation=self.dilation)[0].t()
            outs.append(F.silu(y).to(h.dtype))
            off += qn
        return gated + torch.cat(outs, dim=0)
