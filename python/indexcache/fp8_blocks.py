"""The block-FP8 weight format of the official DeepSeek-V3.2 / GLM-5 checkpoints: e4m3 weights
with one fp32 ``weight_scale_inv`` (amax / 448) per 128x128 block. Owned here, below both the
checkpoint reader (``loader``) and the sharded linears (``parallel``), which share it."""

from __future__ import annotations

import re

import torch

from indexcache.formats import FP8_LINEAR_NAMES, FP8_MAX, FP8_WEIGHT_AMAX_FLOOR, FP8_WEIGHT_BLOCK

# Linear weights that the official checkpoint stores in fp8 (and the writer quantizes).
FP8_WEIGHTS = re.compile(r"\.(" + "|".join(FP8_LINEAR_NAMES) + r")\.weight$")


def is_fp8_checkpoint(config: dict) -> bool:
    """config.json declares block-FP8 weights (the official DeepSeek-V3.2 / GLM-5 FP8 releases)."""
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "fp8"


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, name: str,
                          block: tuple = FP8_WEIGHT_BLOCK, offset: tuple = (0, 0)) -> torch.Tensor:
    """``weight`` e4m3 ``[out, in]`` times its per-block ``scale_inv`` ``[ceil(out/b0), ceil(in/b1)]``.
    ``offset``: where a slice's first row/column sits inside its first block (slices read per rank)."""
    rows, cols = weight.shape
    ro, co = offset
    want = (-(-(rows + ro) // block[0]), -(-(cols + co) // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
                         f"{rows}x{cols} weight in {block[0]}x{block[1]} blocks")
    s = scale_inv.float().repeat_interleave(block[0], 0)[ro:ro + rows].repeat_interleave(block[1], 1)[:, co:co + cols]
    return weight.float() * s


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple = FP8_WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv) with one scale (amax / 448) per block; inverse of the above."""
    w = weight.float()
    rows, cols = w.shape
    pr, pc = -(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]
    padded = torch.zeros(pr, pc)
    padded[:rows, :cols] = w
    tiles = padded.view(pr // block[0], block[0], pc // block[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=FP8_WEIGHT_AMAX_FLOOR) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(pr, pc)[:rows, :cols].contiguous()
    return q, scale
