"""Deprecated location (kept for one release): this module lives in :mod:`indexcache.tools.patterns`."""

import warnings

from indexcache.tools import patterns as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
warnings.warn("indexcache.patterns is deprecated: import from indexcache.tools.patterns", DeprecationWarning, stacklevel=2)
