"""GLM-5.3-Flash (``model_type: glm5_next``, transformers' ``Glm5NextForConditionalGeneration``; a
text-only ``glm5_next_text`` config too), DESIGN.md §6, on the model core of ``dsa.py``.

- ``layer_types``: ``linear_attention`` layers run Kimi Delta Attention (``blocks/kda.py``: short
  causal convolution, per-channel forget gate, gated delta rule, gated RMSNorm output);
  ``indexed_attention`` layers run NoPE MLA (``qk_rope_head_dim`` 0, softmax scale
  ``qk_nope_head_dim^-½``) over the positions the key-pooled DSA indexer picks
  (``blocks/kpool_indexer.py``: pools of ``index_kpool`` keys, the top ``index_topk / index_kpool``
  pools expanded to tokens, plus the unfinished tail pool).
- Residuals: manifold hyper-connections (``hc_mult`` streams, Sinkhorn mixing, ``blocks/hyper.py``),
  collapsed at the end by an unweighted mean (``hc_head`` has no parameters).
- MLPs: clamped SwiGLU (``swiglu_limit``) dense layers or a sigmoid-routed MoE with fused experts
  (``experts.gate_up_proj`` / ``down_proj``) and clamped shared experts (``mlp_layer_types``).

IndexCache (DESIGN.md §2): the plan covers the indexed layers only, in order. The checkpoint's
``indexer_types`` lists every layer (transformers indexes it by layer id; the entries of
linear-attention layers are ignored); a list with one entry per indexed layer is read as the
plan itself; an ``index_topk_pattern`` / ``indexer_types`` override has one entry per indexed
layer. An S indexed layer owns no indexer (its tensors are never read) and no index caches, and
attends the selection of the nearest earlier F indexed layer in the same forward (transformers
hands an S layer only the selection of the layer right before it, so it runs only patterns whose
S layers directly follow an F indexed layer; the rule here is the same on those).
``index_reuse_steps`` (``models/step_reuse.py`` over pool ids, docs/model.md): a decode row may
reuse its request's last picked pools plus those completed since, with its own tail.

Tensor and pipeline parallel (docs/parallel.md): MLA and KDA heads, dense and shared-expert widths
split, routed experts by rank, the pooled indexer and hyper-connections replicated.

Checkpoints: what transformers writes (``model.language_model.*``, ``lm_head.weight``; a VL
checkpoint's ``model.visual.*`` vision tower is passed over, as are MTP layers, which transformers
does not run either).
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from indexcache.config import INDEX_CACHE_KEYS, shipped_indexer_types
from indexcache.parallel import ParallelContext, check_divisible, dense_weight

from .args import ModelArgs
from .blocks.hyper import ManifoldHyperConnection, mix_streams
from .blocks.kda import KimiDeltaAttention, LinearStates
from .blocks.kpool_indexer import PooledIndexer
from .blocks.mla import SparseAttention
from .blocks.moe import ClampedMLP, MoE
from .blocks.norms import RMSNorm
from .dsa import DSAForCausalLM
from .state import BatchMeta, CacheBytes, CacheManager, ForwardContext, SelectionStore, _kv_dtype, tensor_bytes

LINEAR, INDEXED = "linear_attention", "indexed_attention"
# the keys of a glm5_next config.json that describe the whole (VL) model, not its text tower
_VL_KEYS = ("text_config", "vision_config", "model_type", "architectures", "image_token_id", "video_token_id",
            "image_start_token_id", "image_end_token_id", "video_start_token_id", "video_end_token_id",
            "tie_word_embeddings", "transformers_version", "dtype", "torch_dtype")
_LAYER_TENSOR = re.compile(r"^layers\.(\d+)\.(.*)$")
# set while from_pretrained builds a model for a checkpoint keeping the language model at model.*
_FLAT_LAYOUT = contextvars.ContextVar("glm5_next_flat_layout", default=False)


@dataclass
class Glm5NextArgs(ModelArgs):
    """``ModelArgs`` plus GLM-5.3-Flash's own fields (``index_topk`` is the selection row's width:
    ``index_topk_tokens`` + the tail's ``index_kpool - 1``)."""
    glm_layer_types: Optional[list] = None
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: Optional[float] = -5.0
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    index_topk_tokens: int = 2048

    def validate(self) -> None:
        # NoPE: the shared checks run on a copy with a stand-in RoPE width (no block here rotates)
        ModelArgs.validate(replace(self, qk_rope_head_dim=2, index_head_dim=max(self.index_head_dim, 2)))


def text_config_of(config: dict) -> dict:
    """The text tower's keys: ``text_config`` (the outer file's own keys, overrides included, beat
    it) or the file itself when it keeps them flat."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return dict(config)
    return {**text, **{k: v for k, v in config.items() if k not in _VL_KEYS}}


def _layer_types(c: dict, n: int) -> list:
    types = c.get("layer_types")
    if types is None:
        types = [LINEAR if i % 4 != 3 else INDEXED for i in range(n)]  # transformers' default
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"layer_types must name {LINEAR!r} / {INDEXED!r} for each of the {n} layers "
                         f"(num_hidden_layers), got {types!r}")
    types = [INDEXED if t == "full_attention" else t for t in types]
    bad = sorted({str(t) for t in types if t not in (LINEAR, INDEXED)})
    if bad:
        raise ValueError(f"layer_types has {', '.join(bad)}: each entry must be {LINEAR!r} or {INDEXED!r}")
    return types


def glm5_next_args(config: dict) -> dict:
    """A glm5_next config.json (text fields flat or under ``text_config``) -> the keys
    ``Glm5NextArgs.from_config`` reads. Every inconsistency is a ValueError naming its field."""
    c = {**Glm5NextForCausalLM._text_defaults, **{k: v for k, v in text_config_of(config).items() if v is not None}}
    lin = c.get("linear_attn_config")
    if isinstance(lin, dict):  # the released config's nested spelling
        c["linear_head_dim"] = lin.get("head_dim", c["linear_head_dim"])
        c["linear_num_heads"] = lin.get("num_heads", c["linear_num_heads"])
        c["linear_conv_kernel_dim"] = lin.get("short_conv_kernel_size", c["linear_conv_kernel_dim"])
        c["linear_lower_bound"] = lin.get("gate_lower_bound", c.get("linear_lower_bound"))
        if lin.get("safe_gate", True) and c["linear_lower_bound"] is None:
            c["linear_lower_bound"] = -5.0
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if c.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
    n = int(c["num_hidden_layers"])
    types = _layer_types(c, n)
    mlp = c.get("mlp_layer_types")
    if mlp is None:
        mlp = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    if not isinstance(mlp, list) or len(mlp) != n or any(t not in ("dense", "sparse") for t in mlp):
        raise ValueError(f"mlp_layer_types must list 'dense' / 'sparse' for each of the {n} layers "
                         f"(num_hidden_layers), got {mlp!r}")
    kpool, topk = int(c["index_kpool"]), int(c["index_topk"])
    if kpool < 1:
        raise ValueError(f"index_kpool must be >= 1, got {kpool}")
    if topk < 1 or topk % kpool:
        raise ValueError(f"index_topk {topk} must be a positive multiple of index_kpool {kpool} "
                         "(the indexer keeps index_topk / index_kpool whole pools)")
    if int(c.get("qk_rope_head_dim") or 0) != 0:
        raise ValueError(f"qk_rope_head_dim must be 0 (GLM-5.3-Flash's indexed layers are NoPE), got {c['qk_rope_head_dim']}")
    kv_heads = c.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != int(c["num_attention_heads"]):
        raise ValueError(f"num_key_value_heads {kv_heads} must equal num_attention_heads {c['num_attention_heads']}")
    for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "index_n_heads", "index_head_dim"):
        if int(c[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {c[key]}")
    tail = bool(c["index_kpool_always_select_tail"])
    c.update(glm_layer_types=types, mlp_layer_types=mlp, qk_rope_head_dim=0, index_topk_tokens=topk,
             index_topk=topk + (kpool - 1 if tail else 0), num_nextn_predict_layers=0,
             rope_parameters=None, rope_scaling=None, fused_experts=False)
    return c


class Glm5NextAttention(nn.Module):
    """NoPE MLA over the selected positions (absorbed over the latent cache, ``SparseAttention``);
    ``indexer`` a ``PooledIndexer`` on layers that may be F, None on S layers."""

    def __init__(self, args: Glm5NextArgs, layer_id: int, build_indexer: bool, par: ParallelContext | None = None):
        super().__init__()
        self.layer_id, self.par = layer_id, par or ParallelContext()
        h0, h1 = self.par.split(args.num_attention_heads, "num_attention_heads")  # this rank's heads
        self.n_heads, self.nope, self.v_dim, self.latent = h1 - h0, args.qk_nope_head_dim, args.v_head_dim, \
            args.kv_lora_rank
        n, eps, kvb, lin = args.num_attention_heads, args.rms_norm_eps, self.nope + self.v_dim, self.par.linear
        self.q_a_proj = lin(args.hidden_size, args.q_lora_rank, "q_a_proj")
        self.q_a_layernorm = RMSNorm(args.q_lora_rank, eps)
        self.q_b_proj = lin(args.q_lora_rank, n * self.nope, "q_b_proj", "col", (h0 * self.nope, h1 * self.nope))
        self.kv_a_proj_with_mqa = lin(args.hidden_size, self.latent, "kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.latent, eps)
        self.kv_b_proj = lin(self.latent, n * kvb, "kv_b_proj", "col", (h0 * kvb, h1 * kvb))
        self.o_proj = lin(n * self.v_dim, args.hidden_size, "o_proj", "row", (h0 * self.v_dim, h1 * self.v_dim))
        self.indexer = PooledIndexer(args.hidden_size, args.q_lora_rank, args.index_n_heads, args.index_head_dim,
                                     args.index_topk_tokens, args.index_kpool, args.index_kpool_always_select_tail,
                                     layer_id) if build_indexer else None
        self.sparse_attn = SparseAttention(layer_id, self.nope ** -0.5, self.latent)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h, meta = x.shape[0], self.n_heads, ctx.meta
        with ctx.stage(self.layer_id, "mla_proj"):
            qr = self.q_a_layernorm(self.q_a_proj(x))
            q_nope = self.q_b_proj(qr).view(n, h, self.nope)
            kv_c = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
            w_kv = dense_weight(self.kv_b_proj, x.dtype).view(h, self.nope + self.v_dim, self.latent)
            q_abs = torch.einsum("thd,hdc->thc", q_nope, w_kv[:, :self.nope])
            kv_cache = self._cache_keys(kv_c, ctx)
        if ctx.is_full(self.layer_id):
            if self.indexer is None:
                raise ValueError(f"layer {self.layer_id} is F in this forward but holds no indexer "
                                 "(the model was built with it as an S layer)")
            self.indexer(x, qr, ctx)
        elif not ctx.topk_valid:
            raise RuntimeError(f"layer {self.layer_id} reuses top-k indices but no F layer wrote them in this forward")
        with ctx.stage(self.layer_id, "attention"):
            out = self.sparse_attn(q_abs, ctx.topk_rows, kv_cache, meta.req_of_row, meta.block_table, meta.block_size)
            o = torch.einsum("thc,hdc->thd", out, w_kv[:, self.nope:])
            return self.par.all_reduce(self.o_proj(o.reshape(n, h * self.v_dim)), "attn_all_reduce")

    def _cache_keys(self, kv_c: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        meta = ctx.meta
        if not meta.paged:  # the batch's own keys: B blocks of T tokens
            return kv_c.view(-1, meta.block_size, self.latent)
        cache = ctx.cache.kv[self.layer_id]
        cache.view(-1, self.latent)[meta.slot_mapping] = kv_c.to(cache.dtype)
        return cache


class Glm5NextMoE(MoE):
    """The DSA MoE (sigmoid router) with clamped routed experts (``experts.E.*``, as checkpoints
    store them) and clamped shared experts."""

    def __init__(self, args: Glm5NextArgs, par: ParallelContext):
        super().__init__(args, par)
        d, i, lim = args.hidden_size, args.moe_intermediate_size, args.swiglu_limit
        if par.tp_size == 1:
            self.experts = nn.ModuleList(ClampedMLP(d, i, lim, par) for _ in range(args.n_routed_experts))
        else:  # this rank's experts [e0, e1), keyed by their global id (the checkpoint's names)
            self.experts = nn.ModuleDict({str(e): ClampedMLP(d, i, lim, par) for e in range(self.e0, self.e1)})
        if args.n_shared_experts:
            self.shared_experts = ClampedMLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts,
                                             args.swiglu_limit, par, shard=True)


class Glm5NextDecoderLayer(nn.Module):
    """Norm, KDA or indexed MLA, norm, clamped MLP or MoE, each inside a manifold hyper-connection."""

    def __init__(self, args: Glm5NextArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool,
                 par: ParallelContext | None = None):
        super().__init__()
        self.par, self.layer_id = par or ParallelContext(), layer_id
        self.kind = args.glm_layer_types[layer_id]
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if self.kind == LINEAR:
            self.self_attn = KimiDeltaAttention(args.hidden_size, args.linear_num_heads, args.linear_head_dim,
                                                args.linear_conv_kernel_dim, args.linear_lower_bound,
                                                args.rms_norm_eps, layer_id, self.par)
        else:
            self.self_attn = Glm5NextAttention(args, layer_id, build_indexer, self.par)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = Glm5NextMoE(args, self.par) if args.is_moe_layer(layer_id) else \
            ClampedMLP(args.hidden_size, args.intermediate_size, args.swiglu_limit, self.par, shard=True)
        self.attn_hc = ManifoldHyperConnection(args)
        self.ffn_hc = ManifoldHyperConnection(args)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        post, comb, h = self.attn_hc(x)
        x = mix_streams(x, post, comb, self.self_attn(self.input_layernorm(h), ctx))
        with ctx.stage(self.layer_id, "moe" if isinstance(self.mlp, MoE) else "mlp"):
            post, comb, h = self.ffn_hc(x)
            h = self.post_attention_layernorm(h)
            y = self.mlp(h, ctx.sync_free) if isinstance(self.mlp, MoE) else \
                self.par.all_reduce(self.mlp(h), "mlp_all_reduce")
            return mix_streams(x, post, comb, y)


class StreamMean(nn.Module):
    """GLM-5.3-Flash's final collapse of the streams ``[N, hc, D]``: their unweighted mean."""

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(dim=1)


class Glm5NextPagedCache(CacheBytes):
    """Paged caches sharing one block table per request, plus the linear layers' per-request state.

    Per indexed layer ``kv[i]``: the normed latent ``[num_blocks, block, kv_lora_rank]`` (NoPE: no
    RoPE part); per F indexed layer ``index_raw[i]`` fp32 ``[num_blocks, block, 2 index_head_dim]``
    (each token's key and pooling gate) and ``index_pool[i]`` fp32 ``[num_blocks, block / index_kpool,
    index_head_dim]`` (pooled keys). ``linear``: the KDA layers' conv and recurrent state, one slot
    per live request (grown on demand to the most requests live at once, at most ``max_num_seqs``
    when given), freed with the request.
    """

    def __init__(self, model, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = 64,
                 max_num_seqs: Optional[int] = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        args = model.args
        if block_size % args.index_kpool:
            raise ValueError(f"block_size {block_size} must be a multiple of index_kpool {args.index_kpool} "
                             "(a pool never straddles two cache blocks)")
        dtype = _kv_dtype(kv_cache_dtype, model.dtype)
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: GLM-5.3-Flash caches its latent as 'auto', 'bf16' "
                             "or 'fp32'")
        self.device = model.device
        self.block_size, self.num_blocks, self.kv_cache_dtype = block_size, num_blocks, kv_cache_dtype
        self.manager = CacheManager(num_blocks, block_size)
        self.selections = SelectionStore()
        self.manager.on_free.append(self.selections.free)
        self.kv, self.index_raw, self.index_pool, specs = [], [], [], []
        for layer in model.model.layers:
            attn = layer.self_attn
            indexed = isinstance(attn, Glm5NextAttention)
            self.kv.append(torch.zeros(num_blocks, block_size, attn.latent, dtype=dtype, device=self.device)
                           if indexed else None)
            idx = attn.indexer if indexed else None
            d = args.index_head_dim
            self.index_raw.append(None if idx is None else torch.zeros(num_blocks, block_size, 2 * d, device=self.device))
            self.index_pool.append(None if idx is None else
                                   torch.zeros(num_blocks, block_size // args.index_kpool, d, device=self.device))
            specs.append(attn.state_spec() if isinstance(attn, KimiDeltaAttention) else None)
        self.linear = LinearStates(specs, 0, self.device, max_num_seqs)
        self.manager.on_free.append(self.linear.free)

    @property
    def num_layers(self) -> int:
        return len(self.kv)

    def layer_bytes(self, layer_id: int) -> tuple[int, int]:
        """(latent KV + linear state bytes, index key bytes) of one layer."""
        state = tensor_bytes(self.linear.conv[layer_id]) + tensor_bytes(self.linear.recurrent[layer_id])
        return (tensor_bytes(self.kv[layer_id]) + state,
                tensor_bytes(self.index_raw[layer_id]) + tensor_bytes(self.index_pool[layer_id]))


class Glm5NextForCausalLM(DSAForCausalLM):
    model_type = "glm5_next"
    architecture = "Glm5NextForConditionalGeneration"
    args_class = Glm5NextArgs
    config_defaults = {
        "rms_norm_eps": 1e-5, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "swiglu_limit": 10.0, "fused_experts": False,
        "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
    }
    # transformers' Glm5NextTextConfig defaults for the fields this file reads
    _text_defaults = {
        "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 288,
        "num_experts_per_tok": 8, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 256, "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
        "index_kpool": 16, "index_kpool_always_select_tail": True, "hc_mult": 4,
    }
    fp32_params = ("attn_hc.fn", "attn_hc.base", "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale",
                   "conv1d.weight", "dt_bias", "A_log", "mlp.gate.weight", "indexer.k_norm.weight",
                   "indexer.k_norm.bias", "index_kpool_compress_ape")
    decoder_layer = Glm5NextDecoderLayer
    mla = False
    # parameter name (transformers' in-memory names) -> the checkpoint's (what save_pretrained writes:
    # the released layout, transformers' conversion mapping run backwards)
    checkpoint_renames = (
        (r"\.self_attn\.forget_gate\.", ".self_attn."),
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    )

    def __init__(self, args: Glm5NextArgs, plan, **kwargs):
        check_divisible(kwargs.get("parallel"), (("linear_num_heads", args.linear_num_heads),))
        super().__init__(args, plan, **kwargs)
        # text checkpoints keep the language model at model.*, VL ones (and transformers') at model.language_model.*
        self.flat_layout = _FLAT_LAYOUT.get()
        self.indexer_fp8 = False  # the pooled indexer scores in fp32, as transformers'
        self.model.hc_head = StreamMean() if self.par.last_stage else None

    @classmethod
    def family_config(cls, config: dict) -> dict:
        return glm5_next_args(config)

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "Glm5NextForCausalLM":
        """As ``DSAForCausalLM.from_pretrained``; reads the language model at ``model.language_model.*``
        (what transformers writes) or at ``model.*`` (a text-only checkpoint)."""
        from indexcache import loader
        p = Path(path)
        names = set(loader._weight_files(p)) if p.is_dir() else set()
        token = _FLAT_LAYOUT.set("model.embed_tokens.weight" in names)
        try:
            return super().from_pretrained(path, **kwargs)
        finally:
            _FLAT_LAYOUT.reset(token)

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        return name if getattr(self, "flat_layout", False) else re.sub(r"^model\.", "model.language_model.", name)

    @classmethod
    def indexed_layers(cls, args: Glm5NextArgs) -> list:
        return [i for i, t in enumerate(args.glm_layer_types) if t == INDEXED]

    @classmethod
    def index_cache_config(cls, config: dict) -> dict:
        """IndexCache keys from the text tower (outer keys win): the checkpoint's plan is the
        ``indexer_types`` transformers runs (``config.shipped_indexer_types``), cut to the indexed layers'
        entries when it lists every layer."""
        text = text_config_of(config)
        out = {**config, **{k: v for k, v in text.items() if k in INDEX_CACHE_KEYS}}
        n = int(text["num_hidden_layers"])
        types, key = shipped_indexer_types(out, n)
        if types is not None:
            out["indexer_types"] = types
            layer_types = _layer_types(text, n)
            indexed = [i for i, t in enumerate(layer_types) if t == INDEXED]
            if not isinstance(types, list) or len(types) not in (n, len(indexed)):
                raise ValueError(f"{key} must have one entry per layer ({n}) or per indexed layer "
                                 f"({len(indexed)}), got {types!r}")
            if len(types) == n:
                out["indexer_types"] = [types[i] for i in indexed]
        out["num_hidden_layers"] = text.get("num_hidden_layers")
        return out

    @classmethod
    def from_config(cls, config, hf_overrides=None, **kwargs):
        model = super().from_config(config, hf_overrides, **kwargs)
        model.ic_config.require_one_entry_per_layer(model.indexed)
        return model

    def plan_summary(self) -> str:
        layers = ", ".join(str(i) for i in self.indexed)
        return super().plan_summary() + f"\nover the indexed layers {layers} (linear-attention layers run no indexer)"

    def drops_checkpoint_tensor(self, name: str) -> bool:
        prefix = "model." if getattr(self, "flat_layout", False) else "model.language_model."
        if not (name.startswith(prefix) or name == "lm_head.weight") or name.startswith("model.visual."):
            return True  # the vision tower (model.visual.*) and anything else outside the language model
        m = _LAYER_TENSOR.match(name[len(prefix):])
        if m is None:
            return False
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= self.args.num_hidden_layers or rest.startswith("shared_head."):
            return True  # MTP layers: transformers ignores them too
        attn = self.model.layers[layer].self_attn
        return rest.startswith("self_attn.indexer.") and isinstance(attn, Glm5NextAttention) and attn.indexer is None

    def allocate_cache(self, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = 64,
                       max_num_seqs: Optional[int] = None) -> Glm5NextPagedCache:
        return Glm5NextPagedCache(self, num_blocks, kv_cache_dtype, block_size, max_num_seqs)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "Glm5NextForCausalLM":
        super().init_random_(seed)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in self.named_parameters():
            if name.endswith(("dt_bias", "A_log", "index_kpool_compress_ape", ".base")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".scale"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        return self

    def forward_context(self, meta: BatchMeta, cache=None, timer=None, *, sync_free: bool = False, full=None,
                        torch_pass=None) -> ForwardContext:
        if torch_pass is not None:
            raise ValueError("GLM-5.3-Flash has no differentiable (training) forward yet")
        if sync_free:
            raise ValueError("GLM-5.3-Flash has no sync-free (CUDA graph) decode step yet: use decode_step='eager'")
        ctx = super().forward_context(meta, cache, timer, sync_free=sync_free, full=full)
        if meta.paged:
            rids = meta.request_ids("GLM-5.3-Flash keeps each request's linear-attention state")
            store = cache.linear
            ctx.linear_slots = store.slots(rids, meta.ctx_lens)
        else:
            if any(meta.ctx_lens):
                raise ValueError("a forward without a cache starts every request at position 0")
            specs = [l.self_attn.state_spec() if isinstance(l.self_attn, KimiDeltaAttention) else None
                     for l in self.model.layers]
            store = LinearStates(specs, len(meta.q_lens), self.device)
            ctx.linear_slots = store.slots(list(range(len(meta.q_lens))), [0] * len(meta.q_lens))
        ctx.linear_states = store
        return ctx


class Glm5NextTextForCausalLM(Glm5NextForCausalLM):
    """A text-only config (``model_type: glm5_next_text``, the fields flat), same layout."""
    model_type = "glm5_next_text"
    architecture = "Glm5NextTextModel"


def kpool_indexer_costs(config: dict, plan, context: int) -> dict:
    """What a plan over the indexed layers removes against all-F at ``context`` tokens, per sequence
    (``indexcache plan``).

    Per F indexed layer and token: the indexer's projections (``wq_b``, ``wk``, the pooling gate,
    ``weights_proj``) and its share of the pooling (softmax weights and the weighted sum, ~4 d); per
    query, the ReLU-weighted score of each complete pool it sees (``(t + 1) // P``), not of each key.
    Bytes: the index caches this package holds (per token ``key | gate`` fp32, per pool its fp32
    key). Top-k selection is not counted."""
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    c = glm5_next_args(config)
    h, d, hidden, q_lora, P = (int(c[k]) for k in ("index_n_heads", "index_head_dim", "hidden_size", "q_lora_rank",
                                                  "index_kpool"))
    proj = 2 * q_lora * h * d + 2 * 2 * hidden * d + 2 * hidden * h + 4 * d
    per_pool = 2 * h * d + 2 * h
    seen = sum((t + 1) // P for t in range(context)) if context <= 1 << 20 else context * context // (2 * P)
    layers = sum(1 for t in c["glm_layer_types"] if t == INDEXED)

    def entry(per_layer):
        full, kept = per_layer * layers, per_layer * plan.num_full
        return {"all_f": full, "plan": kept, "removed": full - kept, "removed_fraction": (full - kept) / full if full else 0.0}

    per_token = 2 * d * 4 + d * 4 / P
    return {"context": context, "index_kpool": P,
            "dims": {"hidden_size": hidden, "q_lora_rank": q_lora, "index_n_heads": h, "index_head_dim": d},
            "index_k_label": f"index caches per sequence ({per_token:g} B/token/layer)",
            "decode_flops_per_token": entry(proj + context // P * per_pool),
            "prefill_flops": entry(context * proj + seen * per_pool),
            "index_k_cache_bytes_per_sequence": entry(int(context * per_token))}
