"""Gated DeltaNet (Qwen3.8-Flash-Next's ``linear_attention`` layers), as transformers'
``Qwen4ExpTextGatedDeltaNet`` computes it:

- ``in_proj_qkv`` -> a depthwise causal conv1d over ``linear_conv_kernel_dim`` tokens (no bias)
  and SiLU, then split into q, k ``[h_k, d_k]`` and v ``[h_v, d_v]``;
- q and k L2-normalised in fp32 (``x * rsqrt(sum(x^2) + 1e-6)``), queries scaled by ``d_k^-0.5``;
- per token and value head a scalar log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and a
  write strength ``beta = sigmoid(b)`` (``in_proj_a`` / ``in_proj_b``);
- the gated delta rule (``delta_rule`` below: the one call into the recurrence), then a gated
  RMSNorm per value head (``norm``: ``weight * rmsnorm(o) * act(z)``, ``z = in_proj_z(x)``) and
  ``out_proj``.

Per request the layer keeps two constant-size states: the conv window (the last
``kernel - 1`` inputs of the conv) and the recurrent state ``[h_v, d_k, d_v]`` fp32. They live in
the family's paged cache (``conv[layer]``, ``recurrent[layer]``, one row per request slot); a
forward without a cache starts every request from zeros and keeps nothing.

Tensor parallel (DESIGN.md §11): key and value heads split over the ranks (value head ``h`` reads
key head ``h // (h_v / h_k)``, so contiguous cuts keep each rank's heads together). The fused
``in_proj_qkv`` and ``conv1d`` hold three ranges of the checkpoint's rows (this rank's q, k and v
heads, ``RowRanges``); ``in_proj_z`` / ``_b`` / ``_a``, ``dt_bias`` and ``A_log`` this rank's value
heads; ``norm`` replicated; ``out_proj`` row split, its partial sums all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import ops
from indexcache.parallel import ParallelContext
from indexcache.parallel.linear import linear


def delta_rule(q, k, v, g, beta, state, cu_seqlens, state_indices, scale: float) -> torch.Tensor:
    """The gated delta-rule recurrence: the kernel ``indexcache.ops.delta_rule`` (its formal
    definition is ``indexcache.reference.delta_rule``)."""
    return ops.delta_rule(q, k, v, g, beta, state, cu_seqlens, state_indices, scale)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and FLA's) ``x * rsqrt(sum(x^2) + eps)`` over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * act(gate)``: fp32 norm, cast back before the weight, the gate in fp32
    (transformers' ``Qwen4ExpTextRMSNormGated``)."""

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__()
        if activation not in _ACTS:
            raise ValueError(f"output_gate_type {activation!r}: Gated DeltaNet gates with 'silu' or 'sigmoid'")
        self.eps, self.act = eps, _ACTS[activation]
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * self.act(gate.float())).to(dtype)


class RowRanges(nn.Module):
    """A weight holding the rows ``ranges`` (``[(lo, hi), ..]``) of a checkpoint tensor of ``full_shape``,
    stacked in order (the loader reads each range); its forward is the bias-free linear ``x W^T``."""

    def __init__(self, full_shape: tuple, ranges: list):
        super().__init__()
        self.full_shape, self.ranges = tuple(full_shape), list(ranges)
        self.weight = nn.Parameter(torch.empty(sum(hi - lo for lo, hi in ranges), *full_shape[1:]))

    def param_slice(self, attr: str):
        return (None, None) if self.weight.shape[0] == self.full_shape[0] else (0, list(self.ranges))

    def param_full_shape(self, attr: str) -> tuple:
        return self.full_shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer over a flattened batch ``[N, hidden]`` (rows grouped by request);
    under tensor parallelism this rank's heads (``h_k``, ``h_v`` and the widths are local)."""

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, gate_act: str, layer_id: int, par: ParallelContext | None = None):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} must be a multiple of linear_num_key_heads "
                             f"{num_k_heads}")
        if conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim {conv_kernel} must be >= 1")
        self.layer_id, self.par = layer_id, par or ParallelContext()
        (k0, k1), (v0, v1) = (self.par.split(num_k_heads, "linear_num_key_heads"),
                              self.par.split(num_v_heads, "linear_num_value_heads"))
        self.h_k, self.h_v, self.d_k, self.d_v = k1 - k0, v1 - v0, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = self.h_k * head_k_dim, self.h_v * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel, self._v_heads, self._v_cut = conv_kernel, num_v_heads, (v0, v1)
        keys, values = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        ranges = [(k0 * head_k_dim, k1 * head_k_dim), (keys + k0 * head_k_dim, keys + k1 * head_k_dim),
                  (2 * keys + v0 * head_v_dim, 2 * keys + v1 * head_v_dim)]
        self.conv1d = RowRanges((2 * keys + values, 1, conv_kernel), ranges)  # nn.Conv1d's depthwise weight
        self.dt_bias = nn.Parameter(torch.ones(self.h_v))
        self.A_log = nn.Parameter(torch.zeros(self.h_v))
        self.norm = GatedRMSNorm(head_v_dim, eps, gate_act)
        cut = (v0 * head_v_dim, v1 * head_v_dim)
        self.out_proj = self.par.linear(values, hidden, "out_proj", "row", cut)
        self.in_proj_qkv = RowRanges((2 * keys + values, hidden), ranges)
        self.in_proj_z = self.par.linear(hidden, values, "in_proj_z", "col", cut)
        self.in_proj_b = self.par.linear(hidden, num_v_heads, "in_proj_b", "col", (v0, v1))
        self.in_proj_a = self.par.linear(hidden, num_v_heads, "in_proj_a", "col", (v0, v1))

    def param_slice(self, attr: str):
        """The loader's hook: ``dt_bias`` / ``A_log`` of this rank's value heads."""
        return (None, None) if self.h_v == self._v_heads else (0, self._v_cut)

    def param_full_shape(self, attr: str) -> tuple:
        return (self._v_heads,)

    def state_shapes(self) -> tuple[tuple, tuple]:
        """Per request: (conv window ``[kernel - 1, conv_dim]``, recurrent state ``[h_v, d_k, d_v]``)."""
        return (self.conv_kernel - 1, self.conv_dim), (self.h_v, self.d_k, self.d_v)

    def _conv(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU of one request's rows ``x [n, C]`` after ``window [kernel - 1, C]``
        (updated in place to the last ``kernel - 1`` inputs)."""
        w = self.conv1d.weight  # [C, 1, K]
        full = torch.cat((window.to(x.dtype), x), dim=0)  # [K - 1 + n, C]
        out = F.conv1d(full.t().unsqueeze(0).to(w.dtype), w, groups=self.conv_dim)[0].t()
        if window.shape[0]:
            window.copy_(full[-window.shape[0]:].to(window.dtype))
        return F.silu(out).to(x.dtype)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor, slots: list,
                q_lens: list) -> torch.Tensor:
        """``x [N, hidden]``; request b owns rows ``q_lens[b]`` and state row ``slots[b]`` of
        ``conv_state [S, kernel - 1, conv_dim]`` and ``rec_state`` fp32 ``[S, h_v, d_k, d_v]``,
        both continued and updated in place."""
        n = x.shape[0]
        mixed = self.in_proj_qkv(x)
        parts, off = [], 0
        for slot, qn in zip(slots, q_lens):
            parts.append(self._conv(mixed[off:off + qn], conv_state[slot]))
            off += qn
        mixed = torch.cat(parts, dim=0)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(n, self.h_k, self.d_k))
        k = l2norm(k.reshape(n, self.h_k, self.d_k))
        v = v.reshape(n, self.h_v, self.d_v)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        cu = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(x.device)
        idx = torch.tensor(slots, dtype=torch.int32, device=x.device)
        o = delta_rule(q, k, v.float(), g, beta, rec_state, cu, idx, self.d_k ** -0.5)
        z = self.in_proj_z(x).reshape(n, self.h_v, self.d_v)
        o = self.norm(o.to(x.dtype), z)
        return self.par.all_reduce(self.out_proj(o.reshape(n, self.value_dim)), "attn_all_reduce")
