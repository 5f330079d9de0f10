"""The DSA causal LM that every family file specialises (DESIGN.md §3–§6, §10), gpt-fast style.

Construction from a config (the ``LayerPlan`` decides which layers own an indexer), loading,
the whole-prompt forward, the paged ``forward_tokens``, MTP drafting and the differentiable
forward that training runs (``hidden_states`` under a ``TorchPass``). The configuration is in
``args``, the blocks in ``blocks``, the per-forward state (batch, paged caches, shared top-k
buffer) in ``state``.

IndexCache: S layers have ``self_attn.indexer = None`` (no parameters, no index-K cache) and
attend over the rows that the last F layer wrote into the model's single shared top-k buffer
in the same forward. Which layers are F in a forward is data on its ``ForwardContext``
(``full``): the plan by default, another pattern for the pattern tools, the MTP layer's
reuse for later draft steps; nothing is flipped on the blocks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from indexcache.config import IndexCacheConfig
from indexcache.formats import FP32_HEADS, FP32_PARAMS
from indexcache.parallel import (WEIGHTS_CHOICES, ParallelContext, ShardedLinear, head_dtype, head_logits,
                                 make_embedding, make_lm_head, stage_bounds, stage_start_full_pattern)
from indexcache.plan import LayerPlan, build_layer_plan

from .args import BLOCK_SIZE, ModelArgs, _dtype, split_overrides
from .blocks import AbsentLayer, DecoderLayer, MTPLayer, RMSNorm, rope_inv_freq
from .blocks.hyper import HyperDecoderLayer, HyperHead
from . import step_reuse
from .state import BatchMeta, ForwardContext, PagedKVCache, StageTimer, TorchPass


class DSAModel(nn.Module):
    """Embedding, layers, final norm. Under pipeline parallelism a stage builds only its own layers
    (the others are ``AbsentLayer``), the embedding on the first stage, the norm on the last."""

    def __init__(self, args: ModelArgs, build_indexer: list, indexer_fp8: bool, par: Optional[ParallelContext] = None,
                 make_layer=None):
        super().__init__()
        par, L = par or ParallelContext(), args.num_hidden_layers
        self.embed_tokens = make_embedding(args.vocab_size, args.hidden_size, par) if par.first_stage else None
        make_layer = make_layer or (HyperDecoderLayer if args.hc_mult else DecoderLayer)
        layers = [make_layer(args, i, build_indexer[i], indexer_fp8, par) if par.owns_layer(i, L)
                  else AbsentLayer(i) for i in range(L)]
        layers += [MTPLayer(args, L + j, indexer_fp8, par) if par.owns_layer(L + j, L) else AbsentLayer(L + j)
                   for j in range(args.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if par.last_stage else None
        # hyper-connections (HY-V4): the streams collapse before the final norm
        self.hc_mult = args.hc_mult
        self.hc_head = HyperHead(args) if args.hc_mult and par.last_stage else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[N]`` -> the residual stream the first layer reads: ``[N, hidden]``, or with
        hyper-connections ``[N, hc_mult, hidden]``, every stream the embedding."""
        x = self.embed_tokens(input_ids)
        return x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous() if self.hc_mult else x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream -> the normed hidden states ``[N, hidden]`` (streams collapsed first)."""
        return self.norm(x if self.hc_head is None else self.hc_head(x))


# model_type -> family class: every subclass that names its own model_type (registry.py imports them all)
FAMILIES: dict = {}


def model_type_of(config: Mapping[str, Any]) -> str:
    """The family of a config.json (``model_type``, else its ``architectures``); ValueError if none."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type is None:
        model_type = next((mt for mt, cls in FAMILIES.items() if cls.architecture in archs), None)
    if model_type not in FAMILIES:
        known = ", ".join(f"{mt!r} ({cls.architecture})" for mt, cls in FAMILIES.items())
        raise ValueError(f"unsupported model_type {config.get('model_type')!r}: indexcache runs the DSA families {known}")
    return model_type


class DSAForCausalLM(nn.Module):
    """A family file subclasses this and names its ``model_type``, its transformers
    ``architecture`` and the ``config_defaults`` for fields its config.json may omit.

    A family whose layers are not all DSA layers says which main layers are **indexed**
    (``indexed_layers``: the plan covers those only, DESIGN.md §2) and builds its own layers
    (``decoder_layer``, constructed as ``DecoderLayer`` is) and caches (``allocate_cache``)."""
    model_type = ""
    architecture = ""
    args_class = ModelArgs  # a family with fields of its own subclasses ModelArgs
    config_defaults: dict = {}
    # parameter-name suffixes the family keeps in fp32 whatever the model dtype (beside FP32_PARAMS)
    fp32_params: tuple = ()
    # (regex, replacement) from a parameter's name to its checkpoint tensor's name, in order
    checkpoint_renames: tuple = ()

    @classmethod
    def family_config(cls, config: dict) -> dict:
        """The family's reading of its config.json before ``ModelArgs`` is built (default: as is)."""
        return config

    @classmethod
    def index_cache_config(cls, config: dict) -> dict:
        """The config.json keys IndexCache reads its shipped settings from (default: the file as is)."""
        return config

    @classmethod
    def indexed_layers(cls, args: ModelArgs) -> list:
        """The main layer ids that carry an indexer, in order (default: every layer)."""
        return list(range(args.num_hidden_layers))

    decoder_layer = None  # a family's decoder-layer class (None: the DSA DecoderLayer)
    mla = True  # the layers are MLA + the lightning indexer (CUDA needs their native widths); False: the family's own
    reuses_across_steps = True  # its indexer reuses across decode steps (models/step_reuse.py); False: refused

    def drops_checkpoint_tensor(self, name: str) -> bool:
        """Whether the loader passes over checkpoint tensor ``name`` (beyond the S layers' indexers)."""
        return False

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint tensor name of parameter ``name`` (the loader and ``save_pretrained``)."""
        for pattern, repl in self.checkpoint_renames:
            name = re.sub(pattern, repl, name)
        return name

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("model_type"):
            FAMILIES[cls.model_type] = cls

    def __init__(self, args: ModelArgs, plan: LayerPlan, *, indexer_fp8: Optional[bool] = None,
                 config: Optional[dict] = None, ic_config: Optional[IndexCacheConfig] = None,
                 parallel: Optional[ParallelContext] = None):
        super().__init__()
        self.indexed = self.indexed_layers(args)
        if len(plan.skip_topk) != len(self.indexed) + args.num_nextn_predict_layers:
            raise ValueError(f"plan covers {len(plan.skip_topk)} layers, the model has {len(self.indexed)} indexed "
                             f"+ {args.num_nextn_predict_layers} MTP")
        self.par = par = parallel or ParallelContext()
        validate_parallel(args, par)
        self.args, self.plan, self.ic_config = args, plan, ic_config
        self.config = dict(config or {})
        self.indexer_fp8 = indexer_fp8 is None or bool(indexer_fp8)
        self.compute_dtype = torch.float32  # set by _cast_params
        self.model = DSAModel(args, self.full_of(plan.skip_topk), self.indexer_fp8, par, self.decoder_layer)
        self.lm_head = make_lm_head(args.hidden_size, args.vocab_size, par) if par.last_stage else None
        if args.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight  # same vocabulary rows on every rank
        self.register_buffer("topk_buffer", torch.empty(0, dtype=torch.int32), persistent=False)
        self.register_buffer("rope_inv_freq", torch.empty(0), persistent=False)
        self._init_buffers()

    # ---------------------------------------------------------------- construction

    def _init_buffers(self) -> None:
        device = next(self.parameters()).device
        device = torch.device("cpu") if device.type == "meta" else device
        inv, self.rope_attn_factor = rope_inv_freq(self.args)
        self.rope_inv_freq = inv.to(device)
        self.topk_buffer = torch.full((self.args.max_num_batched_tokens, self.args.index_topk), -1,
                                      dtype=torch.int32, device=device)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], hf_overrides=None, *, dtype=torch.float32, device="cpu",
                    indexer_fp8: Optional[bool] = None, init: str = "random", seed: int = 0,
                    parallel: Optional[ParallelContext] = None,
                    pp_stage_starts_full: bool = False) -> "DSAForCausalLM":
        """Build from a config dict. ``init='random'`` draws seeded weights; ``'empty'`` leaves them
        uninitialised (for loading); ``'meta'`` builds on the meta device. ``parallel``: this rank's
        place in a tensor/pipeline-parallel run (default: one process); ``pp_stage_starts_full``:
        the engines' fallback, every pipeline stage's first layer forced to F (docs/parallel.md)."""
        config = dict(config)
        merged, ic_overrides = split_overrides(config, hf_overrides)
        found = model_type_of(merged)
        if found != cls.model_type:
            raise ValueError(f"config.json's model_type is {found!r} but {cls.__name__} runs "
                             f"{cls.model_type!r}: load it with indexcache.models.from_pretrained")
        args = cls.args_class.from_config(cls.family_config(merged), cls.model_type, cls.config_defaults)
        if cls.mla and torch.device(device).type == "cuda" and not (args.native_mla and args.native_indexer):
            raise ValueError(f"the CUDA kernels take the 512 + 64 latent and 128-wide indexer of every production "
                             f"DSA model; this checkpoint has kv_lora_rank {args.kv_lora_rank}, qk_rope_head_dim "
                             f"{args.qk_rope_head_dim}, index_head_dim {args.index_head_dim} (run it on the CPU)")
        ic = IndexCacheConfig.from_config(cls.index_cache_config(config), ic_overrides)
        indexed = cls.indexed_layers(args)
        plan = ic.plan(len(indexed), args.num_nextn_predict_layers, indexed)
        par = parallel or ParallelContext()
        step_reuse.check_family(cls, ic.index_reuse_steps)
        if pp_stage_starts_full and par.pp_size > 1:
            plan = stage_full_plan(plan, par.pp_size, indexed, args.num_hidden_layers)
        validate_parallel(args, par)
        with torch.device("meta"):
            model = cls(args, plan, indexer_fp8=indexer_fp8, config=merged, ic_config=ic, parallel=par)
        model._cast_params(_dtype(dtype))
        if init == "meta":
            return model
        model.to_empty(device=device)
        model._init_buffers()
        if init == "random":
            model.init_random_(seed)
        elif init != "empty":
            raise ValueError(f"init must be 'random', 'empty' or 'meta', got {init!r}")
        return model

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], *, hf_overrides=None, dtype=torch.bfloat16, device="cpu",
                        indexer_fp8: Optional[bool] = None, progress: Optional[bool] = None,
                        tp_size: Optional[int] = None, pp_size: int = 1, weights: str = "auto",
                        pp_stage_starts_full: bool = False) -> "DSAForCausalLM":
        """Load an HF-format DeepSeek-V3.2 checkpoint directory (DESIGN.md §10, §11).

        Inside an initialised ``torch.distributed`` default group, ``tp_size`` (None: world size //
        ``pp_size``) x ``pp_size`` ranks each read only their own slices. ``weights``: ``"auto"``
        keeps an FP8 checkpoint FP8 in memory, else the checkpoint's dtype; ``"fp8"`` holds the
        checkpoint's fp8 linears as e4m3 + 128x128 scales (quantizing a bf16 checkpoint's); ``"bf16"``
        dequantizes at load into ``dtype``. Every mismatch is an error before any weight is read."""
        from indexcache import loader
        if weights not in WEIGHTS_CHOICES:
            raise ValueError(f"weights {weights!r}: choose one of {', '.join(WEIGHTS_CHOICES)}")
        config = loader.load_config(path)
        fp8 = weights == "fp8" or (weights == "auto" and loader.is_fp8_checkpoint(config))
        par = ParallelContext.create(tp_size, pp_size, fp8=fp8)
        model = cls.from_config(config, hf_overrides, dtype=dtype, device=device, indexer_fp8=indexer_fp8, init="empty",
                                parallel=par, pp_stage_starts_full=pp_stage_starts_full)
        loader.load_weights(model, path, progress=progress)
        model.eval()
        return model

    def save_pretrained(self, path: Union[str, Path], *, fp8: bool = False, max_shard_bytes: Optional[int] = None) -> None:
        from indexcache import loader
        loader.save_pretrained(self, path, fp8=fp8, max_shard_bytes=max_shard_bytes)

    def _cast_params(self, dtype: torch.dtype) -> None:
        self.compute_dtype = dtype
        for name, p in self.named_parameters():
            if p.dtype == torch.float8_e4m3fn or name.endswith("weight_scale_inv"):
                continue  # FP8 weights and their fp32 block scales stay as they are
            keep32 = name.endswith(FP32_PARAMS + self.fp32_params)
            p.data = p.data.to(torch.float32 if keep32 else head_dtype(dtype) if name.endswith(FP32_HEADS) else dtype)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "DSAForCausalLM":
        """Deterministic random weights: drawn in fp32 on the CPU from one seeded generator."""
        g = torch.Generator().manual_seed(seed)
        fp8_owner = {id(m.weight): m for m in self.modules() if isinstance(m, ShardedLinear) and m.fp8}
        for name, p in self.named_parameters():
            if name.endswith("weight_scale_inv"):
                continue  # filled with its weight
            if id(p) in fp8_owner:
                full = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
                fp8_owner[id(p)].set_dense(full)
                continue
            if name.endswith(("norm.weight", "layernorm.weight")):
                t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith(("norm.bias", "e_score_correction_bias")):
                t = 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                t = torch.randn(p.shape, generator=g)
            else:  # linear weights [out, in]
                t = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(t)
        return self

    # ---------------------------------------------------------------- properties

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model was built in (activations, "auto" KV cache); the indexer's head weights
        and the router bias are fp32 parameters whatever it is, the LM heads fp32 or bf16 (``head_dtype``)."""
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.topk_buffer.device

    @property
    def mtp_layers(self) -> list:
        """The MTP layers (``AbsentLayer`` placeholders on pipeline stages other than the last)."""
        return list(self.model.layers[self.args.num_hidden_layers:])

    def indexer_param_count(self) -> list:
        """Indexer parameters per layer (0 for S layers and for layers of other pipeline stages)."""
        return [0 if l.self_attn is None or l.self_attn.indexer is None
                else sum(p.numel() for p in l.self_attn.indexer.parameters()) for l in self.model.layers]

    def resident_weight_bytes(self) -> int:
        """Bytes of this rank's parameters (FP8 weights at 1 B, their scales included)."""
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def full_of(self, skip_topk) -> list:
        """Per layer id (main, then MTP): whether the layer runs its indexer, from per-indexed-layer
        skip flags (``LayerPlan.skip_topk``'s layout: indexed main layers, then MTP). A layer with no
        indexer in the family is never F."""
        L, n = self.args.num_hidden_layers, len(self.indexed)
        full = [False] * L
        for pos, layer_id in enumerate(self.indexed):
            full[layer_id] = not skip_topk[pos]
        return full + [not s for s in skip_topk[n:]]

    def plan_summary(self) -> str:
        head = self.ic_config.describe(self.plan) if self.ic_config is not None else \
            f"IndexCache plan: {self.plan.num_full} F / {self.plan.num_shared} S; from {self.plan.rule}"
        return head + f"\npattern: {self.plan.pattern}"

    def allocate_cache(self, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = BLOCK_SIZE) -> PagedKVCache:
        return PagedKVCache(self, num_blocks, kv_cache_dtype, block_size)

    # ---------------------------------------------------------------- forward

    def forward_context(self, meta: BatchMeta, cache: Optional[PagedKVCache] = None, timer: Optional[StageTimer] = None,
                        *, sync_free: bool = False, full=None, torch_pass: Optional[TorchPass] = None) -> ForwardContext:
        """The state of one forward over ``meta``'s rows. ``full``: per layer id (main, then MTP),
        whether the layer runs its indexer (default: the plan). ``torch_pass``: run the blocks'
        differentiable torch definitions (training) instead of the kernels."""
        n = meta.num_tokens
        rows = self.topk_buffer.shape[0]
        if n > rows and torch_pass is None:
            raise ValueError(f"batch has {n} tokens but the top-k buffer has {rows} rows "
                             f"(max_num_batched_tokens); split the batch or raise max_num_batched_tokens")
        if meta.paged and cache is None:
            raise ValueError("a paged batch needs its PagedKVCache")
        layers = self.args.num_hidden_layers + self.args.num_nextn_predict_layers
        if full is None:
            full = self.full_of(self.plan.skip_topk)
        elif len(full) != layers:
            raise ValueError(f"full names {len(full)} layers, the model has {layers}")
        angles = meta.positions.float().unsqueeze(1) * self.rope_inv_freq.unsqueeze(0)
        cos, sin = angles.cos() * self.rope_attn_factor, angles.sin() * self.rope_attn_factor
        return ForwardContext(meta, cos, sin, self.topk_buffer, tuple(bool(f) for f in full), cache, timer,
                              sync_free=sync_free, torch_pass=torch_pass)

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.args.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.args.vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``LongTensor [B, T]`` -> logits fp32 ``[B, T, vocab]``: one whole-prompt prefill, no cache."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got "
                             f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        b, t = input_ids.shape
        if b == 0 or t == 0:
            raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
        if t > self.args.max_position_embeddings:
            raise ValueError(f"prompt of {t} tokens exceeds max_position_embeddings {self.args.max_position_embeddings}")
        self._check_ids(input_ids)
        meta = BatchMeta.dense(b, t, self.device)
        h = self.forward_tokens(input_ids.reshape(-1).to(self.device), meta)
        return self.compute_logits(h).view(b, t, -1)

    index_reuse_steps = property(lambda self: getattr(self.ic_config, "index_reuse_steps", 1),
                                 doc="Decode steps an F layer's selection serves a request (1: off).")
    min_recall = property(lambda self: getattr(self.ic_config, "index_reuse_min_recall", None),
                          doc="index_reuse_min_recall: the adaptive reuse's recall bar (None: fixed schedule).")

    @torch.no_grad()
    def forward_tokens(self, input_ids: torch.Tensor, meta: BatchMeta, cache: Optional[PagedKVCache] = None,
                       timer: Optional[StageTimer] = None, sync_free: bool = False, *,
                       reuse: bool = True) -> torch.Tensor:
        """Main layers over a flattened batch; returns the final-normed hidden states ``[N, hidden]``.
        ``sync_free``: read nothing back to the host (a CUDA graph's decode step, runtime/cuda_graph.py).
        ``reuse``: under ``index_reuse_steps`` > 1, a request's single row may reuse its F layers' last
        selections (models/step_reuse.py); False (prefill) computes every row."""
        ctx = self.forward_context(meta, cache, timer, sync_free=sync_free)
        if meta.paged:  # step reuse (adaptive with a recall bar) in force for this forward
            ctx.reuse_steps, ctx.decode_reuse, ctx.reuse_min_recall = self.index_reuse_steps, reuse, self.min_recall
        return self.hidden_states(input_ids, ctx)

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Embedding, the main layers and the final norm under ``ctx`` (gradients follow the caller's
        grad mode: training calls this under a ``TorchPass``): ``[N]`` token ids -> ``[N, hidden]``."""
        par, n, L = self.par, ctx.meta.num_tokens, self.args.num_hidden_layers
        stream = (n, self.args.hc_mult, self.args.hidden_size) if self.args.hc_mult else (n, self.args.hidden_size)
        if par.first_stage:
            x = self.model.embed(input_ids)
        else:  # the previous stage's residual stream, its step-reuse verdicts and, if this stage begins on S, its rows
            x = torch.empty(stream, dtype=self.compute_dtype, device=self.device)
            ctx.topk_valid, verdicts = par.recv_prev(x, self._stage_rows(par.pp_rank, ctx), len(step_reuse.verdicts(ctx)))
            step_reuse.take_verdicts(ctx, verdicts)
        for layer in self.model.layers[:L]:
            if not isinstance(layer, AbsentLayer):
                x = layer(x, ctx)
        if not par.last_stage:
            par.send_next(x, self._stage_rows(par.pp_rank + 1, ctx), ctx.topk_valid, step_reuse.verdicts(ctx))
            h = torch.empty(n, self.args.hidden_size, dtype=self.compute_dtype, device=self.device)
        else:
            h = self.model.final_norm(x)
        if par.pp_size > 1:  # every rank returns the same hidden states and holds the same top-k rows
            par.broadcast_from_last(h)
            par.broadcast_from_last(ctx.topk_rows)
        return h

    def torch_pass_context(self, torch_pass: TorchPass, full=None) -> ForwardContext:
        """The context of a differentiable forward over ``torch_pass.batch`` requests of ``seq`` tokens."""
        if self.par.tp_size > 1 or self.par.pp_size > 1:
            raise ValueError("the differentiable forward runs in one process (no tensor or pipeline parallelism)")
        meta = BatchMeta.dense(torch_pass.batch, torch_pass.seq, self.device)
        return self.forward_context(meta, full=full, torch_pass=torch_pass)

    def _stage_rows(self, stage: int, ctx: ForwardContext) -> Optional[torch.Tensor]:
        """The top-k rows handed to pipeline stage ``stage`` when its first indexed layer is S in this
        forward (it reuses the previous stage's rows), else None."""
        lo, hi = stage_bounds(self.args.num_hidden_layers, self.par.pp_size)[stage:stage + 2]
        first = next((i for i in self.indexed if lo <= i < hi), None)
        return ctx.topk_rows if stage > 0 and first is not None and not ctx.is_full(first) else None

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 full-vocabulary logits, on every rank."""
        par = self.par
        if par.last_stage:
            logits = head_logits(self.lm_head, hidden, self.args.vocab_size, par)
        else:
            logits = torch.empty(*hidden.shape[:-1], self.args.vocab_size, device=self.device)
        return par.broadcast_from_last(logits)

    @torch.no_grad()
    def forward_mtp(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: BatchMeta,
                    cache: Optional[PagedKVCache] = None, *, mtp_index: int = 0,
                    reuse_topk: Optional[torch.Tensor] = None,
                    timer: Optional[StageTimer] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft step: row i pairs ``prev_hidden[i]`` (h of token i) with ``input_ids[i]``
        (token i+1) at position i. Returns (the layer's hidden ``[N, hidden]``, logits fp32).

        ``reuse_topk`` int32 ``[N, index_topk]``: rows to attend over instead of running the MTP
        indexer (draft steps after the first; DESIGN.md §6).
        """
        if not self.mtp_layers:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers is 0)")
        layer = self.mtp_layers[mtp_index % len(self.mtp_layers)]
        full = self.full_of(self.plan.skip_topk)
        full[layer.layer_id] = reuse_topk is None  # later draft steps attend over step 0's rows
        ctx = self.forward_context(meta, cache, timer, full=full)
        par, n = self.par, meta.num_tokens
        if reuse_topk is not None:
            ctx.reuse_rows(reuse_topk)
        if par.pp_size == 1:
            embeds = self.model.embed_tokens(input_ids)
        elif par.first_stage:  # the MTP layer (last stage) shares the first stage's embedding
            par.send_to_last(self.model.embed_tokens(input_ids))
        elif par.last_stage:
            embeds = par.recv_from_first(torch.empty(n, self.args.hidden_size, dtype=self.compute_dtype,
                                                     device=self.device))
        if par.last_stage:
            h = layer.forward_mtp(embeds, prev_hidden, ctx)
            logits = head_logits(layer.shared_head.head, layer.shared_head.norm(h), self.args.vocab_size, par)
        else:
            h = torch.empty(n, self.args.hidden_size, dtype=self.compute_dtype, device=self.device)
            logits = torch.empty(n, self.args.vocab_size, device=self.device)
        if par.pp_size > 1:
            for t in (h, logits, ctx.topk_rows):
                par.broadcast_from_last(t)
        return h, logits


def validate_parallel(args: ModelArgs, par: ParallelContext) -> None:
    """Every layout mismatch as one clear ValueError (before any weight is read)."""
    tp, pp = par.tp_size, par.pp_size
    if tp == 1 and pp == 1:
        return
    bad = []
    for what, n in (("num_attention_heads", args.num_attention_heads), ("n_routed_experts", args.n_routed_experts),
                    ("intermediate_size (dense MLP)", args.intermediate_size),
                    ("shared-expert width (moe_intermediate_size x n_shared_experts)",
                     args.moe_intermediate_size * args.n_shared_experts)):
        if n % tp:
            bad.append(f"{what} {n} is not divisible by tp_size {tp}")
    if args.num_hidden_layers < pp:
        bad.append(f"num_hidden_layers {args.num_hidden_layers} is fewer than pp_size {pp} (each stage needs a layer)")
    if bad:
        raise ValueError("cannot split this model over tp_size %d x pp_size %d: %s" % (tp, pp, "; ".join(bad)))


def stage_full_plan(plan: LayerPlan, pp_size: int, indexed: Optional[list] = None,
                    num_layers: Optional[int] = None) -> LayerPlan:
    """The plan with every pipeline stage's first indexed layer forced to F (vLLM's fallback).
    ``indexed``: the main layer ids the plan covers, of ``num_layers`` (default: every layer)."""
    if indexed is None or len(indexed) == num_layers:
        pattern = stage_start_full_pattern(plan.pattern, plan.num_hidden_layers, pp_size)
    else:
        chars = list(plan.pattern)
        bounds = stage_bounds(num_layers, pp_size)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            pos = next((p for p, i in enumerate(indexed) if lo <= i < hi), None)
            if pos is not None:
                chars[pos] = "F"
        pattern = "".join(chars)
    if pattern == plan.pattern:
        return plan
    return build_layer_plan(plan.num_hidden_layers, plan.num_nextn_predict_layers, use_index_cache=True,
                            index_topk_pattern=pattern)
