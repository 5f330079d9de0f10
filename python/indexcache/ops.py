"""Typed, documented wrappers over ``torch.ops.indexcache`` and their fake (meta) kernels.

Shape names follow DESIGN.md §7: s_q query rows, s_kv keys, h heads, d head dim, topk.
Every op checks dtype, device, strides and shapes in C++ and raises RuntimeError naming
the argument; ``-1`` in an index means "no token" everywhere.
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers the ops)

_ops = torch.ops.indexcache


def fill_topk_buffer_(buf: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Set rows ``[:num_rows]`` of a shared top-k buffer to -1, in place.

    buf: int32 ``[max_num_batched_tokens, index_topk]``, rows contiguous (a column slice of a
    wider buffer is fine). ``num_rows`` larger than the buffer is an error. Returns ``buf``.
    """
    _ops.fill_topk_buffer_(buf, num_rows)
    return buf


@torch.library.register_fake("indexcache::fill_topk_buffer_")
def _fill_topk_buffer_fake(buf, num_rows):
    return None
