"""Deprecated location (kept for one release): this module lives in :mod:`indexcache.tools.aware`."""

import warnings

from indexcache.tools import aware as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
warnings.warn("indexcache.train_aware is deprecated: import from indexcache.tools.aware", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    from indexcache.tools import aware_table

    raise SystemExit(aware_table._main())
