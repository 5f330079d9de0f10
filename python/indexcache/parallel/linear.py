"""Sharded and FP8 linear layers: this rank's slice of a checkpoint linear, held in the model
dtype or as e4m3 with the checkpoint's fp32 128x128 block scales (DESIGN.md §11)."""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import _C, ops
from indexcache.formats import FP8_MAX, FP8_WEIGHT_AMAX_FLOOR, FP8_WEIGHT_BLOCK
from indexcache.fp8_blocks import quantize_fp8_blocks

FP8_BLOCK = FP8_WEIGHT_BLOCK[0]  # rows (and columns) per weight scale
# Up to this many rows (a decode step's requests, MTP verify rows) a CPU projection runs
# ops.rows_matmul where the CPU has its vectorised kernel: torch's bf16 matmul at one row spends
# most of its time on set-up (docs/profiling.md). More rows: torch's GEMM.
FEW_ROWS = 8
# A weight read in a wider dtype than it is held in (a bf16 LM head's fp32 logits) is widened this
# many bytes at a time (a block of its rows stays in cache), never as a whole copy.
WIDEN_BLOCK_BYTES = 4 << 20


@functools.cache
def _native_bf16_gemm() -> bool:
    """Whether torch's CPU GEMM runs bf16 at bf16 rates here: AVX-512 BF16 dot products or AMX tiles
    (oneDNN's bf16 kernels). Without them (an AVX2-only Zen 3, 2026-12-05) it runs bf16 x bf16 at
    8-9 GFLOP/s against fp32's 55-67 (docs/performance.md)."""
    f = _C._cpu_features()
    return bool(f["avx512bf16"] or f["amx_bf16"] or f["brgemm_bf16"])


def widen_16bit(*ts: torch.Tensor) -> bool:
    """Whether a CPU product of these bf16 tensors (no gradient to record) runs faster as fp32
    sums of the operands widened to fp32 on this CPU (no native bf16 GEMM): the same fp32 sums
    torch's bf16 GEMM makes, rounded once to bf16 at the end. Elsewhere False."""
    if not all(t.is_cpu and t.dtype == torch.bfloat16 for t in ts):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return not _native_bf16_gemm()


def einsum_16bit(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(eq, a, b)`` in a's dtype; bf16 operands on a CPU without a native bf16 GEMM
    are widened to fp32 for the product and the result rounded back (:func:`widen_16bit`)."""
    if widen_16bit(a, b):
        return torch.einsum(eq, a.float(), b.float()).to(a.dtype)
    return torch.einsum(eq, a, b)


def few_rows(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``x`` (``[.., M, K]``) through ``weights`` takes ``ops.rows_matmul``: CPU, at most
    ``FEW_ROWS`` rows, no gradient to record, and a vectorised kernel for the weight's dtype here.
    (Asked for every projection of a decode step: plain loops, no generator.)"""
    if not x.is_cpu or x.shape[-2] > FEW_ROWS or x.dtype not in _ISA_DTYPE:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    for w in weights:
        name = _ISA_DTYPE.get(w.dtype)
        if name is None or _rows_matmul_isa(name) not in _VECTOR_PATHS:
            return False
    return True


@torch.compiler.assume_constant_result
def _rows_matmul_isa(dtype_name: str) -> str:
    """The path ``rows_matmul`` takes for a ``dtype_name`` weight here (``_C._cpu_isa``); a compiled
    step reads it once, when it is traced (a later ``_C._set_cpu_isa`` reaches new compiles only)."""
    return _C._cpu_isa("rows_matmul", dtype_name)


_ISA_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # rows_matmul's dtypes, as _cpu_isa names them
_VECTOR_PATHS = ("avx512bf16", "avx2")  # the paths with a vectorised rows_matmul kernel (not portable)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x W^T`` in fp32 sums, rounded to ``out_dtype`` (default x's): a few rows on the CPU through
    ``ops.rows_matmul`` (any mix of fp32 / bf16), otherwise ``F.linear`` on the inputs cast to
    ``out_dtype`` (x's dtype when None); a weight held narrower than that is widened a block of
    ``WIDEN_BLOCK_BYTES`` at a time (no gradient to record) or whole (for autograd). On CUDA, 16-bit
    x and weight with fp32 out: one ``torch.mm(..., out_dtype=float32)`` where torch has it."""
    if x.dim() == 2 and weight.is_contiguous() and few_rows(x, weight):
        return ops.rows_matmul(x, weight, True, out_dtype=out_dtype)
    dt = out_dtype or x.dtype
    if dt == weight.dtype and widen_16bit(x, weight):
        return _linear_widened(x, weight)
    if weight.dtype == dt:
        return F.linear(x.to(dt), weight)
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x.is_cuda and x.dtype == weight.dtype != dt == torch.float32 and not grad:
        y = _mm_fp32(x.reshape(-1, x.shape[-1]), weight)  # cuBLAS: bf16 / fp16 inputs, fp32 sums and output
        if y is not None:
            return y.view(*x.shape[:-1], weight.shape[0])
    x = x.to(dt)
    rows = max(WIDEN_BLOCK_BYTES // (weight.shape[1] * torch.finfo(dt).bits // 8), 1)
    if weight.shape[0] <= rows or grad:
        return F.linear(x, weight.to(dt))
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for r0 in range(0, weight.shape[0], rows):
        out[..., r0:r0 + rows] = F.linear(x, weight[r0:r0 + rows].to(dt))
    return out


def _linear_widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 ``x W^T`` as fp32 GEMMs: x widened once, the weight in blocks of fp32 rows as large as
    that copy of x or ``WIDEN_BLOCK_BYTES``, whichever is larger (thin blocks starve the GEMM: V3.2's
    7168 x 1536 q_a_proj at 2048 rows ran at 0.57 of fp32's rate in 4 MB blocks), each block's fp32
    sums rounded into the bf16 result."""
    xf = x.float()
    rows = max(max(WIDEN_BLOCK_BYTES, xf.numel() * 4) // (weight.shape[1] * 4), 1)
    if weight.shape[0] <= rows:
        return F.linear(xf, weight.float()).to(x.dtype)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for r0 in range(0, weight.shape[0], rows):
        out[..., r0:r0 + rows] = F.linear(xf, weight[r0:r0 + rows].float())
    return out


def _mm_fp32(x: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """``x W^T`` with fp32 output from 16-bit inputs (``torch.mm``'s ``out_dtype``, CUDA), or None
    where this torch has no such kernel (the caller widens the weight block by block instead)."""
    try:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` (same parameters, same checkpoint names) whose forward is
    :func:`linear`: decode rows on the CPU skip torch's GEMM set-up."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def _dequant_block_row(weight: torch.Tensor, scale_row: torch.Tensor, col_off: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of one 128-row block: e4m3 ``[r, in]`` x its block scales ``[blocks]`` -> ``dtype``."""
    s = scale_row.float().repeat_interleave(FP8_BLOCK)[col_off:col_off + weight.shape[1]]
    return (weight.float() * s).to(dtype)


class ShardedLinear(nn.Module):
    """``y = x W^T`` for this rank's slice of a checkpoint linear, held in the model dtype or as FP8.

    ``shard_dim`` 0: output rows ``shard`` of the checkpoint weight (column parallel); 1: input
    columns (row parallel: the caller all-reduces the partial sums); None: the whole weight. An FP8
    weight keeps the checkpoint's 128x128 block scales; a slice not aligned to 128 keeps the
    offset of its first row/column inside the first block (``row_off`` / ``col_off``).
    """

    def __init__(self, in_features: int, out_features: int, shard_dim: Optional[int],
                 shard: Optional[tuple[int, int]], fp8: bool):
        super().__init__()
        self.full_shape = (out_features, in_features)
        self.shard_dim, self.shard = shard_dim, shard
        o, i = out_features, in_features
        self.row_off = self.col_off = 0
        if shard_dim == 0:
            o = shard[1] - shard[0]
            self.row_off = shard[0] % FP8_BLOCK
        elif shard_dim == 1:
            i = shard[1] - shard[0]
            self.col_off = shard[0] % FP8_BLOCK
        self.in_features, self.out_features, self.fp8 = i, o, fp8
        if fp8:
            self.weight = nn.Parameter(torch.empty(o, i, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-(self.row_off + o) // FP8_BLOCK), -(-(self.col_off + i) // FP8_BLOCK)),
                requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(o, i))
        self._scaled_mm_ok = True

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, shard_dim={self.shard_dim}, shard={self.shard}, "
                f"fp8={self.fp8}")

    def checkpoint_slice(self) -> tuple[Optional[int], Optional[tuple[int, int]]]:
        return self.shard_dim, self.shard

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (dequantized whole: for the absorbed MLA einsums)."""
        if not self.fp8:
            return self.weight.to(dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.weight.device)
        for b, r0, r1 in self._block_rows():
            out[r0:r1] = _dequant_block_row(self.weight[r0:r1], self.weight_scale_inv[b], self.col_off, dtype)
        return out

    def _block_rows(self):
        for b in range(self.weight_scale_inv.shape[0]):
            r0, r1 = max(0, b * FP8_BLOCK - self.row_off), min(self.out_features, (b + 1) * FP8_BLOCK - self.row_off)
            if r1 > r0:
                yield b, r0, r1

    @torch.no_grad()
    def set_dense(self, w: torch.Tensor) -> None:
        """Fill from a dense ``[out, in]`` slice (quantizing in aligned blocks when FP8)."""
        if not self.fp8:
            self.weight.copy_(w)
            return
        padded = torch.zeros(self.row_off + w.shape[0], self.col_off + w.shape[1], dtype=torch.float32)
        padded[self.row_off:, self.col_off:] = w.float()
        q, s = quantize_fp8_blocks(padded)
        self.weight.copy_(q[self.row_off:, self.col_off:])
        self.weight_scale_inv.copy_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return linear(x, self.weight)
        if x.is_cuda and self._scaled_mm_ok:
            y = self._forward_scaled_mm(x)
            if y is not None:
                return y
        x2 = x.reshape(-1, self.in_features)
        y = x2.new_empty(x2.shape[0], self.out_features)
        xw = x2.float() if widen_16bit(x2) else None  # bf16 products as fp32 GEMMs here (widen_16bit)
        for b, r0, r1 in self._block_rows():
            w = _dequant_block_row(self.weight[r0:r1], self.weight_scale_inv[b], self.col_off, x.dtype)
            y[:, r0:r1] = x2 @ w.t() if xw is None else xw @ w.float().t()
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_scaled_mm(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Hopper block-scaled FP8 GEMM: activations quantized 1x128 per token, weight scales 128x128.
        Written against torch's ``scaled_mm`` API; not run on this project's CPU machines, so any
        failure disables it for this layer (with one warning) and the dequant path runs instead."""
        ST = getattr(F, "ScalingType", None)
        if ST is None or not hasattr(F, "scaled_mm") or self.row_off or self.col_off \
                or self.in_features % FP8_BLOCK or self.out_features % FP8_BLOCK or x.dtype != torch.bfloat16:
            return None
        try:
            x2 = x.reshape(-1, self.in_features)
            m = x2.shape[0]
            g = x2.float().view(m, -1, FP8_BLOCK)
            sa = g.abs().amax(-1).clamp(min=FP8_WEIGHT_AMAX_FLOOR) / FP8_MAX                      # [M, K/128]
            xq = (g / sa.unsqueeze(-1)).to(torch.float8_e4m3fn).view(m, -1)
            sa = sa.t().contiguous().t()                                          # outer-dim-major scales
            y = F.scaled_mm(xq, self.weight.t(), sa, ST.BlockWise1x128, self.weight_scale_inv, ST.BlockWise128x128,
                            output_dtype=torch.bfloat16)
            return y.view(*x.shape[:-1], self.out_features)
        except (RuntimeError, TypeError, NotImplementedError) as e:
            self._scaled_mm_ok = False
            warnings.warn(f"block-scaled FP8 matmul unavailable ({str(e).splitlines()[0][:120]}); "
                          "dequantizing block-rows instead", RuntimeWarning, stacklevel=3)
            return None


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight in ``dtype``, whatever it holds (plain, sharded, FP8)."""
    if isinstance(linear, ShardedLinear):
        return linear.dense_weight(dtype)
    return linear.weight if linear.weight.dtype == dtype else linear.weight.to(dtype)
