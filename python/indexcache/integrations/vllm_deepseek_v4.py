"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, ``model_type: deepseek_v4``) on vLLM's CPU platform with
IndexCache over its CSA layers: this package's model (:mod:`indexcache.models.deepseek_v4`: sliding, CSA
and HCA attention over one pool of raw and compressed entries, the CSA lightning indexer, hash and
sqrt-softplus routing, manifold hyper-connections) over vLLM's paged caches (:mod:`.vllm_native`).

vLLM 0.32's own CPU model for the family (``vllm/models/deepseek_v4/cpu/``) is not used: it has no
IndexCache (the upstream change is an open, GPU-only pull request), its sparse kernels are AMX/AVX-512
builds, and its config reading goes through the pinned transformers (see docs/vllm.md).

Each layer's pool holds ``block_size`` raw rows plus ``ceil(block_size / rate)`` compressed rows per
vLLM block, and the compressors' carried state sits at the row of a request's first block; that state is
per request, so vLLM's prefix caching (which shares a first block between requests) is turned off for
this family at engine start (``vllm_patches``)."""

from .vllm_native import NativeForCausalLM


class IndexCacheDeepseekV4ForCausalLM(NativeForCausalLM):
    architecture = "DeepseekV4ForCausalLM"
    stateful = True  # per-request compressor state in the caches: no prefix caching

    def __init__(self, *, vllm_config, prefix: str = ""):
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("indexcache: DeepseekV4ForCausalLM keeps per-request compressor state in its caches; "
                             "serve it with --no-enable-prefix-caching")
        super().__init__(vllm_config=vllm_config, prefix=prefix)

    def resize_cache(self, cache, num_blocks: int) -> None:
        for store in cache.layers:
            if store is not None:
                store.raw_rows = num_blocks * self.block_size  # the raw rows come first in each pool


# ------------------------------------------------------------------------------------ config reading

from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config as _VllmDeepseekV4Config  # noqa: E402

V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_MLP_LAYER_TYPES = ("hash_moe", "moe")


class IndexCacheDeepseekV4Config(_VllmDeepseekV4Config):
    """vLLM's ``deepseek_v4`` config class with DeepSeek-V4's own layer kinds. vLLM's class checks
    ``mlp_layer_types`` by the pinned transformers' generic rule (``sparse`` / ``dense``), so a config.json
    written by transformers >= 5.20 (``hash_moe`` / ``moe``, what transformers' DeepseekV4Config defines)
    is refused before any model code: "The `mlp_layer_types` entries must be in ('sparse', 'dense')"."""

    def validate_layer_type(self):
        n = getattr(self, "num_hidden_layers", None)
        if n is None:
            return
        for name, allowed in (("layer_types", V4_LAYER_TYPES), ("mlp_layer_types", V4_MLP_LAYER_TYPES)):
            types = getattr(self, name, None)
            if types is None:
                continue
            if len(types) != n:
                raise ValueError(f"`num_hidden_layers` ({n}) must equal `len({name})` ({len(types)})")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"`{name}` entries must be one of {allowed} for DeepSeek-V4; got {bad}")
