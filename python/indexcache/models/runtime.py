"""Deprecated location (kept for one release): one forward's state lives in :mod:`indexcache.models.state`."""

import warnings

from .state import BatchMeta, CacheManager, ForwardContext, PagedKVCache, StageTimer  # noqa: F401

warnings.warn("indexcache.models.runtime is deprecated: import from indexcache.models.state", DeprecationWarning,
              stacklevel=2)
