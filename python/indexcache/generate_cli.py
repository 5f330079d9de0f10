"""Deprecated location (kept for one release): this module lives in :mod:`indexcache.cli.generate`."""

import warnings

from indexcache.cli import generate as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
warnings.warn("indexcache.generate_cli is deprecated: import from indexcache.cli.generate", DeprecationWarning, stacklevel=2)
