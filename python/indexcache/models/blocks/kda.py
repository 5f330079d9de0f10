"""Kimi Delta Attention (KDA), GLM-5.3-Flash's linear-attention layer, and the per-request state it
carries between forwards.

Per token (transformers' ``Glm5NextTextLinearAttention``): ``q | k | v = conv(q_proj x | k_proj x |
v_proj x)`` through one depthwise causal convolution of ``linear_conv_kernel_dim`` taps with SiLU,
q and k l2-normalised per head (``x / sqrt(Σ x² + 1e-6)``, fp32), a per-channel log-decay ``g``
from the forget gate (``lower_bound · sigmoid(exp(A_log) · (f_b(f_a(x)) + dt_bias))``, or
``-exp(A_log) · softplus(..)`` without a bound), ``beta = sigmoid(b_proj x)``, the gated delta rule
(``reference.delta_rule``'s recurrence, scale ``d_k^-½``), then a gated RMSNorm per head
(``RMSNorm(o) · sigmoid(g_b(g_a(x)))``) and ``o_proj``.

State per request and layer, constant in the context length: the last ``kernel - 1`` conv inputs
``[conv_dim, kernel - 1]`` and the recurrent state ``[heads, d_k, d_v]`` (fp32). ``LinearStates``
holds them in rows ("slots") handed out per request, grown to the most requests live at once; a
request whose forward starts at position 0 starts from zeros.

Tensor parallel (DESIGN.md §11): heads split over the ranks. ``q/k/v_proj``, their short convs,
``f_b_proj``, ``dt_bias``, ``A_log``, ``b_proj`` and ``g_b_proj`` hold this rank's heads (column
split); ``f_a_proj``, ``g_a_proj`` and ``o_norm`` are replicated; ``o_proj`` is row split and its
partial sums all-reduced. The state holds this rank's heads only.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import ops
from indexcache.parallel import ParallelContext

from ..state import ForwardContext

# The delta-rule recurrence: the kernel (its formal definition is reference.delta_rule).
_delta_rule = ops.delta_rule

L2_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x / sqrt(Σ x² + 1e-6)`` over the last dim (FLA's, as transformers computes it)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


class HeadSlices(nn.Module):
    """A block whose own parameters hold this rank's heads ``[h0, h1)`` of ``n_heads`` along dim 0,
    ``per_head`` rows each (the loader's ``param_slice`` hook)."""

    n_heads, cut = 1, (0, 1)
    per_head: dict = {}

    def param_slice(self, attr: str):
        if self.cut[1] - self.cut[0] == self.n_heads:
            return None, None
        k = self.per_head[attr]
        return 0, (self.cut[0] * k, self.cut[1] * k)

    def param_full_shape(self, attr: str) -> tuple:
        return (self.n_heads * self.per_head[attr],) + tuple(getattr(self, attr).shape[1:])


class DepthwiseConv(HeadSlices):
    """A depthwise filter ``weight [channels, 1, kernel]`` (``nn.Conv1d``'s parameter, fp32), this
    rank's heads' channels."""

    def __init__(self, n_heads: int, head_dim: int, kernel: int, cut: tuple):
        super().__init__()
        self.n_heads, self.cut, self.per_head = n_heads, cut, {"weight": head_dim}
        self.weight = nn.Parameter(torch.empty((cut[1] - cut[0]) * head_dim, 1, kernel))


class ForgetGate(HeadSlices):
    """Per-channel log-decay ``[N, heads, d_k]`` (fp32, <= 0), this rank's heads ``cut``."""

    def __init__(self, hidden: int, heads: int, head_dim: int, lower_bound: Optional[float],
                 par: Optional[ParallelContext] = None, cut: Optional[tuple] = None):
        super().__init__()
        par, cut = par or ParallelContext(), cut or (0, heads)
        self.n_heads, self.cut, self.per_head = heads, cut, {"dt_bias": head_dim, "A_log": 1}
        self.heads, self.head_dim, self.lower_bound = cut[1] - cut[0], head_dim, lower_bound
        self.f_a_proj = par.linear(hidden, head_dim, "f_a_proj")
        self.f_b_proj = par.linear(head_dim, heads * head_dim, "f_b_proj", "col",
                                   (cut[0] * head_dim, cut[1] * head_dim))
        self.dt_bias = nn.Parameter(torch.empty(self.heads * head_dim))  # fp32
        self.A_log = nn.Parameter(torch.empty(self.heads))  # fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(n, self.heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, self.heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))


class GatedRMSNorm(nn.Module):
    """``RMSNorm(o) · weight · sigmoid(gate)`` per head, fp32, returned in ``o``'s dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (h * torch.sigmoid(gate.float())).to(o.dtype)


class LinearStates:
    """The KDA layers' per-request state: per layer ``conv`` fp32 ``[slots, conv_dim, kernel - 1]`` and
    ``recurrent`` fp32 ``[slots, heads, d_k, d_v]``, one slot per live request.

    ``slots(rids, ctx_lens)`` gives the batch's requests their slots (a request new to the store takes
    a free one; the store grows, by doubling, to the most requests live at once, at most
    ``max_slots``) and zeroes those of requests starting at position 0; ``free(rid)`` returns it (the
    paged cache's ``CacheManager.on_free`` hook)."""

    def __init__(self, layers: Sequence[Optional[tuple]], num_slots: int, device, max_slots: Optional[int] = None):
        """``layers``: per main layer, (conv_dim, kernel, heads, d_k, d_v) for a KDA layer, else None."""
        if num_slots < 0 or (max_slots is not None and max_slots < max(num_slots, 1)):
            raise ValueError(f"the linear-attention state needs 0 <= num_slots <= max_slots, got {num_slots}, {max_slots}")
        self.specs, self.device, self.max_slots = list(layers), device, max_slots
        self.num_slots = 0
        self.conv = [None if spec is None else torch.zeros(0, spec[0], spec[1] - 1, device=device) for spec in self.specs]
        self.recurrent = [None if spec is None else torch.zeros(0, *spec[2:], device=device) for spec in self.specs]
        self._slot_of: dict = {}
        self._free: list = []
        self._grow(num_slots)

    def _grow(self, to: int) -> None:
        if to <= self.num_slots:
            return
        extra = to - self.num_slots
        for i, spec in enumerate(self.specs):
            if spec is not None:
                self.conv[i] = torch.cat((self.conv[i], self.conv[i].new_zeros(extra, *self.conv[i].shape[1:])))
                self.recurrent[i] = torch.cat((self.recurrent[i],
                                               self.recurrent[i].new_zeros(extra, *self.recurrent[i].shape[1:])))
        self._free = list(range(to - 1, self.num_slots - 1, -1)) + self._free
        self.num_slots = to

    def slots(self, rids: Sequence, ctx_lens: Sequence[int]) -> list:
        out = []
        for rid, c in zip(rids, ctx_lens):
            slot = self._slot_of.get(rid)
            if slot is None:
                if c != 0:
                    raise ValueError(f"request {rid!r} continues at position {c} but holds no linear-attention state "
                                     "(its earlier tokens ran in no forward over this cache)")
                if not self._free:
                    if self.max_slots is not None and self.num_slots >= self.max_slots:
                        raise RuntimeError(f"linear-attention state out of slots: {self.num_slots} requests live "
                                           f"(max_num_seqs {self.max_slots})")
                    want = max(1, 2 * self.num_slots)
                    self._grow(want if self.max_slots is None else min(want, self.max_slots))
                slot = self._slot_of[rid] = self._free.pop()
            if c == 0:
                for t in self.conv + self.recurrent:
                    if t is not None:
                        t[slot].zero_()
            out.append(slot)
        return out

    def free(self, rid) -> None:
        slot = self._slot_of.pop(rid, None)
        if slot is not None:
            self._free.append(slot)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent if t is not None)


class KimiDeltaAttention(nn.Module):
    """One KDA layer over a flattened batch (rows request-major, as ``BatchMeta`` lays them out);
    under tensor parallelism this rank's heads (``heads`` is the local count)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, kernel: int, lower_bound: Optional[float],
                 norm_eps: float, layer_id: int, par: Optional[ParallelContext] = None):
        super().__init__()
        self.par = par = par or ParallelContext()
        h0, h1 = par.split(heads, "linear_num_heads")
        self.layer_id, self.heads, self.head_dim, self.kernel = layer_id, h1 - h0, head_dim, kernel
        full, cut = heads * head_dim, (h0 * head_dim, h1 * head_dim)
        self.conv_dim = 3 * self.heads * head_dim
        self.q_proj = par.linear(hidden, full, "q_proj", "col", cut)
        self.k_proj = par.linear(hidden, full, "k_proj", "col", cut)
        self.v_proj = par.linear(hidden, full, "v_proj", "col", cut)
        # depthwise filters, fp32 (transformers keeps them in fp32 and runs them as one over q | k | v)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (DepthwiseConv(heads, head_dim, kernel, (h0, h1))
                                                       for _ in range(3))
        self.forget_gate = ForgetGate(hidden, heads, head_dim, lower_bound, par, (h0, h1))
        self.b_proj = par.linear(hidden, heads, "b_proj", "col", (h0, h1))
        self.g_a_proj = par.linear(hidden, head_dim, "g_a_proj")
        self.g_b_proj = par.linear(head_dim, full, "g_b_proj", "col", cut)
        self.o_norm = GatedRMSNorm(head_dim, norm_eps)
        self.o_proj = par.linear(full, hidden, "o_proj", "row", cut)
        self.indexer = None  # no lightning indexer: outside the IndexCache plan

    def state_spec(self) -> tuple:
        return self.conv_dim, self.kernel, self.heads, self.head_dim, self.head_dim

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, slots: list, q_lens: list) -> torch.Tensor:
        """Causal depthwise conv + SiLU of ``mixed [N, conv_dim]`` per request, continuing from and
        updating ``conv_state[slot]`` (the last ``kernel - 1`` inputs)."""
        w = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)).float()  # [C, 1, K]
        out, r0 = torch.empty(mixed.shape, dtype=torch.float32, device=mixed.device), 0
        for slot, n in zip(slots, q_lens):
            seq = torch.cat((conv_state[slot], mixed[r0:r0 + n].float().t()), dim=-1)  # [C, K - 1 + n]
            conv_state[slot] = seq[:, seq.shape[1] - (self.kernel - 1):]
            out[r0:r0 + n] = F.conv1d(seq.unsqueeze(0), w, groups=self.conv_dim)[0].t()
            r0 += n
        return F.silu(out).to(mixed.dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        meta, n = ctx.meta, x.shape[0]
        store = ctx.linear_states
        slots = ctx.linear_slots
        with ctx.stage(self.layer_id, "kda_proj"):
            mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
            mixed = self._conv(mixed, store.conv[self.layer_id], slots, meta.q_lens)
            q, k, v = mixed.view(n, 3, self.heads, self.head_dim).unbind(1)
            g = self.forget_gate(x)
            beta = torch.sigmoid(self.b_proj(x).float())
        with ctx.stage(self.layer_id, "delta_rule"):
            cu = torch.tensor([0] + list(_cumsum(meta.q_lens)), dtype=torch.int32, device=x.device)
            idx = torch.tensor(slots, dtype=torch.int32, device=x.device)
            # all fp32 into the op (q, k come out of the fp32 l2norm), the output back in v's dtype
            o = _delta_rule(l2norm(q), l2norm(k), v.float(), g, beta, store.recurrent[self.layer_id], cu, idx,
                            self.head_dim ** -0.5).to(v.dtype)
        gate = self.g_b_proj(self.g_a_proj(x)).view(n, self.heads, self.head_dim)
        return self.par.all_reduce(self.o_proj(self.o_norm(o, gate).reshape(n, -1)), "attn_all_reduce")


def _cumsum(lens):
    acc = 0
    for n in lens:
        acc += n
        yield acc
