"""Deprecated location (kept for one release): this module lives in :mod:`indexcache.cli.patterns`."""

import warnings

from indexcache.cli import patterns as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
warnings.warn("indexcache.pattern_cli is deprecated: import from indexcache.cli.patterns", DeprecationWarning, stacklevel=2)
