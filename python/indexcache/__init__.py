"""IndexCache: cross-layer top-k index reuse for DeepSeek Sparse Attention models.

Kernels live in ``torch.ops.indexcache`` (typed wrappers in :mod:`indexcache.ops`).
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the ops and the plan module)
from .config import IndexCacheConfig
from .plan import LayerPlan, build_info, build_layer_plan

__all__ = ["IndexCacheConfig", "LayerPlan", "build_info", "build_layer_plan"]
__version__ = "0.1.0"
