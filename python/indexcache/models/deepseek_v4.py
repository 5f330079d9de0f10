"""DeepSeek-V4 (``model_type: deepseek_v4``, transformers' ``DeepseekV4ForCausalLM``; V4, V4-Flash,
V4.1) on the model core, with IndexCache across its compressed-sparse-attention layers.

- layers (``layer_types``): ``sliding_attention``, ``compressed_sparse_attention`` (CSA: entries
  of ``compress_rates[CSA]`` tokens, overlapping windows, a lightning indexer keeps the top
  ``index_topk`` per query) and ``heavily_compressed_attention`` (HCA: entries of
  ``compress_rates[HCA]`` tokens, all attended); attention is shared-KV MQA with sinks and a
  grouped low-rank output projection (``blocks/v4_attention.py``, ``blocks/compressor.py``);
- residuals: manifold hyper-connections (``hc_mult`` streams, Sinkhorn-normalised mixing,
  ``blocks/hyper.py``), collapsed by the final ``hc_head``;
- every layer is MoE: token-id hash routing on the first ``hash_moe`` layers, sqrt-softplus
  scores after; clamped SwiGLU experts and one clamped shared expert (``blocks/moe.py``).

IndexCache (DESIGN.md §2): the plan covers the CSA layers only, in order (a pattern or
``indexer_types`` has one entry per CSA layer). An S CSA layer keeps its KV compressor, owns no
indexer (none of ``self_attn.compressor.indexer.*`` is built or read) and attends the entries
that the nearest earlier F CSA layer picked in the same forward (the shared top-k rows hold
entry ids). MTP layers (``mtp.*``, which transformers does not build either) are neither built
nor read, whatever ``num_nextn_predict_layers`` says. Tensors are read by their own names (the
blocks use transformers' names).
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from indexcache.parallel import ParallelContext

from .args import ModelArgs, _rope_from_config
from .blocks.hyper import ManifoldHyperConnection, mix_streams
from .blocks.moe import V4MoE
from .blocks.norms import RMSNorm
from .blocks.rope import rope_inv_freq
from .blocks.v4_attention import V4Attention
from .blocks.v4_cache import CSA, HCA, SLIDING, V4Batch, V4DenseStore, V4PagedCache
from .dsa import DSAForCausalLM
from .state import BatchMeta, ForwardContext

_LAYER_TENSOR = re.compile(r"^(?:model\.)?layers\.(\d+)\.attn\.indexer\.")
# set while from_pretrained builds a model for a checkpoint in DeepSeek's own layout (no "model." prefix)
_OFFICIAL_LAYOUT = contextvars.ContextVar("deepseek_v4_official_layout", default=False)
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}


class V4DecoderLayer(nn.Module):
    """Norm, attention, norm, MoE, each wrapped in a manifold hyper-connection (streams ``[N, hc, D]``)."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool,
                 par: ParallelContext | None = None):
        super().__init__()
        self.par, self.layer_id = par or ParallelContext(), layer_id
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = V4Attention(args, layer_id, build_indexer, self.par)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = V4MoE(args, layer_id, self.par)
        self.attn_hc = ManifoldHyperConnection(args)
        self.ffn_hc = ManifoldHyperConnection(args)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        post, comb, h = self.attn_hc(x)
        x = mix_streams(x, post, comb, self.self_attn(self.input_layernorm(h), ctx))
        with ctx.stage(self.layer_id, "moe"):
            post, comb, h = self.ffn_hc(x)
            y = self.mlp(self.post_attention_layernorm(h), ctx.v4.token_ids(h.shape[0]), ctx.sync_free)
            return mix_streams(x, post, comb, y)


def _layer_types(c: dict, n: int) -> list:
    """``layer_types``, else the legacy per-layer ``compress_ratios``, else transformers' default."""
    types = c.get("layer_types")
    if types is None and c.get("compress_ratios") is not None:
        try:
            types = [_RATIO_TYPES[int(r)] for r in c["compress_ratios"]]
        except KeyError as e:
            raise ValueError(f"compress_ratios entry {e.args[0]} is not one of 0, 4, 128") from None
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    bad = [t for t in types if t not in (SLIDING, CSA, HCA)]
    if len(types) != n or bad:
        raise ValueError(f"layer_types must name one of {SLIDING!r}, {CSA!r}, {HCA!r} for each of the {n} layers, "
                         f"got {types!r}")
    return types


def _hash_layers(c: dict, n: int) -> int:
    kinds = c.get("mlp_layer_types")
    if kinds is None:
        return min(n, int(c.get("num_hash_layers", 3)))
    kinds = list(kinds)[:n]
    k = next((i for i, t in enumerate(kinds) if t != "hash_moe"), len(kinds))
    if len(kinds) != n or any(t not in ("hash_moe", "moe") for t in kinds) or "hash_moe" in kinds[k:]:
        raise ValueError(f"mlp_layer_types must be 'hash_moe' on the first layers then 'moe', one per layer; got {kinds!r}")
    return k


def _check_widths(c: dict) -> None:
    """The DeepSeek-V4 widths the blocks rely on, each a clear ValueError."""
    heads, groups = int(c["num_attention_heads"]), int(c.get("o_groups") or 8)
    problems = []
    if min(c["csa_rate"], c["hca_rate"]) < 1:
        problems.append(f"compress_rates must be >= 1 (CSA {c['csa_rate']}, HCA {c['hca_rate']})")
    if int(c.get("sliding_window") or 128) < 1:
        problems.append(f"sliding_window must be >= 1, got {c.get('sliding_window')}")
    if groups < 1 or heads % groups:
        problems.append(f"o_groups {groups} must divide num_attention_heads {heads}")
    if c["qk_rope_head_dim"] % 2 or not 2 <= c["qk_rope_head_dim"] <= c["head_dim"]:
        problems.append(f"the rotary dims ({c['qk_rope_head_dim']}) must be even and within head_dim {c['head_dim']}")
    if problems:
        raise ValueError("DeepSeek-V4 config: " + "; ".join(problems))


def _ropes(c: dict) -> tuple:
    """(main theta, compress theta, compress YaRN or None) from nested or flat rope parameters."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_theta = rp["main"].get("rope_theta", c.get("rope_theta", 10000.0))
        comp = rp["compress"]
    else:
        main_theta, comp = c.get("rope_theta", 10000.0), {k: v for k, v in rp.items() if k not in ("main", "compress")}
    theta = comp.get("rope_theta", c.get("compress_rope_theta", 160000.0))
    _, scaling = _rope_from_config({"rope_scaling": comp, "rope_theta": theta})
    return float(main_theta), float(theta), scaling


class DeepseekV4ForCausalLM(DSAForCausalLM):
    model_type = "deepseek_v4"
    reuses_across_steps = False
    architecture = "DeepseekV4ForCausalLM"
    config_defaults = {
        "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "swiglu_limit": 10.0, "fused_experts": False,
        "n_group": 1, "topk_group": 1, "moe_scoring": "sqrtsoftplus", "rms_norm_eps": 1e-6, "sliding_window": 128,
        "o_groups": 8, "o_lora_rank": 1024, "head_dim": 512, "routed_scaling_factor": 1.5, "norm_topk_prob": True,
        "num_nextn_predict_layers": 0, "max_position_embeddings": 1048576,
    }
    fp32_params = ("self_attn.sinks", "attn_hc.fn", "attn_hc.base", "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base",
                   "ffn_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale", "position_bias",
                   "kv_norm.weight", "q_a_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                   "model.norm.weight")
    decoder_layer = V4DecoderLayer
    # parameter name (transformers' in-memory names) -> the checkpoint's (DeepSeek's, as transformers writes them)
    checkpoint_renames = (
        (r"^lm_head\.weight$", "head.weight"),
        (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
        (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
        (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
        (r"\.self_attn\.", ".attn."),
        (r"\.mlp\.(shared_experts|experts\.\d+)\.gate_proj\.", r".ffn.\1.w1."),
        (r"\.mlp\.(shared_experts|experts\.\d+)\.down_proj\.", r".ffn.\1.w2."),
        (r"\.mlp\.(shared_experts|experts\.\d+)\.up_proj\.", r".ffn.\1.w3."),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
        (r"\.mlp\.", ".ffn."),
        (r"\.input_layernorm\.", ".attn_norm."),
        (r"\.post_attention_layernorm\.", ".ffn_norm."),
        (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
        (r"\.sinks$", ".attn_sink"),
        (r"\.kv_norm\.", ".norm."),
        (r"\.position_bias$", ".ape"),
        (r"\.q_a_proj\.", ".wq_a."),
        (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
        (r"\.kv_proj\.", ".wkv."),
        (r"\.gate_proj\.", ".wgate."),
        (r"\.o_a_proj\.", ".wo_a."),
        (r"\.o_b_proj\.", ".wo_b."),
        (r"\.q_a_norm\.", ".q_norm."),
    )

    @classmethod
    def family_config(cls, config: dict) -> dict:
        c = dict(config)
        n = int(c["num_hidden_layers"])
        head = int(c.get("head_dim") or 512)
        rope = c.get("qk_rope_head_dim") or int(head * (c.get("partial_rotary_factor") or 64 / 512))
        rates = {CSA: 4, HCA: 128, **(c.get("compress_rates") or {})}
        rates[CSA] = c.get("compress_rate_csa", rates[CSA])
        rates[HCA] = c.get("compress_rate_hca", rates[HCA])
        main_theta, comp_theta, comp_scaling = _ropes(c)
        for legacy in ("compress_ratios", "compress_rate_csa", "compress_rate_hca", "num_hash_layers"):
            c.pop(legacy, None)
        c.update(v4_layer_types=_layer_types(config, n), hash_moe_layers=_hash_layers(config, n),
                 mlp_layer_types=["sparse"] * n, moe_scoring=c.pop("scoring_func", None) or "sqrtsoftplus",
                 head_dim=head, kv_lora_rank=head, qk_rope_head_dim=rope, qk_nope_head_dim=head - rope, v_head_dim=head,
                 intermediate_size=c.get("moe_intermediate_size"), csa_rate=int(rates[CSA]), hca_rate=int(rates[HCA]),
                 rope_theta=main_theta, rope_parameters=None, rope_scaling=None, compress_rope_theta=comp_theta,
                 compress_rope_scaling=comp_scaling, num_nextn_predict_layers=0)
        if c["moe_scoring"] not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"scoring_func {c['moe_scoring']!r} is not supported (sqrtsoftplus, sigmoid or softmax)")
        _check_widths(c)
        return c

    @classmethod
    def indexed_layers(cls, args: ModelArgs) -> list:
        return [i for i, t in enumerate(args.v4_layer_types) if t == CSA]

    def __init__(self, args: ModelArgs, plan, **kwargs):
        # tensor parallel: attention heads split by output group (q_b_proj columns, sinks, o_a_proj
        # groups, o_b_proj rows; one all-reduce), routed experts by expert, the shared expert column /
        # row; the KV projection, compressors, indexers and hyper-connections replicated
        super().__init__(args, plan, **kwargs)
        self.official_layout = _OFFICIAL_LAYOUT.get()
        self.indexer_fp8 = False  # the CSA indexer scores in fp32, as transformers' (no fp8 path yet)
        self._embedded_ids = None
        embed = self.model.embed

        def remember(input_ids: torch.Tensor) -> torch.Tensor:  # hash routing needs the ids of the rows
            self._embedded_ids = input_ids
            return embed(input_ids)
        self.model.embed = remember

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "DeepseekV4ForCausalLM":
        """As ``DSAForCausalLM.from_pretrained``; reads both layouts of the names: transformers'
        (``model.layers.N.attn.wq_a.weight``, ``model.embed_tokens.weight``) and DeepSeek's own
        (``layers.N.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``, ``norm.weight``)."""
        from indexcache import loader
        p = Path(path)
        names = set(loader._weight_files(p)) if p.is_dir() else set()
        token = _OFFICIAL_LAYOUT.set("embed.weight" in names and "model.embed_tokens.weight" not in names)
        try:
            return super().from_pretrained(path, **kwargs)
        finally:
            _OFFICIAL_LAYOUT.reset(token)

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        if getattr(self, "official_layout", False):
            name = re.sub(r"^model\.embed_tokens\.", "embed.", name)
            name = re.sub(r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)
            name = re.sub(r"^model\.", "", name)
        return name

    def drops_checkpoint_tensor(self, name: str) -> bool:
        if name.startswith("mtp.") or ".mtp." in name:
            return True  # the MTP layers, which neither transformers nor this model runs
        m = _LAYER_TENSOR.match(name)
        if m is None or int(m.group(1)) >= len(self.model.layers):
            return False
        # an S CSA layer's indexer (a layer of another pipeline stage has no self_attn: not ours to judge)
        return getattr(self.model.layers[int(m.group(1))].self_attn, "indexer", 0) is None

    # ---------------------------------------------------------------- construction

    def _init_buffers(self) -> None:
        super()._init_buffers()
        args = self.args
        comp = replace(args, rope_theta=args.compress_rope_theta, rope_scaling=args.compress_rope_scaling)
        # transformers' compress RoPE keeps cos/sin unscaled (attention_factor 1) under YaRN
        self.v4_inv_freq = {"main": rope_inv_freq(replace(args, rope_scaling=None))[0].to(self.device),
                            "compress": rope_inv_freq(comp)[0].to(self.device)}

    def _cast_params(self, dtype: torch.dtype) -> None:
        super()._cast_params(dtype)
        for name, p in self.named_parameters():
            if name.endswith("tid2eid"):
                p.data = p.data.to(torch.int64)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "DeepseekV4ForCausalLM":
        super().init_random_(seed)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in self.named_parameters():
            if name.endswith("tid2eid"):
                p.copy_(torch.randint(0, self.args.n_routed_experts, p.shape, generator=g))
            elif name.endswith("position_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        return self

    def allocate_cache(self, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = 64) -> V4PagedCache:
        return V4PagedCache(self, num_blocks, kv_cache_dtype, block_size)

    # ---------------------------------------------------------------- forward

    def forward_context(self, meta: BatchMeta, cache=None, timer=None, *, sync_free: bool = False, full=None,
                        torch_pass=None) -> ForwardContext:
        if torch_pass is not None:
            raise ValueError("DeepSeek-V4 has no differentiable (training) forward yet")
        if sync_free:  # its compressors and indexer read window closings and lengths on the host
            raise ValueError("DeepSeek-V4 has no sync-free (CUDA graph) decode step yet: use decode_step='eager'")
        ctx = super().forward_context(meta, cache, timer, sync_free=sync_free, full=full)
        rope = {}
        for kind, inv in self.v4_inv_freq.items():
            angles = meta.positions.float().unsqueeze(1) * inv.unsqueeze(0)
            rope[kind] = (angles.cos(), angles.sin())
        ctx.v4 = V4Batch(cache if meta.paged else V4DenseStore(self, meta), rope, self.v4_inv_freq["compress"],
                         embedded_ids=lambda: self._embedded_ids)
        return ctx

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ctx.v4.input_ids = input_ids  # hash routing reads the token ids
        return super().hidden_states(input_ids, ctx)


def csa_layers_of(config: dict) -> list:
    """The main layer ids of a DeepSeek-V4 config.json's CSA layers (the layers the plan covers)."""
    n = int(config["num_hidden_layers"])
    return [i for i, t in enumerate(_layer_types(config, n)) if t == CSA]


def csa_indexer_costs(config: dict, plan, context: int) -> dict:
    """What a plan over the CSA layers removes against all-F at ``context`` tokens, per sequence.

    Per F CSA layer and token: the indexer's projections (``q_b_proj``, ``weights_proj``) and its
    compressor (``kv_proj`` + ``gate_proj``, two series of ``index_head_dim``); per query, the
    ReLU-weighted score over every visible compressed key (``(t + 1) // rate`` of them). Bytes:
    the compressed index keys as the engines hold them (e4m3 key + one fp32 scale per entry, the
    V3.2 index-K format over entries of ``rate`` tokens). Top-k selection is not counted."""
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    c = DeepseekV4ForCausalLM.family_config(config)
    h, d, hidden, q_lora = (int(c.get(k) or v) for k, v in (("index_n_heads", 64), ("index_head_dim", 128),
                                                              ("hidden_size", 4096), ("q_lora_rank", 1024)))
    rate = c["csa_rate"]
    proj = 2 * q_lora * h * d + 2 * hidden * h + 2 * 2 * hidden * 2 * d
    per_key = 2 * h * d + 2 * h
    entries = context // rate
    # Σ_{t<C} (t + 1) // rate: the visible keys summed over a prefill's queries
    visible = sum((t + 1) // rate for t in range(context)) if context <= 1 << 20 else context * context // (2 * rate)
    layers = len(csa_layers_of(config))

    def entry(per_layer):
        full, kept = per_layer * layers, per_layer * plan.num_full
        return {"all_f": full, "plan": kept, "removed": full - kept, "removed_fraction": (full - kept) / full if full else 0.0}

    return {"context": context, "csa_rate": rate, "csa_layers": csa_layers_of(config),
            "dims": {"hidden_size": hidden, "q_lora_rank": q_lora, "index_n_heads": h, "index_head_dim": d},
            "decode_flops_per_token": entry(proj + entries * per_key),
            "prefill_flops": entry(context * proj + visible * per_key),
            "index_k_cache_bytes_per_sequence": entry(entries * (d + 4)),
            "index_k_bytes_per_token": entry((d + 4) / rate)}
