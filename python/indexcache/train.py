"""Deprecated location (kept for one release): this module lives in :mod:`indexcache.tools.train`."""

import warnings

from indexcache.tools import train as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
warnings.warn("indexcache.train is deprecated: import from indexcache.tools.train", DeprecationWarning, stacklevel=2)
