"""Deprecated location (kept for one release): the CUDA-graph decode step lives in
:mod:`indexcache.runtime.cuda_graph`."""

import warnings

from indexcache.runtime.cuda_graph import DecodeStep, unsupported_reason  # noqa: F401

warnings.warn("indexcache.models.cuda_graph is deprecated: import from indexcache.runtime.cuda_graph",
              DeprecationWarning, stacklevel=2)
