"""Reference models that run IndexCache end to end."""

from .deepseek_v32 import BatchMeta, DeepseekV32ForCausalLM, ModelArgs, PagedKVCache

__all__ = ["BatchMeta", "DeepseekV32ForCausalLM", "ModelArgs", "PagedKVCache"]
