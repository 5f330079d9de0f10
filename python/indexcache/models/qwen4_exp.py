"""Qwen3.8-Flash-Next (``model_type: qwen4_exp_text``, transformers' ``Qwen4ExpForCausalLM``; and
the text tower of ``qwen4_exp`` checkpoints, ``Qwen4ExpForConditionalGeneration``), DESIGN.md §6,
on the model core of ``dsa.py``.

- ``layer_types``: ``linear_attention`` (Gated DeltaNet, ``blocks/gdn.py``) or
  ``indexed_attention`` (gated GQA over the tokens a QSA indexer selects, ``blocks/qsa.py``);
  ``full_attention`` entries read as ``indexed_attention``, as transformers does. Default: every
  fourth layer indexed.
- The **indexed layers** are the ``indexed_attention`` ones: the IndexCache plan (freq / pattern /
  ``indexer_types``) has one entry per indexed layer. An S indexed layer owns no indexer and no
  index-K cache and attends over the QSA selection (block ids, ``blocks/qsa.py``) of the nearest
  earlier F indexed layer in the same forward.
- Residuals: ``hc_count`` streams with gated mixing (``attn_hyper_connection`` /
  ``mlp_hyper_connection``: a low-rank sigmoid mix of the normed streams feeds the block, the
  block's output is injected into each stream with a sigmoid weight); the streams are mixed once
  more at the end (``hyper_connection_mixer``) and go to ``lm_head`` with no final norm.
- PLE (``ple_layer_ids``, linear layers only): hashed n-gram embeddings added to the streams
  before the layer (``blocks/ple.py``).
- MLP: a softmax-routed MoE (top ``num_experts_per_tok``, renormalised when
  ``norm_topk_prob``) plus one shared expert scaled by ``sigmoid(shared_expert_gate)``.
- Every RMSNorm scales by ``1 + w`` but Gated DeltaNet's output norm (``w``).
- Checkpoints: the layout ``save_pretrained`` writes (and the released one): routed experts
  ``mlp.experts.E.{gate,up,down}_proj``, the n-gram table as ``ngram_embedding.shard_i``; a
  ``qwen4_exp`` checkpoint holds the language model as ``model.language_model.*`` (read from
  ``text_config``), its vision tower (``model.visual.*``) and MTP tensors are passed over.
- Caches (``Qwen4ExpPagedCache``): K/V pages per indexed layer, raw index keys per F indexed
  layer, and per request slot the constant-size states: Gated DeltaNet's conv window and fp32
  recurrent state, PLE's token history and conv window.
- Tensor and pipeline parallel (docs/parallel.md): attention, Gated DeltaNet and shared-expert
  widths split by head, routed experts by rank, QSA indexer / residual mixers / PLE replicated;
  no MTP, no differentiable torch form, no CUDA graph decode step (the layers loop over requests
  on the host).
- ``index_reuse_steps`` / ``index_reuse_min_recall`` (``models/step_reuse.py`` over QSA block ids,
  docs/model.md): a decode row may reuse its request's last picked blocks plus those completed since.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from indexcache.config import INDEX_CACHE_KEYS
from indexcache.formats import BLOCK_SIZE
from indexcache.parallel import check_divisible

from .args import ModelArgs
from .blocks.gdn import GatedDeltaNet
from .blocks.gqa import OffsetRMSNorm
from .blocks.gated_residual import GatedResidual
from .blocks.ple import PLELayer
from .blocks.softmax_moe import SoftmaxMoE
from .blocks.qsa import IndexedAttention
from .dsa import DSAForCausalLM
from .state import CacheManager, ForwardContext, GQAPages, SelectionStore, _kv_dtype, tensor_bytes

LINEAR, INDEXED = "linear_attention", "indexed_attention"
_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
# the config keys of a VL config.json that describe the whole model, not its text tower
_VL_KEYS = ("text_config", "vision_config", "model_type", "architectures", "image_token_id", "video_token_id",
            "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")


@dataclass
class Qwen4ExpArgs(ModelArgs):
    """``ModelArgs`` plus Qwen3.8-Flash-Next's own fields (transformers' ``Qwen4ExpTextConfig`` names)."""
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list = field(default_factory=list)
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_budget: int = 0
    indexer_compress_ratio: int = 0
    output_gate_type: str = "silu"
    shared_expert_intermediate_size: int = 0

    @property
    def eos(self) -> int:
        e = self.eos_token_id
        return int(e[0] if isinstance(e, (list, tuple)) else e)


class Qwen4ExpDecoderLayer(nn.Module):
    """PLE (on its layers), gated residual around the token mixer (Gated DeltaNet or indexed
    attention) and around the MoE. Streams ``[N, hc, hidden]`` in and out."""

    def __init__(self, args: Qwen4ExpArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool, par=None):
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = args.attn_layer_types[layer_id]
        d, eps, hc = args.hidden_size, args.rms_norm_eps, args.hc_count
        self.self_attn = self.linear_attn = None
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(d, args.linear_num_key_heads, args.linear_num_value_heads,
                                             args.linear_key_head_dim, args.linear_value_head_dim,
                                             args.linear_conv_kernel_dim, eps, args.output_gate_type, layer_id, par)
        else:
            qsa = dict(n_heads=args.index_n_heads, head_dim=args.index_head_dim, budget=args.indexer_budget,
                       ratio=args.indexer_compress_ratio, rope_dim=args.qk_rope_head_dim, rope_theta=args.rope_theta)
            self.self_attn = IndexedAttention(d, args.num_attention_heads, args.num_kv_heads, args.gqa_head_dim, eps,
                                              qsa, build_indexer, layer_id, par)
        self.mlp = SoftmaxMoE(args, par)
        self.ple = None
        if layer_id + 1 in args.ple_layer_ids:
            ngram = dict(vocab=args.vocab_size, ngram_size=args.ngram_size, heads_per_ngram=args.heads_per_ngram,
                         table_base=args.ngram_vocab_size_base, divisor=args.make_ngram_vocab_size_divisible_by,
                         parts=args.split_ngram_parts, seed=args.seed, eos=args.eos,
                         ple_index=args.ple_layer_ids.index(layer_id + 1))
            self.ple = PLELayer(d, hc, args.ple_embed_dim, args.ple_conv_kernel_size, eps, ngram)
        self.attn_hyper_connection = GatedResidual(d, hc, args.hc_lowrank, eps)
        self.mlp_hyper_connection = GatedResidual(d, hc, args.hc_lowrank, eps)

    def _slots(self, ctx: ForwardContext) -> list:
        meta = ctx.meta
        if ctx.cache is None:
            return list(range(len(meta.q_lens)))
        rids = meta.request_ids("Qwen3.8-Flash-Next keeps each request's linear-attention state")
        return [ctx.cache.slot(rid, c == 0) for rid, c in zip(rids, meta.ctx_lens)]

    def _states(self, ctx: ForwardContext, name: str, shapes, dtypes, slots: list) -> list:
        """This layer's per-request state tensors (the cache's rows, new requests' rows zeroed; or,
        without a cache, zeros for the batch's requests)."""
        meta = ctx.meta
        if ctx.cache is None:
            return [torch.zeros((len(slots),) + s, dtype=dt, device=ctx.cos.device) for s, dt in zip(shapes, dtypes)]
        states = ctx.cache.states[self.layer_id][name]
        for slot, c in zip(slots, meta.ctx_lens):
            if c == 0:  # a request's first tokens start from the empty state
                for t in states:
                    t[slot].fill_(ctx.cache.fill(t))
        return states

    def forward(self, streams: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.sync_free:
            raise ValueError("Qwen3.8-Flash-Next has no sync-free decode step (its layers loop over requests)")
        if ctx.torch_pass is not None:
            raise ValueError("Qwen3.8-Flash-Next has no differentiable torch form")
        meta = ctx.meta
        slots = self._slots(ctx) if self.ple is not None or self.linear_attn is not None else None
        if self.ple is not None:
            if ctx.input_ids is None:
                raise ValueError(f"layer {self.layer_id} (PLE) needs the rows' token ids on the forward context")
            hist_shape, win_shape = self.ple.state_shapes()
            hist, win = self._states(ctx, "ple", (hist_shape, win_shape), (torch.long, streams.dtype), slots)
            if ctx.cache is None:
                hist.fill_(self.ple.ple_embedding.eos)
            with ctx.stage(self.layer_id, "ple"):
                streams = streams + self.ple(streams.flatten(-2), ctx.input_ids, hist, win, slots,
                                             meta.q_lens).view_as(streams)
        x, inject = self.attn_hyper_connection(streams)
        if self.linear_attn is not None:
            conv_shape, rec_shape = self.linear_attn.state_shapes()
            conv, rec = self._states(ctx, "gdn", (conv_shape, rec_shape), (streams.dtype, torch.float32), slots)
            with ctx.stage(self.layer_id, "linear_attention"):
                out = self.linear_attn(x, conv, rec, slots, meta.q_lens)
        else:
            out = self.self_attn(x, ctx)
        streams = streams + out.unsqueeze(-2) * inject.unsqueeze(-1)
        x, inject = self.mlp_hyper_connection(streams)
        with ctx.stage(self.layer_id, "moe"):
            out = self.mlp(x)
        return streams + out.unsqueeze(-2) * inject.unsqueeze(-1)


class Qwen4ExpPagedCache(GQAPages):
    """Paged caches sharing one block table per request, plus per-request state slots.

    ``k[i]``, ``v[i]`` ``[num_blocks, block, kv_heads, head_dim]`` per indexed layer;
    ``index_k[i]`` ``[num_blocks, block, indexer_head_dim]`` (raw keys) per F indexed layer; None
    elsewhere. ``states[i]``: per linear layer ``{"gdn": (conv [S, kernel - 1, conv_dim],
    recurrent fp32 [S, h_v, d_k, d_v])}`` and per PLE layer ``"ple": (token history int64
    [S, ngram_size - 1], conv window [S, window, hc * hidden])``, S = ``max_num_seqs`` slots handed
    to requests on their first forward and returned when the cache manager frees them."""

    def __init__(self, model, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = BLOCK_SIZE,
                 max_num_seqs: int | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        dtype = _kv_dtype(kv_cache_dtype, model.dtype)
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: Qwen3.8-Flash-Next caches K/V as 'auto', 'bf16' "
                             "or 'fp32'")
        args = model.args
        self.device = model.topk_buffer.device
        self.block_size, self.num_blocks, self.kv_cache_dtype = block_size, num_blocks, kv_cache_dtype
        self.max_num_seqs = min(num_blocks, 64) if max_num_seqs is None else int(max_num_seqs)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.manager = CacheManager(num_blocks, block_size)
        self.manager.on_free.append(self._release)
        # step reuse (models/step_reuse.py): each request's last QSA block picks per F layer, freed with it
        self.selections = SelectionStore()
        self.manager.on_free.append(self.selections.free)
        self._slot: dict = {}
        self._free = list(range(self.max_num_seqs - 1, -1, -1))
        self.eos = args.eos if args.ple_layer_ids else 0
        self._allocate_pages(model, num_blocks, block_size, dtype)
        self.states = []
        S = self.max_num_seqs
        for layer in model.model.layers:  # AbsentLayer (another pipeline stage's): no state
            st = {}
            if getattr(layer, "linear_attn", None) is not None:
                conv, rec = layer.linear_attn.state_shapes()
                st["gdn"] = (torch.zeros((S,) + conv, dtype=model.dtype, device=self.device),
                             torch.zeros((S,) + rec, dtype=torch.float32, device=self.device))
            if getattr(layer, "ple", None) is not None:
                hist, win = layer.ple.state_shapes()
                st["ple"] = (torch.full((S,) + hist, self.eos, dtype=torch.long, device=self.device),
                             torch.zeros((S,) + win, dtype=model.dtype, device=self.device))
            self.states.append(st)

    def fill(self, t: torch.Tensor):
        """The empty-state value of a state tensor (eos for token histories, else 0)."""
        return self.eos if t.dtype == torch.long else 0

    def slot(self, rid, first: bool = False) -> int:
        """Request ``rid``'s state slot, handed out when ``first`` (its first tokens run now)."""
        if rid not in self._slot:
            if not first:
                raise ValueError(f"request {rid!r} continues at a later position but has no state in this cache "
                                 "(its first tokens never ran through it, or it was freed)")
            if not self._free:
                raise RuntimeError(f"request {rid!r}: all {self.max_num_seqs} state slots are in use "
                                   "(free finished requests or allocate the cache with a larger max_num_seqs)")
            self._slot[rid] = self._free.pop()
        return self._slot[rid]

    def _release(self, rid) -> None:
        s = self._slot.pop(rid, None)
        if s is not None:
            self._free.append(s)

    def state_bytes(self, layer_id: int) -> int:
        return sum(tensor_bytes(t) for ts in self.states[layer_id].values() for t in ts)


class Qwen4ExpForCausalLM(DSAForCausalLM):
    model_type = "qwen4_exp_text"
    architecture = "Qwen4ExpForCausalLM"
    # transformers' Qwen4ExpTextConfig defaults, for fields a config.json may omit
    config_defaults = {
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "num_nextn_predict_layers": 0, "norm_topk_prob": True,
    }
    decoder_layer = Qwen4ExpDecoderLayer
    mla = False
    checkpoint_renames = ((r"^model\.hc_head\.", "model.hyper_connection_mixer."),)
    _text_defaults = {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
        "num_experts": 512, "hc_count": 4, "hc_lowrank": 320, "ple_conv_kernel_size": 4, "ngram_size": 3,
        "heads_per_ngram": 8, "ngram_vocab_size_base": 20_000_000, "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234, "split_ngram_parts": 512, "hidden_act": "silu",
    }

    def __init__(self, args: ModelArgs, plan, **kwargs):
        if not isinstance(args, Qwen4ExpArgs):  # DSAForCausalLM.from_config builds plain ModelArgs
            args = Qwen4ExpArgs.from_config(self.family_config(kwargs.get("config") or {}), self.model_type,
                                            self.config_defaults)
        check_divisible(kwargs.get("parallel"), (("num_key_value_heads", args.num_kv_heads),
                                                 ("linear_num_key_heads", args.linear_num_key_heads),
                                                 ("linear_num_value_heads", args.linear_num_value_heads)))
        super().__init__(args, plan, **kwargs)
        if self.par.last_stage:  # no final norm: the streams, mixed once more, go to lm_head
            self.model.norm = nn.Identity()
            self.model.hc_head = GatedResidual(args.hidden_size, args.hc_count, args.hc_lowrank, args.rms_norm_eps,
                                               combine=False)

    @classmethod
    def family_config(cls, config: dict) -> dict:
        return text_args(config, cls._text_defaults)

    @classmethod
    def indexed_layers(cls, args: ModelArgs) -> list:
        return [i for i, t in enumerate(args.attn_layer_types) if t == INDEXED]

    @classmethod
    def from_config(cls, config, hf_overrides=None, **kwargs):
        """As every family, and a pattern or ``indexer_types`` in force must have exactly one entry per
        indexed layer (DESIGN §2 lets a short pattern run F past its end; for a hybrid model whose
        list is easily written per layer instead, a wrong length is refused)."""
        model = super().from_config(config, hf_overrides, **kwargs)
        model.ic_config.require_one_entry_per_layer(model.indexed)
        return model

    def plan_summary(self) -> str:
        layers = ", ".join(str(i) for i in self.indexed)
        return super().plan_summary() + (f"\nover the indexed_attention layers {layers} "
                                         "(linear_attention layers run no indexer)")

    def drops_checkpoint_tensor(self, name: str) -> bool:
        # the n-gram hash constants (rebuilt from the config) and the MTP module (transformers runs none)
        return name.endswith(("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
                              "ple_embedding.ngram_heads_offsets")) or name.startswith("mtp.")

    def allocate_cache(self, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = BLOCK_SIZE,
                       max_num_seqs: int | None = None) -> Qwen4ExpPagedCache:
        return Qwen4ExpPagedCache(self, num_blocks, kv_cache_dtype, block_size, max_num_seqs)

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ctx.input_ids = input_ids
        return super().hidden_states(input_ids, ctx)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "Qwen4ExpForCausalLM":
        """``DSAForCausalLM``'s draw; the ``1 + weight`` norms then get weights near 0, Gated
        DeltaNet's decay parameters a spread of rates."""
        super().init_random_(seed)
        g = torch.Generator().manual_seed(seed + 1)
        for m in self.modules():
            if isinstance(m, OffsetRMSNorm):
                m.weight.sub_(1.0)
            if isinstance(m, GatedDeltaNet):
                m.A_log.copy_(torch.empty(m.A_log.shape).uniform_(0.01, 16, generator=g).log())
                m.dt_bias.fill_(1.0)
        return self


class Qwen4ExpTextTower(Qwen4ExpForCausalLM):
    """The text tower of a ``qwen4_exp`` checkpoint (``Qwen4ExpForConditionalGeneration``):
    ``text_config`` read as a text config.json, ``model.language_model.*`` and ``lm_head``; the
    vision tower (``model.visual.*``) passed over."""
    model_type = "qwen4_exp"
    architecture = "Qwen4ExpForConditionalGeneration"
    checkpoint_renames = Qwen4ExpForCausalLM.checkpoint_renames + ((r"^model\.", "model.language_model."),)

    @classmethod
    def family_config(cls, config: dict) -> dict:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("a qwen4_exp config.json needs its text_config (the language model's settings)")
        merged = {**text, **{k: v for k, v in config.items() if k not in _VL_KEYS}}
        return super().family_config(merged)

    @classmethod
    def index_cache_config(cls, config: dict) -> dict:
        """IndexCache settings shipped in ``text_config`` count as the file's own (the outer keys win)."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        return {**{k: v for k, v in text.items() if k in INDEX_CACHE_KEYS}, **config}

    _index_tensor = re.compile(r"^model\.language_model\.layers\.(\d+)\.self_attn\.indexer\.")

    def drops_checkpoint_tensor(self, name: str) -> bool:
        if name.startswith(("model.visual.", "mtp.")) or super().drops_checkpoint_tensor(name):
            return True  # the vision tower, the MTP module, the n-gram hash constants
        m = self._index_tensor.match(name)
        if m is None or int(m.group(1)) >= len(self.model.layers):
            return False
        attn = self.model.layers[int(m.group(1))].self_attn
        return attn is not None and attn.indexer is None  # an S indexed layer's indexer


def text_args(config: dict, defaults: dict) -> dict:
    """A Qwen3.8-Flash-Next text config.json -> the keys ``Qwen4ExpArgs.from_config`` reads (the
    DSA-required ones mapped onto GQA: ``kv_lora_rank`` = ``v_head_dim`` = head_dim,
    ``qk_rope_head_dim`` the rotated dims; ``index_topk`` = the QSA block budget + 1 columns).
    Every inconsistency is a ValueError naming the field."""
    c = {**defaults, **{k: v for k, v in config.items() if v is not None}}
    n = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types is None:
        interval = int(c.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else INDEXED for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"layer_types must list one type for each of the {n} layers (num_hidden_layers), "
                         f"got {types!r}")
    types = [INDEXED if t == "full_attention" else t for t in types]
    bad = sorted(set(types) - {LINEAR, INDEXED})
    if bad:
        raise ValueError(f"layer_types: unsupported layer types {bad} (choose {LINEAR!r} or {INDEXED!r})")
    has_indexed = INDEXED in types
    missing = [k for k in _QSA if c.get(k) is None]
    if has_indexed and missing:
        raise ValueError(f"indexed_attention layers need the QSA config: {', '.join(missing)} missing")
    if has_indexed:
        if any(int(c[k]) <= 0 for k in _QSA):
            raise ValueError(f"the QSA config values must be positive: {({k: c[k] for k in _QSA})}")
        if int(c["indexer_kv_heads"]) != 1:
            raise ValueError(f"indexer_kv_heads {c['indexer_kv_heads']}: QSA scores one key head")
        if int(c["indexer_budget"]) % int(c["indexer_compress_ratio"]):
            raise ValueError(f"indexer_budget {c['indexer_budget']} is not a multiple of indexer_compress_ratio "
                             f"{c['indexer_compress_ratio']} (the budget is whole blocks)")
    else:  # a model without indexed layers: the plan is empty; the QSA fields only fill ModelArgs
        for k, v in (("indexer_n_heads", 1), ("indexer_head_dim", 2), ("indexer_budget", 1),
                     ("indexer_compress_ratio", 1)):
            c.setdefault(k, v)
    ple = sorted(set(c.get("ple_layer_ids") or []))
    wrong = [i for i in ple if not 1 <= i <= n]
    if wrong:
        raise ValueError(f"ple_layer_ids are one-indexed layer ids in [1, {n}], got {wrong}")
    not_linear = [i for i in ple if types[i - 1] != LINEAR]
    if not_linear:
        raise ValueError(f"ple_layer_ids {not_linear} are not linear_attention layers (PLE runs on those only)")
    if ple and c.get("eos_token_id") in (None, []):
        raise ValueError("eos_token_id must be set when ple_layer_ids name PLE layers")
    gate = c.get("output_gate_type") or c.get("hidden_act", "silu")
    if gate not in ("silu", "sigmoid"):
        raise ValueError(f"output_gate_type {gate!r}: choose 'silu' or 'sigmoid'")
    if int(c.get("hc_count", 4)) <= 1:
        raise ValueError(f"hc_count {c.get('hc_count')} must be > 1")
    if int(c["linear_num_value_heads"]) % int(c["linear_num_key_heads"]):
        raise ValueError(f"linear_num_value_heads {c['linear_num_value_heads']} is not a multiple of "
                         f"linear_num_key_heads {c['linear_num_key_heads']}")
    head, kv = int(c["head_dim"]), int(c["num_key_value_heads"])
    if int(c["num_attention_heads"]) % kv:
        raise ValueError(f"num_attention_heads {c['num_attention_heads']} is not a multiple of num_key_value_heads {kv}")
    params = dict(c.get("rope_parameters") or {})
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type {params.get('rope_type')!r}: Qwen3.8-Flash-Next runs 'default' "
                         "(multimodal RoPE reduces to it on text)")
    params.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    rotary = int(head * params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    if rotary < 2 or rotary % 2 or rotary > head:
        raise ValueError(f"the rotated dims ({rotary} of head_dim {head}) must be even, >= 2 and <= head_dim")
    if has_indexed and rotary > int(c["indexer_head_dim"]):
        raise ValueError(f"indexer_head_dim {c['indexer_head_dim']} must hold the {rotary} rotated dims")
    ple_dim = int(c.get("ple_embed_dim") or c["hidden_size"])
    c.update(attn_layer_types=types, mlp_layer_types=["sparse"] * n, num_kv_heads=kv, gqa_head_dim=head,
             q_lora_rank=0, kv_lora_rank=head, qk_nope_head_dim=head - rotary, qk_rope_head_dim=rotary,
             v_head_dim=head, index_n_heads=c["indexer_n_heads"], index_head_dim=c["indexer_head_dim"],
             index_topk=int(c["indexer_budget"]) // int(c["indexer_compress_ratio"]) + 1,
             intermediate_size=c["shared_expert_intermediate_size"], n_routed_experts=c["num_experts"],
             shared_intermediate_size=c["shared_expert_intermediate_size"],
             n_shared_experts=0, num_nextn_predict_layers=0, hc_mult=int(c["hc_count"]), ple_layer_ids=ple,
             ple_embed_dim=ple_dim, output_gate_type=gate,
             rope_parameters={"rope_type": "default", "rope_theta": params["rope_theta"]})
    return c


def qsa_indexer_costs(config: dict, plan, context: int, cache_bytes: int = 2) -> dict:
    """What the plan removes against all-F at ``context`` tokens, over the indexed layers
    (``indexcache plan``): QSA's projection (``index_qk_proj``) and block scoring (q · k per head
    and the ReLU head sum, one key per ``indexer_compress_ratio`` tokens), and its raw-key cache
    (``indexer_head_dim`` values of ``cache_bytes`` per token). Top-k and pooling not counted."""
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    c = text_args({**text, **{k: v for k, v in config.items() if k not in _VL_KEYS}},
                  Qwen4ExpForCausalLM._text_defaults)
    h, hd, hidden, r = (int(c["indexer_n_heads"]), int(c["indexer_head_dim"]), int(c["hidden_size"]),
                        int(c["indexer_compress_ratio"]))
    proj = 2 * hidden * (h + 1) * hd
    per_block = 2 * h * hd + h
    decode = proj + (context // r) * per_block
    q, rem = divmod(context, r)  # Σ_{n=1..context} floor(n / r): the complete blocks each row scores
    prefill = context * proj + (r * q * (q - 1) // 2 + q * (rem + 1)) * per_block
    cache = context * hd * cache_bytes

    def entry(per_layer):
        full, kept = per_layer * plan.num_hidden_layers, per_layer * plan.num_full
        return {"all_f": full, "plan": kept, "removed": full - kept,
                "removed_fraction": (full - kept) / full if full else 0.0}

    return {"context": context, "compress_ratio": r,
            "dims": {"hidden_size": hidden, "index_n_heads": h, "index_head_dim": hd},
            "index_k_label": f"raw index keys per sequence ({hd * cache_bytes} B/token/layer)",
            "decode_flops_per_token": entry(decode), "prefill_flops": entry(prefill),
            "index_k_cache_bytes_per_sequence": entry(cache)}
