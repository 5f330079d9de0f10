"""Deprecated location (kept for one release): generation lives in :mod:`indexcache.runtime`
(``runtime.generation``, ``runtime.tokenizer``, ``runtime.sampling``)."""

import warnings

from indexcache.runtime.generation import GenerationResult, GenerationSettings, generate  # noqa: F401
from indexcache.runtime.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: F401

warnings.warn("indexcache.generation is deprecated: import from indexcache.runtime", DeprecationWarning, stacklevel=2)
