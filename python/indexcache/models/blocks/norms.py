"""The norms of a DSA block (computed in fp32, returned in the input's dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import ops
from indexcache.parallel.linear import FEW_ROWS


def fused_rows(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether a row-wise small op on ``x [.., D]`` (RMSNorm here, RoPE in rope.py) takes its fused
    CPU kernel (``ops.rms_norm`` / ``ops.rope``): CPU, fp32 / bf16, last dim contiguous, no gradient
    to record, and at most ``FEW_ROWS`` rows (decode rows, where torch's dozen ops a call cost their
    dispatch, not their arithmetic). Prompt rows keep torch's ops: an engine's own model (vLLM's, in
    fp32) rounds its norms that way, and a last-bit difference there can flip an indexer near-tie."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() < 2 or x.stride(-1) != 1:
        return False
    if any(p.dtype not in (torch.float32, torch.bfloat16) for p in params):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return False
    return x.shape[0] <= FEW_ROWS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_rows(x, self.weight):
            return ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)
