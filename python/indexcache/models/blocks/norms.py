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
        w, b = self._fp32_params()
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps).to(x.dtype)

    def _fp32_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """weight and bias in fp32. A 16-bit pair is widened once and reused while the parameters
        are the same tensors at the same version (``load_state_dict`` copies in place and bumps it;
        a new parameter or ``.to()`` is a new tensor); recomputed while gradients are on (autograd
        sees the cast, no inference-mode copy is saved for backward) or for inference-tensor
        parameters (no version counter); in a compiled step's trace (the compiler folds the casts)."""
        w, b = self.weight, self.bias
        if w.dtype == b.dtype == torch.float32:
            return w, b
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or w.is_inference() or b.is_inference():
            return w.float(), b.float()
        key = tuple((p._version, p.data_ptr(), p.dtype, p.device) for p in (w, b))
        cached = self.__dict__.get("_fp32_cache")
        if cached is None or cached[0] is not w or cached[1] is not b or cached[2] != key:
            with torch.no_grad():
                cached = self.__dict__["_fp32_cache"] = (w, b, key, (w.float(), b.float()))
        return cached[3]
