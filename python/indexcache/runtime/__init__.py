"""Generation over a model: prefill, one decode step and one speculative (MTP) round as separate
steps (``generate``), sampling, the CUDA-graph decode step and the tokenizers. Imports the
models; nothing in ``models`` imports this package."""

from .cuda_graph import DecodeStep, unsupported_reason
from .generation import GenerationResult, GenerationSettings, generate
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "DecodeStep", "GenerationResult", "GenerationSettings", "HFTokenizer", "generate",
           "load_tokenizer", "unsupported_reason"]
