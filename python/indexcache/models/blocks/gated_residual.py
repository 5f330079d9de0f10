"""Qwen3.8-Flash-Next's gated residual streams (transformers' ``Qwen4ExpTextGatedResidual``):
``hc`` copies of the residual, a low-rank sigmoid mix of their per-stream norms feeds a block,
whose output each stream takes back with its own sigmoid weight (``hyper.py`` holds HY-V4's and
DeepSeek-V4's hyper-connections, a different mixing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ple import GroupRMSNorm


class GatedResidual(nn.Module):
    """transformers' ``Qwen4ExpTextGatedResidual`` over streams ``[N, hc, D]``: the block input is
    the mean over streams of the normed streams times a low-rank sigmoid mix; with ``combine``, also
    the per-stream injection weights ``2 sigmoid(block_inject_weight(normed) / hc)``."""

    def __init__(self, hidden: int, hc: int, lowrank: int, eps: float, combine: bool = True):
        super().__init__()
        self.hc, self.hidden = hc, hidden
        self.hc_norm = GroupRMSNorm(hc * hidden, hidden, eps)
        self.input_mix_weight_down = nn.Linear(hc * hidden, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, hc * hidden, bias=False)
        self.block_inject_weight = nn.Linear(hc * hidden, hc, bias=False) if combine else None

    def forward(self, streams: torch.Tensor):
        normed = self.hc_norm(streams.flatten(-2))
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.hc)))
        mixed = (mix.unflatten(-1, (self.hc, self.hidden)) * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)
