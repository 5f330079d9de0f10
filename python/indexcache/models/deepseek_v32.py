"""DeepSeek-V3.2 (DSA) with IndexCache, gpt-fast style (DESIGN.md §3–§6, §10).

One file holds the architecture, the paged caches and the per-forward batch description:

- ``ModelArgs``: the config.json fields the model needs (both RoPE spellings accepted).
- layers: RMSNorm, MLA with q/kv LoRA and interleaved YaRN RoPE, the DSA ``Indexer``,
  absorbed sparse MLA through the ops, dense MLP, group-limited sigmoid MoE, MTP layer.
- ``DeepseekV32ForCausalLM``: ``model(input_ids)`` is one whole-prompt prefill with no cache;
  ``forward_tokens`` runs a flattened batch of requests against a ``PagedKVCache``.

IndexCache: the ``LayerPlan`` decides at construction which layers own an indexer. S layers
have ``self_attn.indexer = None`` (no parameters, no index-K cache) and attend over the rows
that the last F layer wrote into the model's single shared top-k buffer in the same forward.
Every kernel call goes through ``ops`` below.
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from indexcache import ops
from indexcache.config import INDEX_CACHE_KEYS, IndexCacheConfig, parse_overrides
from indexcache.plan import LayerPlan

MLA_LATENT, MLA_ROPE = 512, 64  # the sparse MLA kernels are specialised to a 576-wide latent KV
INDEX_HEAD_DIM = 128            # one fp8 scale group per indexer key (132 B/token cache)
INDEX_Q_EPS, INDEX_K_EPS = 1e-10, 1e-4  # DESIGN.md §4
BLOCK_SIZE = 64                 # paged caches: tokens per block (MLA and index-K share tables)
FP8_DS_MLA_BYTES = MLA_LATENT + 4 * 4 + MLA_ROPE * 2  # 656
# Per-call working-set caps (elements: rows x keys x heads for scoring, rows x topk x (576 + heads)
# for attention) so that long prefills run in row chunks of bounded memory.
INDEXER_CHUNK_ELEMS = 1 << 26
ATTN_CHUNK_ELEMS = 1 << 26


# ============================================================================ configuration

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
_DSA_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
# config.json keys the model reads or knowingly ignores (override keys outside these warn).
_OTHER_KNOWN_KEYS = {
    "model_type", "architectures", "rope_scaling", "rope_parameters", "scoring_func", "topk_method",
    "hidden_act", "quantization_config", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "attention_bias", "attention_dropout", "initializer_range", "pretraining_tp", "ep_size", "auto_map",
    "num_key_value_heads", "aux_loss_alpha", "seq_aux", "indexcache_tokenizer", "pad_token_id",
}


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # normalised YaRN parameters, or None
    indexer_rope_interleave: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None
    # Runtime knobs (not architecture), settable through hf_overrides.
    max_num_batched_tokens: int = 8192   # rows of the shared top-k buffer
    indexer_hadamard: bool = False       # 128-point rotation before fp8 (DeepSeek reference; vLLM: off)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelArgs":
        """Build from a config.json dict (overrides already merged). Raises ValueError."""
        c = dict(config)
        model_type = c.get("model_type")
        archs = c.get("architectures") or []
        if model_type != "deepseek_v32" and not (model_type is None and "DeepseekV32ForCausalLM" in archs):
            raise ValueError(f"unsupported model_type {model_type!r}: this model is DeepSeek-V3.2 ('deepseek_v32')")
        missing_dsa = [k for k in _DSA_KEYS if c.get(k) is None]
        if missing_dsa:
            raise ValueError(f"config has no DSA indexer fields ({', '.join(missing_dsa)} missing): "
                             "not a DeepSeek Sparse Attention checkpoint")
        missing = [k for k in _REQUIRED if c.get(k) is None]
        if missing:
            raise ValueError(f"config.json lacks required keys: {', '.join(missing)}")
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
            if c.get(key) not in (None, want):
                raise ValueError(f"{key} {c[key]!r} is not supported (DeepSeek-V3.2 uses {want!r})")
        theta, scaling = _rope_from_config(c)
        names = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        args = cls(**{k: c[k] for k in names if c.get(k) is not None}, rope_theta=theta, rope_scaling=scaling)
        args.validate()
        return args

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        need(self.kv_lora_rank == MLA_LATENT and self.qk_rope_head_dim == MLA_ROPE,
             f"kv_lora_rank {self.kv_lora_rank} / qk_rope_head_dim {self.qk_rope_head_dim}: the sparse MLA "
             f"kernels need {MLA_LATENT} / {MLA_ROPE} (a 576-wide latent KV)")
        need(self.index_head_dim == INDEX_HEAD_DIM, f"index_head_dim {self.index_head_dim}: must be {INDEX_HEAD_DIM}")
        need(self.index_topk >= 1 and self.index_n_heads >= 1, "index_topk and index_n_heads must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        if self.n_routed_experts:
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0 with routed experts")
            need(self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
            need(1 <= self.topk_group <= self.n_group, f"topk_group {self.topk_group} must be in [1, n_group]")
            per_group = self.n_routed_experts // self.n_group
            need(1 <= self.num_experts_per_tok <= per_group * self.topk_group,
                 f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of {self.topk_group} groups")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return bool(self.n_routed_experts) and layer_id >= self.first_k_dense_replace \
            and layer_id % self.moe_layer_freq == 0


def _rope_from_config(c: Mapping[str, Any]) -> tuple[float, Optional[dict]]:
    """(theta, YaRN parameters or None) from ``rope_theta`` + ``rope_scaling`` or ``rope_parameters``."""
    params = c.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta, scaling = c.get("rope_theta", 10000.0), c.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (DeepSeek-V3.2 uses 'yarn')")
    out = {"factor": float(scaling.get("factor", 1.0)),
           "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 4096)),
           "beta_fast": float(scaling.get("beta_fast", 32)), "beta_slow": float(scaling.get("beta_slow", 1)),
           "mscale": float(scaling.get("mscale", 1.0)), "mscale_all_dim": float(scaling.get("mscale_all_dim", 0.0))}
    return float(theta), out


def split_overrides(config: Mapping[str, Any], hf_overrides) -> tuple[dict, dict]:
    """(config with model overrides merged, IndexCache-only overrides). Warns on unknown keys."""
    overrides = parse_overrides(hf_overrides)
    known = {f.name for f in fields(ModelArgs)} | _OTHER_KNOWN_KEYS | set(INDEX_CACHE_KEYS)
    unknown = sorted(k for k in overrides if k not in known and k not in config)
    if unknown:
        warnings.warn(f"--hf-overrides keys unknown to DeepSeek-V3.2 / IndexCache (ignored): {', '.join(unknown)}",
                      UserWarning, stacklevel=3)
    ic = {k: v for k, v in overrides.items() if k in INDEX_CACHE_KEYS}
    merged = {**config, **{k: v for k, v in overrides.items() if k not in INDEX_CACHE_KEYS and k not in unknown}}
    return merged, ic


# ============================================================================ batch description

@dataclass
class BatchMeta:
    """One forward over a flattened batch: request b contributes rows ``q_lens[b]`` at positions
    ``ctx_lens[b] ..``. ``slot_mapping`` None means no cache: the keys are the batch's own tokens,
    laid out as ``B`` uniform requests of ``block_size`` tokens (``model(input_ids)``)."""
    positions: torch.Tensor           # int64 [N] request-relative
    req_of_row: torch.Tensor          # int32 [N]
    q_lens: list
    ctx_lens: list
    seq_lens: torch.Tensor            # int32 [B] tokens in the cache after this step
    block_table: torch.Tensor         # int32 [B, max_blocks]
    block_size: int
    slot_mapping: Optional[torch.Tensor] = None  # int64 [N]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def paged(self) -> bool:
        return self.slot_mapping is not None

    @property
    def uniform_q(self) -> Optional[int]:
        return self.q_lens[0] if len(set(self.q_lens)) == 1 else None

    def row_offsets(self) -> list:
        out, acc = [], 0
        for n in self.q_lens:
            out.append(acc)
            acc += n
        return out

    @classmethod
    def dense(cls, batch: int, seq: int, device) -> "BatchMeta":
        pos = torch.arange(seq, device=device).repeat(batch)
        req = torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(seq)
        table = torch.arange(batch, device=device, dtype=torch.int32).view(batch, 1)
        lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
        return cls(pos, req, [seq] * batch, [0] * batch, lens, table, seq)

    @classmethod
    def paged_batch(cls, cache: "PagedKVCache", rids: Sequence, ctx_lens: Sequence[int], q_lens: Sequence[int]) -> "BatchMeta":
        """Rows for requests ``rids`` (blocks already allocated in ``cache.manager``)."""
        device = cache.device
        ctx_lens, q_lens = [int(c) for c in ctx_lens], [int(q) for q in q_lens]
        if any(q < 1 for q in q_lens):
            raise ValueError(f"every request in a batch needs >= 1 token, got q_lens {q_lens}")
        table = cache.manager.block_table(rids, device)
        for rid, c, q in zip(rids, ctx_lens, q_lens):
            if c + q > cache.manager.capacity(rid):
                raise ValueError(f"request {rid!r}: {c + q} tokens but only {cache.manager.capacity(rid)} allocated")
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)]).to(device)
        req = torch.repeat_interleave(torch.arange(len(q_lens), dtype=torch.int32), torch.tensor(q_lens)).to(device)
        lens = torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32, device=device)
        slots = ops.positions_to_slots(pos.view(-1, 1).int(), req, table, cache.block_size).view(-1).long()
        return cls(pos, req, q_lens, ctx_lens, lens, table, cache.block_size, slots)


# ============================================================================ paged caches

class CacheManager:
    """Hands out fixed-size blocks to requests; a request's block table grows on demand."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def capacity(self, rid) -> int:
        return len(self._tables.get(rid, ())) * self.block_size

    def allocate(self, rid, num_tokens: int) -> list:
        """Make room for ``num_tokens`` tokens of request ``rid``; returns its block list."""
        table = self._tables.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: request {rid!r} needs {need} more, {len(self._free)} free "
                               f"of {self.num_blocks}")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return table

    def free(self, rid) -> None:
        self._free.extend(reversed(self._tables.pop(rid, [])))

    def block_table(self, rids: Sequence, device) -> torch.Tensor:
        tables = [self._tables.get(r, []) for r in rids]
        width = max([len(t) for t in tables] + [1])
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(device)


class PagedKVCache:
    """Per-layer paged caches sharing one block table per request.

    ``kv[i]``: MLA latent cache, ``[num_blocks, block, 576]`` (bf16/fp32) or uint8
    ``[num_blocks, block, 656]`` (``fp8_ds_mla``). ``index_k[i]``: uint8 ``[num_blocks, block * 132]``
    (fp8 keys + fp32 scales) for layers that own an indexer, fp32 ``[num_blocks, block, 128]``
    with ``indexer_fp8=False``, and None for S layers.
    """

    def __init__(self, model: "DeepseekV32ForCausalLM", num_blocks: int, kv_cache_dtype: str = "auto",
                 block_size: int = BLOCK_SIZE):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.device = model.topk_buffer.device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_cache_dtype = kv_cache_dtype
        kv_dtype = _kv_dtype(kv_cache_dtype, model.dtype)
        self.manager = CacheManager(num_blocks, block_size)
        self.kv, self.index_k = [], []
        for layer in model.model.layers:
            if kv_dtype == torch.uint8:
                self.kv.append(torch.zeros(num_blocks, block_size, FP8_DS_MLA_BYTES, dtype=torch.uint8, device=self.device))
            else:
                self.kv.append(torch.zeros(num_blocks, block_size, MLA_LATENT + MLA_ROPE, dtype=kv_dtype, device=self.device))
            if layer.self_attn.indexer is None:
                self.index_k.append(None)
            elif model.indexer_fp8:
                self.index_k.append(torch.zeros(num_blocks, block_size * (INDEX_HEAD_DIM + 4), dtype=torch.uint8, device=self.device))
            else:
                self.index_k.append(torch.zeros(num_blocks, block_size, INDEX_HEAD_DIM, dtype=torch.float32, device=self.device))

    def layer_bytes(self, layer_id: int) -> tuple[int, int]:
        """(MLA KV bytes, index-K bytes) held for one layer."""
        ik = self.index_k[layer_id]
        kv = self.kv[layer_id]
        return kv.numel() * kv.element_size(), 0 if ik is None else ik.numel() * ik.element_size()

    def nbytes(self) -> dict:
        per = [self.layer_bytes(i) for i in range(len(self.kv))]
        return {"kv": sum(p[0] for p in per), "index_k": sum(p[1] for p in per)}


def _kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    table = {"auto": model_dtype, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32, "fp8_ds_mla": torch.uint8}
    if name not in table:
        raise ValueError(f"kv_cache_dtype {name!r}: choose one of {', '.join(table)}")
    return table[name]


# ============================================================================ per-forward context

class StageTimer:
    """Accumulates wall time per stage name (synchronising CUDA so that times are real)."""

    def __init__(self):
        self.times: dict = {}

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds


@dataclass
class ForwardContext:
    meta: BatchMeta
    cos: torch.Tensor                    # fp32 [N, rope / 2]
    sin: torch.Tensor
    topk_buffer: torch.Tensor            # the model's shared int32 [rows, index_topk]
    cache: Optional[PagedKVCache] = None
    timer: Optional[StageTimer] = None
    topk_valid: bool = False             # an F layer has written rows [:N] in this forward

    @property
    def topk_rows(self) -> torch.Tensor:
        return self.topk_buffer[: self.meta.num_tokens]

    @contextmanager
    def stage(self, layer_id: int, name: str):
        label = f"indexcache::layer{layer_id}::{name}"
        cuda = self.cos.is_cuda
        with torch.autograd.profiler.record_function(label):
            if cuda:
                torch.cuda.nvtx.range_push(label)
            t0 = time.perf_counter() if self.timer is not None else 0.0
            try:
                yield
            finally:
                if cuda:
                    torch.cuda.nvtx.range_pop()
                if self.timer is not None:
                    if cuda:
                        torch.cuda.synchronize()
                    self.timer.add(name, time.perf_counter() - t0)


def _row_chunks(n: int, per_row: int, budget: int):
    step = max(1, budget // max(per_row, 1))
    for r0 in range(0, n, step):
        yield r0, min(n, r0 + step)


# ============================================================================ layers

def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [N, ..., 2m]`` by per-row angles (cos/sin fp32 ``[N, m]``).

    interleaved: pairs (x[2i], x[2i+1]) (MLA, DeepSeek reference layout); otherwise NeoX
    split-half pairs (x[i], x[i+m]) (the V3.2 indexer).
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """YaRN-corrected inverse frequencies (DeepSeek reference) and the cos/sin attention factor."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    ys = args.rope_scaling
    if ys is None:
        return inv, 1.0
    factor, orig = ys["factor"], ys["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(ys["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(ys["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    inv = inv / factor * ramp + inv * (1 - ramp)
    attn_factor = 1.0
    if ys["mscale"] and ys["mscale_all_dim"]:
        attn_factor = yarn_get_mscale(factor, ys["mscale"]) / yarn_get_mscale(factor, ys["mscale_all_dim"])
    return inv, attn_factor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class Indexer(nn.Module):
    """The DSA lightning indexer: scores every visible key, writes the top-k rows (§4)."""

    def __init__(self, args: ModelArgs, layer_id: int, fp8: bool):
        super().__init__()
        self.layer_id, self.fp8, self.hadamard = layer_id, fp8, args.indexer_hadamard
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
        self.topk, self.rope_interleave = args.index_topk, args.indexer_rope_interleave
        self.wq_b = _linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = _linear(args.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = _linear(args.hidden_size, self.n_heads)  # kept in fp32

    def _rope(self, t, ctx):
        r = self.rope_dim
        return torch.cat((apply_rope(t[..., :r], ctx.cos, ctx.sin, self.rope_interleave), t[..., r:]), dim=-1)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Fill rows ``[:N]`` of the shared buffer with request-relative positions; returns them."""
        n, meta = x.shape[0], ctx.meta
        with ctx.stage(self.layer_id, "indexer"):
            q = self._rope(self.wq_b(qr).view(n, self.n_heads, self.head_dim), ctx)
            k = self._rope(self.k_norm(self.wk(x)), ctx)
            w = self.weights_proj(x.float())
            if self.fp8:
                q_in, q_scale = ops.quantize_fp8(q, INDEX_Q_EPS, self.hadamard)
                weights = ops.indexer_weights(w, q_scale.squeeze(-1))
            else:
                q_in, weights = q.float(), ops.indexer_weights(w)
            if meta.paged:
                cache = ctx.cache.index_k[self.layer_id]
                if self.fp8:
                    ops.index_k_cache_insert(k, meta.slot_mapping, cache, self.hadamard)
                else:
                    cache.view(-1, self.head_dim)[meta.slot_mapping] = k.float()
                k_in = k_scale = None
            elif self.fp8:
                k_in, k_scale = ops.quantize_fp8(k, INDEX_K_EPS, self.hadamard)
                k_scale = k_scale.view(-1)
            else:
                k_in, k_scale = k.float(), None
        with ctx.stage(self.layer_id, "topk"):
            rows = ctx.topk_rows
            ops.fill_topk_buffer_(ctx.topk_buffer, n)
            if not meta.paged:
                self._topk_dense(q_in, k_in, k_scale, weights, rows, meta)
            elif self.fp8:
                self._topk_paged_fp8(q_in, weights, ctx.cache.index_k[self.layer_id], rows, meta)
            else:
                self._topk_paged_fp32(q_in, weights, ctx.cache.index_k[self.layer_id], rows, meta)
        ctx.topk_valid = True
        return rows

    def _topk_dense(self, q, k, k_scale, weights, rows, meta):
        # Each request's keys are its own tokens; prefill row t sees keys [0, t].
        seq = meta.block_size
        for off in range(0, meta.num_tokens, seq):
            for r0, r1 in _row_chunks(seq, seq * self.n_heads, INDEXER_CHUNK_ELEMS):
                ks = torch.zeros(r1 - r0, dtype=torch.int32, device=q.device)
                ke = torch.arange(r0 + 1, r1 + 1, dtype=torch.int32, device=q.device)
                keys = slice(off, off + r1)
                ops.indexer_topk(q[off + r0:off + r1], k[keys], None if k_scale is None else k_scale[keys],
                                 weights[off + r0:off + r1], ks, ke, self.topk, out=rows[off + r0:off + r1])

    def _topk_paged_fp8(self, q, weights, cache, rows, meta):
        nq = meta.uniform_q
        if nq is not None and nq <= 8:  # decode / MTP verify: one batched call
            ops.indexer_topk_paged(q, weights, cache, meta.block_table, meta.seq_lens, nq, self.topk, out=rows)
            return
        for b, off in enumerate(meta.row_offsets()):
            c, qn = meta.ctx_lens[b], meta.q_lens[b]
            for r0, r1 in _row_chunks(qn, (c + qn) * self.n_heads, INDEXER_CHUNK_ELEMS):
                # rows r0..r1 of this chunk are "decode rows" of a request holding c + r1 tokens
                lens = torch.tensor([c + r1], dtype=torch.int32, device=q.device)
                ops.indexer_topk_paged(q[off + r0:off + r1], weights[off + r0:off + r1], cache,
                                       meta.block_table[b:b + 1], lens, r1 - r0, self.topk, out=rows[off + r0:off + r1])

    def _topk_paged_fp32(self, q, weights, cache, rows, meta):
        for b, off in enumerate(meta.row_offsets()):
            c, qn = meta.ctx_lens[b], meta.q_lens[b]
            pos = torch.arange(c + qn, device=q.device, dtype=torch.int32).view(1, -1)
            req = torch.zeros(1, dtype=torch.int32, device=q.device)
            slots = ops.positions_to_slots(pos, req, meta.block_table[b:b + 1], meta.block_size).view(-1).long()
            keys = cache.view(-1, self.head_dim)[slots]
            for r0, r1 in _row_chunks(qn, (c + qn) * self.n_heads, INDEXER_CHUNK_ELEMS):
                ks = torch.zeros(r1 - r0, dtype=torch.int32, device=q.device)
                ke = torch.arange(c + r0 + 1, c + r1 + 1, dtype=torch.int32, device=q.device)
                ops.indexer_topk(q[off + r0:off + r1], keys[:c + r1], None, weights[off + r0:off + r1], ks, ke,
                                 self.topk, out=rows[off + r0:off + r1])


class SparseAttention(nn.Module):
    """Absorbed sparse MLA over the positions in the top-k rows (no parameters; a hook point:
    its forward receives exactly the position rows this layer attends over)."""

    def __init__(self, layer_id: int, softmax_scale: float):
        super().__init__()
        self.layer_id, self.softmax_scale = layer_id, softmax_scale

    def forward(self, q: torch.Tensor, topk_positions: torch.Tensor, kv_cache: torch.Tensor,
                req_of_row: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        slots = ops.positions_to_slots(topk_positions, req_of_row, block_table, block_size)
        n, h = q.shape[0], q.shape[1]
        out = q.new_empty(n, h, MLA_LATENT)
        for r0, r1 in _row_chunks(n, slots.shape[1] * (MLA_LATENT + MLA_ROPE + h), ATTN_CHUNK_ELEMS):
            out[r0:r1] = ops.sparse_mla(q[r0:r1], kv_cache, slots[r0:r1], self.softmax_scale)[0]
        return out


class MLA(nn.Module):
    """Multi-head latent attention with q/kv LoRA; attention runs absorbed over the latent cache."""

    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.nope, self.rope, self.v_dim = (args.num_attention_heads, args.qk_nope_head_dim,
                                                          args.qk_rope_head_dim, args.v_head_dim)
        self.q_a_proj = _linear(args.hidden_size, args.q_lora_rank)
        self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.q_b_proj = _linear(args.q_lora_rank, self.n_heads * args.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(args.hidden_size, args.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = _linear(args.kv_lora_rank, self.n_heads * (self.nope + self.v_dim))
        self.o_proj = _linear(self.n_heads * self.v_dim, args.hidden_size)
        self.indexer = Indexer(args, layer_id, indexer_fp8) if build_indexer else None
        self.skip_topk = not build_indexer  # MTP layers flip this at runtime (set_skip_topk)
        ys = args.rope_scaling or {}
        scale = ops.mla_softmax_scale(self.nope, self.rope, ys.get("mscale_all_dim", 0.0), ys.get("factor", 1.0))
        self.sparse_attn = SparseAttention(layer_id, scale)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h, meta = x.shape[0], self.n_heads, ctx.meta
        with ctx.stage(self.layer_id, "mla_proj"):
            qr = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(qr).view(n, h, self.nope + self.rope)
            q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
            q_pe = apply_rope(q_pe, ctx.cos, ctx.sin, interleaved=True)
            kv = self.kv_a_proj_with_mqa(x)
            kv_c = self.kv_a_layernorm(kv[:, :MLA_LATENT])
            k_pe = apply_rope(kv[:, MLA_LATENT:], ctx.cos, ctx.sin, interleaved=True)
            w_kv = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, MLA_LATENT)
            q_abs = torch.cat((torch.einsum("thd,hdc->thc", q_nope, w_kv[:, :self.nope]), q_pe), dim=-1)
            if meta.paged:
                kv_cache = ctx.cache.kv[self.layer_id]
                ops.mla_kv_cache_insert(kv_c, k_pe, meta.slot_mapping, kv_cache)
            else:  # no cache: the batch's own keys, B blocks of T tokens
                kv_cache = torch.cat((kv_c, k_pe), dim=-1).view(-1, meta.block_size, MLA_LATENT + MLA_ROPE)
        if self.indexer is not None and not self.skip_topk:
            self.indexer(x, qr, ctx)
        elif not ctx.topk_valid:
            raise RuntimeError(f"layer {self.layer_id} reuses top-k indices but no F layer wrote them in this forward")
        with ctx.stage(self.layer_id, "attention"):
            out = self.sparse_attn(q_abs, ctx.topk_rows, kv_cache, meta.req_of_row, meta.block_table, meta.block_size)
            o = torch.einsum("thc,hdc->thd", out, w_kv[:, self.nope:])
            return self.o_proj(o.reshape(n, h * self.v_dim))


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(dim, inter), _linear(dim, inter), _linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Sigmoid router with a selection-only bias and group-limited top-k (noaux_tc)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))  # kept in fp32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask.unsqueeze(-1), -math.inf).flatten(1)
        idx = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.scale


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.experts = nn.ModuleList(MLP(args.hidden_size, args.moe_intermediate_size) for _ in range(args.n_routed_experts))
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
                               if args.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.gate(x)
        k = idx.shape[1]
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        w = weights.flatten()
        start = 0
        for e, c in enumerate(counts):
            if c:
                sel = order[start:start + c]
                tok = sel // k
                y.index_add_(0, tok, self.experts[e](x[tok]).float() * w[sel].unsqueeze(-1))
                start += c
        if self.shared_experts is not None:
            y += self.shared_experts(x).float()
        return y.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, build_indexer: bool, indexer_fp8: bool):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = MLA(args, layer_id, build_indexer, indexer_fp8)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MoE(args) if args.is_moe_layer(layer_id) else MLP(args.hidden_size, args.intermediate_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        with ctx.stage(self.layer_id, "moe" if isinstance(self.mlp, MoE) else "mlp"):
            return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = _linear(args.hidden_size, args.vocab_size)


class MTPLayer(DecoderLayer):
    """Next-n prediction: ``eh_proj([enorm(embed(token_{i+1})), hnorm(h_i)])`` through a full
    decoder layer; its own head predicts token i+2. Always builds an indexer (F)."""

    def __init__(self, args: ModelArgs, layer_id: int, indexer_fp8: bool):
        super().__init__(args, layer_id, True, indexer_fp8)
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = _linear(2 * args.hidden_size, args.hidden_size)
        self.shared_head = SharedHead(args)

    def forward_mtp(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev_hidden.to(embeds.dtype))), dim=-1))
        return super().forward(h, ctx)


class DeepseekV32Model(nn.Module):
    def __init__(self, args: ModelArgs, plan: LayerPlan, indexer_fp8: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        layers = [DecoderLayer(args, i, not plan.skip_topk[i], indexer_fp8) for i in range(args.num_hidden_layers)]
        layers += [MTPLayer(args, args.num_hidden_layers + j, indexer_fp8) for j in range(args.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


# ============================================================================ the causal LM

_FP32_PARAMS = ("weights_proj.weight", "e_score_correction_bias")


class DeepseekV32ForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, plan: LayerPlan, *, indexer_fp8: Optional[bool] = None,
                 config: Optional[dict] = None, ic_config: Optional[IndexCacheConfig] = None):
        super().__init__()
        if len(plan.skip_topk) != args.num_hidden_layers + args.num_nextn_predict_layers:
            raise ValueError(f"plan covers {len(plan.skip_topk)} layers, the model has "
                             f"{args.num_hidden_layers} + {args.num_nextn_predict_layers} MTP")
        self.args, self.plan, self.ic_config = args, plan, ic_config
        self.config = dict(config or {})
        self.indexer_fp8 = indexer_fp8 is None or bool(indexer_fp8)
        self.model = DeepseekV32Model(args, plan, self.indexer_fp8)
        self.lm_head = _linear(args.hidden_size, args.vocab_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("topk_buffer", torch.empty(0, dtype=torch.int32), persistent=False)
        self.register_buffer("rope_inv_freq", torch.empty(0), persistent=False)
        self._init_buffers()

    # ---------------------------------------------------------------- construction

    def _init_buffers(self) -> None:
        device = self.lm_head.weight.device
        device = torch.device("cpu") if device.type == "meta" else device
        inv, self.rope_attn_factor = rope_inv_freq(self.args)
        self.rope_inv_freq = inv.to(device)
        self.topk_buffer = torch.full((self.args.max_num_batched_tokens, self.args.index_topk), -1,
                                      dtype=torch.int32, device=device)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], hf_overrides=None, *, dtype=torch.float32, device="cpu",
                    indexer_fp8: Optional[bool] = None, init: str = "random", seed: int = 0) -> "DeepseekV32ForCausalLM":
        """Build from a config dict. ``init='random'`` draws seeded weights; ``'empty'`` leaves them
        uninitialised (for loading); ``'meta'`` builds on the meta device."""
        config = dict(config)
        merged, ic_overrides = split_overrides(config, hf_overrides)
        args = ModelArgs.from_config(merged)
        ic = IndexCacheConfig.from_config(config, ic_overrides)
        plan = ic.plan(args.num_hidden_layers, args.num_nextn_predict_layers)
        with torch.device("meta"):
            model = cls(args, plan, indexer_fp8=indexer_fp8, config=merged, ic_config=ic)
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
                        indexer_fp8: Optional[bool] = None, progress: Optional[bool] = None) -> "DeepseekV32ForCausalLM":
        """Load an HF-format DeepSeek-V3.2 checkpoint directory (DESIGN.md §10)."""
        from indexcache import loader
        config = loader.load_config(path)
        model = cls.from_config(config, hf_overrides, dtype=dtype, device=device, indexer_fp8=indexer_fp8, init="empty")
        loader.load_weights(model, path, progress=progress)
        model.eval()
        return model

    def save_pretrained(self, path: Union[str, Path], *, fp8: bool = False, max_shard_bytes: Optional[int] = None) -> None:
        from indexcache import loader
        loader.save_pretrained(self, path, fp8=fp8, max_shard_bytes=max_shard_bytes)

    def _cast_params(self, dtype: torch.dtype) -> None:
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if name.endswith(_FP32_PARAMS) else dtype)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> "DeepseekV32ForCausalLM":
        """Deterministic random weights: drawn in fp32 on the CPU from one seeded generator."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
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
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def mtp_layers(self) -> list:
        return list(self.model.layers[self.args.num_hidden_layers:])

    def indexer_param_count(self) -> list:
        """Indexer parameters per layer (0 for S layers)."""
        return [0 if l.self_attn.indexer is None else sum(p.numel() for p in l.self_attn.indexer.parameters())
                for l in self.model.layers]

    def plan_summary(self) -> str:
        p, ic = self.plan, self.ic_config
        s = f"IndexCache plan: {p.num_full} F / {p.num_shared} S over {p.num_hidden_layers} layers"
        if p.num_nextn_predict_layers:
            s += f" (+{p.num_nextn_predict_layers} MTP, always F)"
        if p.rule == "off":
            s += "; IndexCache off"
        elif p.rule == "freq" and ic is not None:
            s += f"; freq {ic.index_topk_freq}, offset {ic.index_skip_topk_offset}"
        else:
            s += f"; from {p.rule}"
        if ic is not None and ic.shipped_by_checkpoint:
            s += "; settings shipped in the checkpoint's config.json"
        return s + f"\npattern: {p.pattern}"

    def set_mtp_skip_topk(self, skip: bool) -> None:
        """vLLM's ``set_skip_topk`` for MTP layers: later draft steps reuse step 0's indices."""
        for layer in self.mtp_layers:
            layer.self_attn.skip_topk = skip

    def allocate_cache(self, num_blocks: int, kv_cache_dtype: str = "auto", block_size: int = BLOCK_SIZE) -> PagedKVCache:
        return PagedKVCache(self, num_blocks, kv_cache_dtype, block_size)

    # ---------------------------------------------------------------- forward

    def _context(self, meta: BatchMeta, cache, timer) -> ForwardContext:
        n = meta.num_tokens
        rows = self.topk_buffer.shape[0]
        if n > rows:
            raise ValueError(f"batch has {n} tokens but the top-k buffer has {rows} rows "
                             f"(max_num_batched_tokens); split the batch or raise max_num_batched_tokens")
        if meta.paged and cache is None:
            raise ValueError("a paged batch needs its PagedKVCache")
        angles = meta.positions.float().unsqueeze(1) * self.rope_inv_freq.unsqueeze(0)
        cos, sin = angles.cos() * self.rope_attn_factor, angles.sin() * self.rope_attn_factor
        return ForwardContext(meta, cos, sin, self.topk_buffer, cache, timer)

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

    @torch.no_grad()
    def forward_tokens(self, input_ids: torch.Tensor, meta: BatchMeta, cache: Optional[PagedKVCache] = None,
                       timer: Optional[StageTimer] = None) -> torch.Tensor:
        """Main layers over a flattened batch; returns the final-normed hidden states ``[N, hidden]``."""
        ctx = self._context(meta, cache, timer)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers[: self.args.num_hidden_layers]:
            x = layer(x, ctx)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

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
        ctx = self._context(meta, cache, timer)
        if reuse_topk is not None:
            ctx.topk_rows.copy_(reuse_topk)
            ctx.topk_valid = True
        self.set_mtp_skip_topk(reuse_topk is not None)
        try:
            h = layer.forward_mtp(self.model.embed_tokens(input_ids), prev_hidden, ctx)
        finally:
            self.set_mtp_skip_topk(False)
        return h, layer.shared_head.head(layer.shared_head.norm(h)).float()

    def generate(self, prompts, max_new_tokens: int = 32, **kwargs):
        """Batched generation with paged caches; see :func:`indexcache.generation.generate`."""
        from indexcache.generation import generate
        return generate(self, prompts, max_new_tokens, **kwargs)


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(table)}")
    return table[dtype]
