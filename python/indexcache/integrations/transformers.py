"""Make a transformers DSA model truly sparse: ``enable(model)`` (DESIGN.md §10, §12).

transformers' ``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM`` and ``HYV4ForCausalLM`` score every key with an
fp32 matmul, expand K and V of every cached token through ``kv_b_proj`` and then run dense
attention under a top-k mask, so prefill and decode stay quadratic in context. ``enable``
replaces, in place, the ``forward`` of each layer's attention module with absorbed sparse MLA
over this package's ops, keeping the model's own weights and its ``forward`` / ``generate()``:

- **Absorbed MLA.** ``kv_b_proj.weight`` is split into W_UK ``[h, nope, latent]`` and W_UV
  ``[h, v, latent]`` as views (no copy; the weight and its state-dict entry are unchanged). A query becomes
  ``[q_nope · W_UK | q_rope]`` (576 wide); ``ops.sparse_mla`` attends the latent cache at the
  selected slots only; the 512-wide result goes through W_UV and ``o_proj``.
- **Caches inside transformers' cache object.** Each layer's latent KV (normed ``kv_c`` and the
  RoPE'd key, 576 values per token) is stored as the *keys* of its ``DynamicIndexedLayer`` (the
  values are zero-wide), and the index-K cache of F layers through ``update_indexer``: 132-byte
  rows (128 e4m3 bytes after the Hadamard rotation, then the fp32 power-of-two scale), or the
  unquantized keys with ``indexer_fp8=False``. transformers' own ``crop``, ``reorder_cache``
  (beam search), ``batch_repeat_interleave`` and ``batch_select_indices`` therefore act on them
  unchanged. Static and quantized caches are refused (their layers preallocate transformers'
  expanded shapes).
- **Fused scoring + top-k** (``ops.indexer_topk``) over each query row's window, read from the
  4-D attention mask transformers builds (causal, left/right padding, packed sequences): every
  row's visible keys must form one contiguous run, anything else is a clear error.
- **IndexCache** from the model's config and ``hf_overrides`` with DESIGN §2's precedence
  (``IndexCacheConfig``): F layers write the top-k slots of this forward pass, S layers reuse
  those of the nearest earlier F layer; S layers' indexer modules are detached.

Everything ``enable`` changes on the model is listed in ``CHANGES`` (and, for one model, in
``model.indexcache_changes``); it checks every layer before it changes any, and ``disable(model)``
puts each change back, in reverse order.

Results: with ``indexer_fp8=False`` the scores are transformers' (unquantized fp32) and the logits
equal its own model's; the default (``None`` / ``True``) scores in fp8 after the Hadamard rotation
as the checkpoints were trained (DESIGN §4). Ties in the top-k go to the lower position.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch

from indexcache import ops
from indexcache.config import IndexCacheConfig, parse_overrides
from indexcache.models.blocks.indexer import fp8_key_inputs, fp8_query_inputs, fp32_query_inputs
from indexcache.models.blocks.mla import absorb_queries, absorbed_values
from indexcache.plan import LayerPlan

# The transformers releases this integration was built and tested against. It replaces the attention
# module's forward and reads transformers' cache layers, whose signatures move between releases, so
# a version outside the range is refused rather than run on trust (the range is also the
# ``indexcache[transformers]`` extra in setup.py).
SUPPORTED_TRANSFORMERS = (">=5.24.0", "<5.25")
# The kernels' widths (DESIGN §4, §5): every production DSA checkpoint has them.
KERNEL_WIDTHS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
# --hf-overrides keys beyond IndexCache's that enable() can still honour on a loaded model.
EXTRA_OVERRIDE_KEYS = ("index_topk", "indexer_hadamard")


@dataclass(frozen=True)
class _Family:
    name: str
    module: str  # transformers.models.<module>.modeling_<module>
    causal_lm: str
    attention: str
    indexer_rope: str  # name of the RoPE function the indexer uses in that module
    returns_topk: bool  # GLM's attention returns (out, weights, topk) and reads prev_topk_indices
    # transformers' interleaved RoPE returns the rotated pairs de-interleaved ([evens | odds]); a dot
    # product does not care, but the Hadamard rotation before fp8 does: the checkpoints (and vLLM, and
    # this project's model) rotate in place, so the fp8 path restores the interleaved layout
    indexer_rope_deinterleaved: bool
    mla_rope: str = "apply_rotary_pos_emb_interleave"  # name of the RoPE function MLA uses in that module
    indexer_rope_tail: bool = False  # HY-V4's indexer rotates its last qk_rope_head_dim dims, not its first


FAMILIES = {
    "DeepseekV32ForCausalLM": _Family("deepseek_v32", "deepseek_v32", "DeepseekV32ForCausalLM", "DeepseekV32Attention",
                                      "apply_rotary_pos_emb", False, False),
    "GlmMoeDsaForCausalLM": _Family("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaForCausalLM", "GlmMoeDsaAttention",
                                    "apply_rotary_pos_emb_interleave", True, True),
    # HY-V4: NeoX RoPE on MLA and on the indexer's last 64 dims; sinks and the output gate (read
    # from the attention module when it has them)
    "HYV4ForCausalLM": _Family("hy_v4", "hy_v4", "HYV4ForCausalLM", "HYV4Attention", "apply_rotary_pos_emb", True,
                               False, mla_rope="apply_rotary_pos_emb", indexer_rope_tail=True),
}


def _installed_version() -> str:
    try:
        import transformers
    except ImportError:
        raise ValueError("indexcache.integrations.transformers needs transformers "
                         f"{','.join(SUPPORTED_TRANSFORMERS)}: pip install 'indexcache[transformers]'") from None
    return transformers.__version__


def check_transformers_version(version: Optional[str] = None) -> str:
    """The installed transformers version, or a ``ValueError`` when it is outside the supported range."""
    if version is None:
        version = _installed_version()
    from packaging.version import Version  # a dependency of transformers
    lo, hi = Version(SUPPORTED_TRANSFORMERS[0][2:]), Version(SUPPORTED_TRANSFORMERS[1][1:])
    v = Version(version)
    if not (lo <= v < hi):
        raise ValueError(f"transformers {version} is not supported by indexcache.integrations.transformers "
                         f"(supported: {','.join(SUPPORTED_TRANSFORMERS)}); it replaces the attention forward and "
                         "reads transformers' cache layers, which change between releases")
    return version


# ----------------------------------------------------------------------------- per-model state

@dataclass
class _State:
    family: _Family
    plan: LayerPlan
    ic_config: IndexCacheConfig
    fp8: bool
    hadamard: bool
    index_topk: int
    rope_mla: Callable
    rope_indexer: Callable
    # per forward pass (reset by a pre-hook on the decoder stack)
    windows: Optional[tuple] = None  # (ks, ke) int32 [B, S] of the current forward
    slots: Optional[torch.Tensor] = None  # int32 [B * S, index_topk]: the last F layer's selection
    topk_buffer: Optional[torch.Tensor] = None  # grown as needed, reused across passes (DESIGN §3)
    hook: Any = None
    layers: list = field(default_factory=list)
    undo: list = field(default_factory=list)  # _Undo entries, in the order enable() made them
    placed: Any = None  # (dtype, device) of the model's first parameter when enable() ran

    def reset(self) -> None:
        self.windows, self.slots = None, None

    def buffer(self, rows: int, device) -> torch.Tensor:
        buf = self.topk_buffer
        if buf is None or buf.shape[0] < rows or buf.device != device:
            self.topk_buffer = buf = torch.empty((max(rows, 1), self.index_topk), dtype=torch.int32, device=device)
        return buf


def _windows(mask: Optional[torch.Tensor], batch: int, s_q: int, s_kv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's visible keys ``[ks, ke)`` from transformers' 4-D mask ``[B, 1, S, T]``
    (bool: True = visible; float: 0 = visible). The visible keys of a row must be one contiguous run."""
    if mask is None:  # plain causal over the whole cache
        ke = torch.arange(s_kv - s_q + 1, s_kv + 1, dtype=torch.int32, device=device).expand(batch, s_q).contiguous()
        return torch.zeros_like(ke), ke
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != s_q or mask.shape[3] < s_kv:
        raise ValueError(f"indexcache: expected a [batch, 1, {s_q}, {s_kv}] attention mask, got {tuple(mask.shape)}")
    visible = mask[:, 0, :, :s_kv]
    visible = visible if visible.dtype == torch.bool else visible == 0
    if visible.shape[0] != batch:
        visible = visible.expand(batch, -1, -1)
    count = visible.sum(-1, dtype=torch.int32)
    first = visible.to(torch.uint8).argmax(-1).to(torch.int32)
    last = s_kv - visible.flip(-1).to(torch.uint8).argmax(-1).to(torch.int32)
    empty = count == 0
    ks = torch.where(empty, torch.zeros_like(first), first)
    ke = torch.where(empty, torch.zeros_like(last), last)
    if not torch.equal(ke - ks, count):
        raise ValueError("indexcache: this attention mask gives a query row visible keys that are not one contiguous "
                         "run; supported masks are causal with left/right padding or packed sequences")
    return ks.contiguous(), ke.contiguous()


def _check_cache(cache, layer_idx: int) -> None:
    from transformers.cache_utils import DynamicIndexedLayer

    if len(cache.layers) <= layer_idx:
        return  # created lazily by update()
    layer = cache.layers[layer_idx]
    if type(layer) is not DynamicIndexedLayer:
        raise ValueError(f"indexcache: layer {layer_idx}'s cache is a {type(layer).__name__}; an enabled model stores "
                         "its latent and index-K caches in transformers' DynamicCache (DynamicIndexedLayer) only. "
                         "Use the default cache (no cache_implementation='static' / quantized caches)")
    if layer.is_initialized and layer.keys.numel() and (layer.values.shape[-1] != 0 or layer.keys.shape[1] != 1):
        raise ValueError(f"indexcache: layer {layer_idx}'s cache was filled by the model before enable() "
                         "(expanded keys/values); start a new cache")


# ----------------------------------------------------------------------------- the attention forward

def _indexer_topk(attn, state: _State, hidden_states, q_resid, cos, sin, cache, ks, ke, s_kv) -> torch.Tensor:
    """Run the layer's own indexer weights through the fused kernels; returns int32 [B*S, topk] slots."""
    idx = attn.indexer
    b, s, _ = hidden_states.shape
    h, d, r = idx.n_heads, idx.head_dim, idx.qk_rope_head_dim
    tail = state.family.indexer_rope_tail
    q = idx.wq_b(q_resid).view(b, s, h, d)
    k = idx.k_norm(idx.wk(hidden_states).to(idx.k_norm.weight.dtype)).to(hidden_states.dtype).unsqueeze(2)
    if tail:
        (q_pass, q_rot), (k_pass, k_rot) = torch.split(q, [d - r, r], dim=-1), torch.split(k, [d - r, r], dim=-1)
    else:
        (q_rot, q_pass), (k_rot, k_pass) = torch.split(q, [r, d - r], dim=-1), torch.split(k, [r, d - r], dim=-1)
    q_rot, k_rot = state.rope_indexer(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    if state.fp8 and state.family.indexer_rope_deinterleaved:
        q_rot = torch.stack(q_rot.chunk(2, dim=-1), dim=-1).flatten(-2)
        k_rot = torch.stack(k_rot.chunk(2, dim=-1), dim=-1).flatten(-2)
    q = torch.cat([q_pass, q_rot] if tail else [q_rot, q_pass], dim=-1).reshape(b * s, h, d)
    k = torch.cat([k_pass, k_rot] if tail else [k_rot, k_pass], dim=-1).reshape(b * s, d)
    w = idx.weights_proj(hidden_states.to(idx.weights_proj.weight.dtype)).float().reshape(b * s, h)
    if state.fp8:
        q_in, weights = fp8_query_inputs(q, w, state.hadamard)
        k_val, k_scale = fp8_key_inputs(k, state.hadamard)
        rows = torch.cat((k_val.view(torch.uint8), k_scale.view(torch.uint8).view(-1, 4)), dim=-1)  # [B*S, 132]
        new_keys = rows.view(b, s, d + 4)
    else:
        q_in, weights = fp32_query_inputs(q, w, d)
        new_keys = k.view(b, s, d)
    keys = cache.update_indexer(new_keys, attn.layer_idx) if cache is not None else new_keys
    if keys.shape[1] != s_kv:
        raise ValueError(f"indexcache: layer {attn.layer_idx}'s index-K cache holds {keys.shape[1]} tokens but its "
                         f"KV cache {s_kv}; was the cache filled with another IndexCache plan?")
    buf = state.buffer(b * s, q.device)
    for i in range(b):
        rows = slice(i * s, (i + 1) * s)
        if state.fp8:
            k_in = keys[i, :, :d].contiguous().view(torch.float8_e4m3fn)
            k_sc = keys[i, :, d:].contiguous().view(torch.float32).reshape(-1)
        else:
            k_in, k_sc = keys[i].float().contiguous(), None
        ops.indexer_topk(q_in[rows], k_in, k_sc, weights[rows], ks[i], ke[i], state.index_topk, out=buf[rows])
    pos = buf[: b * s]
    # request-relative positions (from ks) -> slots of the flattened [B * T] latent cache
    base = (torch.arange(b, dtype=torch.int32, device=ks.device).unsqueeze(1) * s_kv + ks).reshape(-1, 1)
    return torch.where(pos >= 0, pos + base, torch.full_like(pos, -1))


def _absorbed_weights(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK ``[h, nope, latent]`` and W_UV ``[h, v, latent]``: views of the live ``kv_b_proj.weight``
    (no copy; taken per call so that ``model.to(...)`` after ``enable`` is followed)."""
    nope = attn.qk_nope_head_dim
    w = attn.kv_b_proj.weight.view(attn.num_heads, nope + attn.v_head_dim, attn.kv_lora_rank)
    return w[:, :nope], w[:, nope:]


def _make_forward(state: _State, layer_pos: int):
    full = not state.plan.skip_topk[layer_pos]

    def forward(attn, hidden_states, position_embeddings=None, attention_mask=None, cache=None, position_ids=None,
                prev_topk_indices=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if attn.training:
            raise RuntimeError("indexcache: an enabled model runs inference only (the sparse ops have no backward); "
                               "call model.eval()")
        with torch.no_grad():
            out = _attend(attn, hidden_states, position_embeddings, attention_mask, cache)
        return (out, None, None) if state.family.returns_topk else (out, None)

    def _attend(attn, hidden_states, position_embeddings, attention_mask, cache):
        b, s, _ = hidden_states.shape
        h, nope, rope, latent = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
        q = attn.q_b_proj(q_resid).view(b, s, h, nope + rope).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
        kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [latent, rope], dim=-1)
        k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, s, latent)
        cos, sin = position_embeddings
        q_rot, k_rot = state.rope_mla(q_rot, k_rot.view(b, 1, s, rope), cos, sin)
        new_kv = torch.cat((k_pass, k_rot), dim=-1)  # [B, 1, S, 576]: the latent cache row
        if cache is not None:
            _check_cache(cache, attn.layer_idx)
            kv, _ = cache.update(new_kv, new_kv[..., :0], attn.layer_idx)
        else:
            kv = new_kv
        s_kv = kv.shape[2]
        if state.windows is None:
            state.windows = _windows(attention_mask, b, s, s_kv, hidden_states.device)
        ks, ke = state.windows
        if full:
            state.slots = _indexer_topk(attn, state, hidden_states, q_resid, cos, sin, cache, ks, ke, s_kv)
        elif state.slots is None or state.slots.shape[0] != b * s:
            raise RuntimeError(f"indexcache: layer {attn.layer_idx} reuses top-k indices but no F layer wrote them in "
                               "this forward pass")
        w_uk, w_uv = _absorbed_weights(attn)
        q_abs = absorb_queries(q_nope.transpose(1, 2).reshape(b * s, h, nope),
                               q_rot.transpose(1, 2).reshape(b * s, h, rope), w_uk.to(q_nope.dtype)).contiguous()
        kv_flat = kv.reshape(b * s_kv, 1, latent + rope)
        if not kv_flat.is_contiguous():  # after transformers' crop() of a batch
            kv_flat = kv_flat.contiguous()
        sinks = getattr(attn, "sinks", None)  # HY-V4: one fp32 softmax logit per head
        sinks = None if sinks is None else sinks.detach().float().contiguous()
        out, _ = ops.sparse_mla(q_abs.to(kv_flat.dtype), kv_flat, state.slots, attn.scaling, d_v=latent, sinks=sinks)
        gate = attn.gate_proj(hidden_states) if getattr(attn, "gate_proj", None) is not None else None  # HY-V4
        o = absorbed_values(out.to(hidden_states.dtype), w_uv.to(hidden_states.dtype), gate)
        return attn.o_proj(o.reshape(b, s, h * o.shape[-1]))

    return forward


# ----------------------------------------------------------------------------- enable / disable

# Every change enable() makes to a model, in the order it makes them; disable() undoes them in
# reverse. Nothing else of the model (weights, modules, their classes) is touched.
CHANGES = (
    "model.model.layers[i].self_attn.forward (every DSA layer): an instance attribute, the absorbed sparse "
    "forward, which hides the class's forward",
    "model.model.layers[i].self_attn.indexer (S layers): detached (None), so an S layer owns no indexer "
    "(DESIGN §4) and the state dict lacks its weights while enabled; the module is kept for disable()",
    "model.model.layers[i].self_attn.skip_topk (S layers of GLM-5 / HY-V4, which have it): True",
    "model.model: a forward pre-hook that resets the per-forward windows and selection",
    "model.config._attn_implementation: 'sdpa' (transformers then builds a bool mask; the attention "
    "implementation itself is never called)",
    "model._indexcache_state, model.indexcache_plan, model.indexcache_summary, model.indexcache_changes: set",
)
_ABSENT = object()


@dataclass
class _Undo:
    """One attribute enable() set: ``undo()`` restores ``old``, or deletes the attribute when the
    object had no value of its own (``_ABSENT``: a class attribute such as ``forward`` showed)."""
    obj: Any
    name: str
    old: Any

    def undo(self) -> None:
        if self.old is _ABSENT:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.old)


def _change(state: _State, obj, name: str, value, own: bool = True) -> None:
    state.undo.append(_Undo(obj, name, getattr(obj, name) if own else _ABSENT))
    setattr(obj, name, value)


def _family_of(model) -> _Family:
    fam = FAMILIES.get(type(model).__name__)
    if fam is not None:
        import importlib

        mod = importlib.import_module(f"transformers.models.{fam.module}.modeling_{fam.module}")
        if isinstance(model, getattr(mod, fam.causal_lm)):
            return fam
    raise ValueError(f"indexcache.integrations.transformers.enable: {type(model).__module__}.{type(model).__name__} "
                     f"is not supported; supported transformers classes: {', '.join(sorted(FAMILIES))} "
                     "(MiniMax-M3 and DeepSeek-V4 join when their blocks are served)")


def _check_model(model, indexer_fp8) -> None:
    if getattr(model, "_indexcache_state", None) is not None:
        raise ValueError("indexcache: enable() was already called on this model (disable() undoes it)")
    if indexer_fp8 not in (None, True, False):
        raise ValueError(f"indexer_fp8 must be None, True or False, got {indexer_fp8!r}")
    bad = {k: getattr(model.config, k) for k, v in KERNEL_WIDTHS.items() if getattr(model.config, k) != v}
    if bad:
        raise ValueError(f"indexcache: the sparse kernels need {KERNEL_WIDTHS}; this model has "
                         f"{', '.join(f'{k}={v}' for k, v in bad.items())}")


def _plan_of(config, hf_overrides) -> tuple[IndexCacheConfig, LayerPlan, int, bool]:
    """(IndexCache config, plan, index_topk, Hadamard) from the model's config and the overrides."""
    overrides = parse_overrides(hf_overrides)
    unknown = sorted(k for k in overrides
                     if k not in EXTRA_OVERRIDE_KEYS and k not in ("use_index_cache", "index_topk_freq",
                                                                   "index_topk_pattern", "index_skip_topk_offset",
                                                                   "indexer_types"))
    if unknown:
        raise ValueError(f"indexcache: enable() cannot apply --hf-overrides {', '.join(unknown)} to a loaded model "
                         f"(it takes IndexCache keys and {', '.join(EXTRA_OVERRIDE_KEYS)}); set them on the config "
                         "before from_pretrained")
    ic_overrides = {k: v for k, v in overrides.items() if k not in EXTRA_OVERRIDE_KEYS}
    ic = IndexCacheConfig.from_config(config.to_dict(), ic_overrides)
    plan = ic.plan(config.num_hidden_layers, 0)  # transformers does not load MTP layers
    index_topk = overrides.get("index_topk", config.index_topk)
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"index_topk must be an integer >= 1, got {index_topk!r}")
    hadamard = overrides.get("indexer_hadamard", getattr(config, "indexer_hadamard", True))
    if not isinstance(hadamard, bool):
        raise ValueError(f"indexer_hadamard must be true or false, got {hadamard!r}")
    return ic, plan, index_topk, hadamard


def _check_layers(layers, fam: _Family, plan: LayerPlan) -> None:
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if type(attn).__name__ != fam.attention:
            raise ValueError(f"indexcache: layer {i}'s attention is a {type(attn).__name__}, expected {fam.attention}")
        if not plan.skip_topk[i] and getattr(attn, "indexer", None) is None:
            raise ValueError(f"indexcache: the plan makes layer {i} F (it computes top-k) but the loaded model has no "
                             f"indexer there (config.indexer_types says 'shared'); reload the model with the indexer "
                             "weights, e.g. from_pretrained(..., indexer_types=[...]) with that layer 'full'")
        _absorbed_weights(attn)  # the split must fit the loaded weight


def _apply(model, state: _State, layers) -> None:
    """Every change of CHANGES, each recorded for disable()."""
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if state.plan.skip_topk[i]:
            _change(state, attn, "indexer", None)
            if hasattr(attn, "skip_topk"):
                _change(state, attn, "skip_topk", True)
        _change(state, attn, "forward", types.MethodType(_make_forward(state, i), attn), own=False)
        state.layers.append(attn)
    state.hook = model.model.register_forward_pre_hook(lambda module, args: state.reset())
    # sdpa's mask is bool (1 byte per query-key pair) where eager's is fp32 (4 GiB at 32K tokens)
    _change(state, model.config, "_attn_implementation", "sdpa")
    summary = state.ic_config.describe(state.plan) + f"; indexer {'fp8' if state.fp8 else 'fp32'}" + (
        " + Hadamard" if state.fp8 and state.hadamard else "")
    for name, value in (("_indexcache_state", state), ("indexcache_plan", state.plan),
                        ("indexcache_summary", summary), ("indexcache_changes", CHANGES)):
        _change(state, model, name, value, own=False)


def enable(model, *, hf_overrides: Union[None, str, Mapping[str, Any]] = None, indexer_fp8: Optional[bool] = None):
    """Make a loaded transformers DSA model truly sparse, in place; returns it.

    model: a transformers ``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM`` or ``HYV4ForCausalLM`` (CPU or CUDA,
    fp32 or bf16) with the kernels' widths (kv_lora_rank 512, qk_rope_head_dim 64,
    index_head_dim 128). hf_overrides: vLLM's ``--hf-overrides`` JSON (object or string):
    IndexCache keys with DESIGN §2's precedence over the config, plus ``index_topk`` and
    ``indexer_hadamard``. indexer_fp8: None/True score in fp8 after the Hadamard rotation (the
    checkpoints' trained numerics, DESIGN §4); False keeps transformers' unquantized fp32 scores.

    What it changes is ``CHANGES`` (weights are never copied or altered; S layers' indexers are
    detached, so the state dict lacks them while enabled); every check runs before the first
    change, so a refused call leaves the model as it was, and ``disable(model)`` undoes a call.
    After it, ``model.indexcache_plan`` is the LayerPlan in force and ``model.indexcache_summary``
    describes it. Raises ``ValueError`` for an unsupported class, transformers version, widths,
    override key, or a plan needing an indexer the loaded model does not have.
    """
    check_transformers_version()
    fam = _family_of(model)
    _check_model(model, indexer_fp8)
    ic, plan, index_topk, hadamard = _plan_of(model.config, hf_overrides)
    import importlib

    mod = importlib.import_module(f"transformers.models.{fam.module}.modeling_{fam.module}")
    layers = model.model.layers[:model.config.num_hidden_layers]
    _check_layers(layers, fam, plan)
    first = next(model.parameters())
    state = _State(fam, plan, ic, fp8=indexer_fp8 is not False, hadamard=hadamard, index_topk=index_topk,
                   rope_mla=getattr(mod, fam.mla_rope), rope_indexer=getattr(mod, fam.indexer_rope),
                   placed=(first.dtype, first.device))
    _apply(model, state, layers)
    return model


def disable(model):
    """Undo ``enable(model)``: every change of ``CHANGES``, in reverse order; returns the model.

    The model runs transformers' own attention again, with the same weights. S layers' indexers
    are attached again; when the model was moved or cast after ``enable`` (``model.to(...)``),
    they follow it there (detached, they did not move with it). A cache filled while enabled
    holds the latent layout and cannot be continued by the restored model: start a new one.
    Raises ``ValueError`` for a model that ``enable`` did not change."""
    state = getattr(model, "_indexcache_state", None)
    if not isinstance(state, _State):
        raise ValueError("indexcache: disable() needs a model that enable() changed")
    state.hook.remove()
    detached = [u.old for u in state.undo if u.name == "indexer" and isinstance(u.old, torch.nn.Module)]
    for u in reversed(state.undo):
        u.undo()
    first = next(model.parameters())
    if (first.dtype, first.device) != state.placed:
        for indexer in detached:
            indexer.to(device=first.device, dtype=first.dtype)
    return model
