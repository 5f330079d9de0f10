"""Rotary position embedding: the rotation itself and DeepSeek's YaRN-corrected frequencies."""

from __future__ import annotations

import math

import torch

from indexcache import ops

from ..args import ModelArgs
from .norms import fused_rows


def rope_fuses(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``apply_rope`` of ``x`` takes ``ops.rope`` (``norms.fused_rows``: CPU decode rows, no
    gradient to record; fp32 contiguous angles ``[N, R / 2]``, R even)."""
    return x.dim() in (2, 3) and fused_rows(x, cos, sin) and cos.dtype == sin.dtype == torch.float32 \
        and cos.is_contiguous() and sin.is_contiguous() and cos.shape == (x.shape[0], x.shape[-1] // 2) \
        and sin.shape == cos.shape and x.shape[-1] % 2 == 0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x [N, ..., 2m]`` by per-row angles (cos/sin fp32 ``[N, m]``).

    interleaved: pairs (x[2i], x[2i+1]) (MLA, DeepSeek reference layout); otherwise NeoX
    split-half pairs (x[i], x[i+m]) (the V3.2 indexer). On the CPU (``rope_fuses``): ``ops.rope``,
    one pass instead of 14 torch ops. ``out`` (x's shape and dtype; may be ``x`` itself, rotated in
    place) receives the result, which is returned.
    """
    if rope_fuses(x, cos, sin):
        return ops.rope(x, cos, sin, interleaved, out=out)
    r = _torch_rope(x, cos, sin, interleaved)
    return r if out is None else out.copy_(r)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """YaRN-corrected inverse frequencies (DeepSeek reference) and the cos/sin attention factor."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    ys = args.rope_scaling
    if ys is None:
        return inv, 1.0
    factor, orig = ys["factor"], ys["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(ys["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(ys["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    inv = inv / factor * ramp + inv * (1 - ramp)
    attn_factor = 1.0
    if ys["mscale"] and ys["mscale_all_dim"]:
        attn_factor = yarn_get_mscale(factor, ys["mscale"]) / yarn_get_mscale(factor, ys["mscale_all_dim"])
    return inv, attn_factor
