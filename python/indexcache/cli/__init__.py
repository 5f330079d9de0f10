"""The ``indexcache`` command: ``app`` (the parser, ``plan``), ``generate``, ``patterns`` (overlap,
search, eval, train). The top wing: it imports everything below and nothing imports it."""

from .app import main

__all__ = ["main"]
