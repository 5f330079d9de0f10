"""HY-V4 (``HYV4ForCausalLM``, ``model_type: hy_v4``) on vLLM's CPU platform: vLLM 0.32 has no CPU model
for it, so the plugin serves this package's (:class:`indexcache.models.hy_v4.HYV4ForCausalLM`: MLA with
the output gate and sinks, hyper-connections, the lightning indexer, IndexCache from the checkpoint's
``indexer_types`` or ``--hf-overrides``) over vLLM's paged caches (:mod:`.vllm_native`)."""

from indexcache.models.hy_v4 import HYV4ForCausalLM

from .vllm_native import NativeForCausalLM


class IndexCacheHYV4ForCausalLM(NativeForCausalLM):
    family = HYV4ForCausalLM
    architecture = "HYV4ForCausalLM"
