"""Engine integrations (DESIGN.md §12): ``transformers`` (``enable``) and the vLLM plugin.

Each submodule imports its engine lazily; this package imports nothing so that importing one
integration never pulls in another engine.
"""
