"""Scale-out (DESIGN.md §11): process groups, sharded and FP8 linear layers, the vocabulary-parallel
embedding, and the pipeline-stage hand-off of the hidden state and the shared top-k rows.

Nothing here is a module-level global: a :class:`ParallelContext` is built once per model (from
the initialised ``torch.distributed`` default group, or the single-process default) and handed to
every layer at construction. Layout, as DeepSeek's reference and the serving engines have it:

- tensor parallel over ``tp`` ranks: MLA heads split (``q_b_proj``, ``kv_b_proj`` by head,
  ``o_proj`` row-parallel + all-reduce), ``q_a_proj`` / ``kv_a_proj_with_mqa`` replicated, dense MLP
  and shared experts column/row split, vocabulary-parallel embedding (all-reduce) and LM head
  (all-gather);
- expert parallel: routed experts split evenly over the same ranks; each rank runs its experts for
  every token; routed and shared partial sums combine in one all-reduce per MoE layer;
- the indexer, the index-K cache and the top-k buffer are replicated on every rank;
- pipeline parallel over ``pp`` stages of contiguous layers, ranks ``[s*tp, (s+1)*tp)`` forming stage
  ``s``; rank ``r`` of stage ``s`` hands the residual stream, the top-k rows ``[:N]`` and their
  "valid" flag to rank ``r + tp``, so a stage that begins on an S layer reuses the previous stage's
  indices and the plan stays exactly as given.

FP8: a linear layer may hold its weight as e4m3 plus one fp32 ``weight_scale_inv`` per 128x128
block (the official checkpoint's format). On CPU it dequantizes one block-row at a time into the
activation dtype and matmuls; on CUDA it uses torch's block-scaled matmul
(``torch.nn.functional.scaled_mm`` with 1x128 / 128x128 scales) when the installed torch has it,
else the same dequant path.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from indexcache.formats import (FP8_DS_MLA_BYTES, FP8_LINEAR_NAMES, FP8_MAX, FP8_WEIGHT_AMAX_FLOOR,  # noqa: F401
                                FP8_WEIGHT_BLOCK, INDEX_K_BYTES, MLA_KV_WIDTH, MLA_LATENT)
from indexcache.fp8_blocks import quantize_fp8_blocks

FP8_BLOCK = FP8_WEIGHT_BLOCK[0]  # rows (and columns) per weight scale
WEIGHTS_CHOICES = ("auto", "fp8", "bf16")


def _dist():
    import torch.distributed as dist
    return dist


@dataclass
class ParallelContext:
    """Where this process sits (tensor-parallel rank within its pipeline stage) and how linear
    weights are held (``fp8``). The single-process default has no groups and does no communication."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    fp8: bool = False
    tp_group: Any = None                   # this stage's tensor-parallel group (None: single process)
    comm_bytes: dict = field(default_factory=dict)  # bytes this rank sent, by kind (bench/bench_parallel.py)

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, tp_size: Optional[int] = None, pp_size: int = 1, fp8: bool = False) -> "ParallelContext":
        """From the initialised default process group (or a single process when there is none).
        Every rank must call this with the same sizes: it creates one tensor-parallel group per stage."""
        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            tp = 1 if tp_size is None else int(tp_size)
            if tp != 1 or pp_size != 1:
                raise ValueError(f"tp_size {tp} x pp_size {pp_size} needs an initialised torch.distributed default "
                                 f"group (launch with torchrun); this process has none")
            return cls(fp8=fp8)
        world, rank = dist.get_world_size(), dist.get_rank()
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        tp = world // pp_size if tp_size is None else int(tp_size)
        if tp < 1 or tp * pp_size != world:
            raise ValueError(f"world size {world} != tp_size {tp} x pp_size {pp_size}: launch tp x pp processes "
                             f"(torchrun --nproc-per-node {max(tp, 1) * pp_size})")
        ctx = cls(tp_size=tp, pp_size=pp_size, rank=rank, fp8=fp8)
        if world > 1:
            for s in range(pp_size):  # new_group is collective: every rank creates every stage's group
                g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
                if s == ctx.pp_rank:
                    ctx.tp_group = g
        return ctx

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return f"rank {self.rank}: tp {self.tp_rank}/{self.tp_size}, stage {self.pp_rank}/{self.pp_size}"

    # ---------------------------------------------------------------- splits

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This tensor-parallel rank's ``[start, stop)`` of ``n`` items that must divide evenly."""
        if n % self.tp_size:
            raise ValueError(f"{what} ({n}) is not divisible by tp_size {self.tp_size}")
        per = n // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """Vocabulary rows of this rank: ``ceil(vocab / tp)`` each, the last rank possibly fewer."""
        per = -(-vocab // self.tp_size)
        return min(vocab, self.tp_rank * per), min(vocab, (self.tp_rank + 1) * per)

    def stage_layers(self, num_layers: int) -> range:
        """Main layers of this pipeline stage (see :func:`stage_bounds`)."""
        b = stage_bounds(num_layers, self.pp_size)
        return range(b[self.pp_rank], b[self.pp_rank + 1])

    def owns_layer(self, layer_id: int, num_layers: int) -> bool:
        """Main layers by stage; MTP layers (``layer_id >= num_layers``) live on the last stage."""
        if layer_id >= num_layers:
            return self.last_stage
        return layer_id in self.stage_layers(num_layers)

    # ---------------------------------------------------------------- layers

    def linear(self, in_features: int, out_features: int, name: str, split: Optional[str] = None,
               shard: Optional[tuple[int, int]] = None) -> nn.Module:
        """A bias-free linear layer. ``split``: None (replicated), ``"col"`` (output rows ``shard`` of
        ``out_features``) or ``"row"`` (input columns ``shard`` of ``in_features``). FP8 when this
        context keeps weights FP8 and the official checkpoint stores ``name`` in fp8. A replicated
        non-FP8 layer is a plain ``nn.Linear`` (single-process models are exactly as before)."""
        fp8 = self.fp8 and name in FP8_LINEAR_NAMES
        sharded = split is not None and self.tp_size > 1
        if not fp8 and not sharded:
            return nn.Linear(in_features, out_features, bias=False)
        dim = {None: None, "col": 0, "row": 1}[split] if sharded else None
        return ShardedLinear(in_features, out_features, dim, shard if sharded else None, fp8)

    # ---------------------------------------------------------------- collectives

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.comm_bytes[kind] = self.comm_bytes.get(kind, 0) + t.numel() * t.element_size()

    def all_reduce(self, t: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
        """Sum over this stage's tensor-parallel ranks, in place. Ring all-reduce (gloo and NCCL)
        leaves bit-identical sums on every rank, which the replicated indexers rely on."""
        if self.tp_size == 1:
            return t
        self._count(kind, t)
        _dist().all_reduce(t, group=self.tp_group)
        return t

    def all_gather_last(self, t: torch.Tensor, full: int) -> torch.Tensor:
        """Concatenate each rank's ``[..., per]`` slice (vocab_range sizes) along the last dim."""
        if self.tp_size == 1:
            return t
        per = -(-full // self.tp_size)
        if t.shape[-1] < per:
            t = F.pad(t, (0, per - t.shape[-1]))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        self._count("all_gather", t)
        _dist().all_gather(parts, t, group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., :full].contiguous()

    # ---------------------------------------------------------------- pipeline hand-off

    def send_next(self, hidden: torch.Tensor, topk_rows: Optional[torch.Tensor], valid: bool) -> None:
        """Stage s -> s+1 (rank r -> r + tp): the residual stream, its "top-k rows valid" flag and,
        when the next stage begins on an S layer (both sides know it from the plan), the rows [:N]."""
        dist, dst = _dist(), self.rank + self.tp_size
        flag = torch.tensor([int(valid)], dtype=torch.int32, device=hidden.device)
        for t in (flag, hidden.contiguous()) + (() if topk_rows is None else (topk_rows.contiguous(),)):
            self._count("stage_send", t)
            dist.send(t, dst)

    def recv_prev(self, hidden: torch.Tensor, topk_rows: Optional[torch.Tensor]) -> bool:
        """Receive :meth:`send_next` into ``hidden`` and ``topk_rows`` (a view of the shared buffer,
        None when this stage begins on an F layer); returns the valid flag."""
        dist, src = _dist(), self.rank - self.tp_size
        flag = torch.zeros(1, dtype=torch.int32, device=hidden.device)
        dist.recv(flag, src)
        dist.recv(hidden, src)
        if topk_rows is None:
            pass
        elif topk_rows.is_contiguous():
            dist.recv(topk_rows, src)
        else:
            tmp = torch.empty_like(topk_rows, memory_format=torch.contiguous_format)
            dist.recv(tmp, src)
            topk_rows.copy_(tmp)
        return bool(flag.item())

    def send_to_last(self, t: torch.Tensor) -> None:
        """First stage -> last stage, same tensor-parallel rank (MTP input embeddings)."""
        self._count("stage_send", t)
        _dist().send(t.contiguous(), self.rank + (self.pp_size - 1) * self.tp_size)

    def recv_from_first(self, out: torch.Tensor) -> torch.Tensor:
        _dist().recv(out, self.rank - self.pp_rank * self.tp_size)
        return out

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """The last stage's tensor (identical on its tensor-parallel ranks) to every rank, in place."""
        if self.pp_size == 1:
            return t
        if self.last_stage and self.tp_rank == 0:
            self._count("broadcast", t)
        buf = t if t.is_contiguous() else t.contiguous()  # collectives read and write whole storage
        _dist().broadcast(buf, src=(self.pp_size - 1) * self.tp_size)
        if buf is not t:
            t.copy_(buf)
        return t


def init_from_env(device: str = "cpu") -> bool:
    """Initialise the default process group from torchrun's environment when ``WORLD_SIZE`` > 1:
    NCCL (one GPU per rank, ``LOCAL_RANK``) for CUDA, gloo for the CPU. Returns whether distributed."""
    import os
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist = _dist()
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return True


def stage_bounds(num_layers: int, pp_size: int) -> list:
    """Layer boundaries of ``pp_size`` contiguous stages: ``num_layers // pp`` each, the remainder
    going one each to the stages before the last (which also holds the norm, LM head and MTP), as
    vLLM's ``get_pp_indices`` does. ``[b0=0, b1, ..., b_pp=num_layers]``."""
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot form {pp_size} pipeline stages (need layers >= pp_size)")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i if pp_size > 1 else 0] += 1
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def stage_start_full_pattern(pattern: str, num_layers: int, pp_size: int) -> str:
    """The engines' fallback: the first layer of every stage forced to F (vLLM; the indices of the
    previous stage are then not needed). The pattern given here is the plan's main-layer pattern."""
    chars = list(pattern)
    for b in stage_bounds(num_layers, pp_size)[:-1]:
        if b < len(chars):
            chars[b] = "F"
    return "".join(chars)


# ============================================================================ layers

def _dequant_block_row(weight: torch.Tensor, scale_row: torch.Tensor, col_off: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of one 128-row block: e4m3 ``[r, in]`` x its block scales ``[blocks]`` -> ``dtype``."""
    s = scale_row.float().repeat_interleave(FP8_BLOCK)[col_off:col_off + weight.shape[1]]
    return (weight.float() * s).to(dtype)


class ShardedLinear(nn.Module):
    """``y = x W^T`` for this rank's slice of a checkpoint linear, held in the model dtype or as FP8.

    ``shard_dim`` 0: output rows ``shard`` of the checkpoint weight (column parallel); 1: input
    columns (row parallel: the caller all-reduces the partial sums); None: the whole weight. An FP8
    weight keeps the checkpoint's 128x128 block scales; a slice not aligned to 128 keeps the
    offset of its first row/column inside the first block (``row_off`` / ``col_off``).
    """

    def __init__(self, in_features: int, out_features: int, shard_dim: Optional[int],
                 shard: Optional[tuple[int, int]], fp8: bool):
        super().__init__()
        self.full_shape = (out_features, in_features)
        self.shard_dim, self.shard = shard_dim, shard
        o, i = out_features, in_features
        self.row_off = self.col_off = 0
        if shard_dim == 0:
            o = shard[1] - shard[0]
            self.row_off = shard[0] % FP8_BLOCK
        elif shard_dim == 1:
            i = shard[1] - shard[0]
            self.col_off = shard[0] % FP8_BLOCK
        self.in_features, self.out_features, self.fp8 = i, o, fp8
        if fp8:
            self.weight = nn.Parameter(torch.empty(o, i, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.weight_scale_inv = nn.Parameter(
                torch.empty(-(-(self.row_off + o) // FP8_BLOCK), -(-(self.col_off + i) // FP8_BLOCK)),
                requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(o, i))
        self._scaled_mm_ok = True

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, shard_dim={self.shard_dim}, shard={self.shard}, "
                f"fp8={self.fp8}")

    def checkpoint_slice(self) -> tuple[Optional[int], Optional[tuple[int, int]]]:
        return self.shard_dim, self.shard

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (dequantized whole: for the absorbed MLA einsums)."""
        if not self.fp8:
            return self.weight.to(dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.weight.device)
        for b, r0, r1 in self._block_rows():
            out[r0:r1] = _dequant_block_row(self.weight[r0:r1], self.weight_scale_inv[b], self.col_off, dtype)
        return out

    def _block_rows(self):
        for b in range(self.weight_scale_inv.shape[0]):
            r0, r1 = max(0, b * FP8_BLOCK - self.row_off), min(self.out_features, (b + 1) * FP8_BLOCK - self.row_off)
            if r1 > r0:
                yield b, r0, r1

    @torch.no_grad()
    def set_dense(self, w: torch.Tensor) -> None:
        """Fill from a dense ``[out, in]`` slice (quantizing in aligned blocks when FP8)."""
        if not self.fp8:
            self.weight.copy_(w)
            return
        padded = torch.zeros(self.row_off + w.shape[0], self.col_off + w.shape[1], dtype=torch.float32)
        padded[self.row_off:, self.col_off:] = w.float()
        q, s = quantize_fp8_blocks(padded)
        self.weight.copy_(q[self.row_off:, self.col_off:])
        self.weight_scale_inv.copy_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return F.linear(x, self.weight.to(x.dtype) if self.weight.dtype != x.dtype else self.weight)
        if x.is_cuda and self._scaled_mm_ok:
            y = self._forward_scaled_mm(x)
            if y is not None:
                return y
        x2 = x.reshape(-1, self.in_features)
        y = x2.new_empty(x2.shape[0], self.out_features)
        for b, r0, r1 in self._block_rows():
            w = _dequant_block_row(self.weight[r0:r1], self.weight_scale_inv[b], self.col_off, x.dtype)
            y[:, r0:r1] = x2 @ w.t()
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_scaled_mm(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Hopper block-scaled FP8 GEMM: activations quantized 1x128 per token, weight scales 128x128.
        Written against torch's ``scaled_mm`` API; not run on this project's CPU machines, so any
        failure disables it for this layer (with one warning) and the dequant path runs instead."""
        ST = getattr(F, "ScalingType", None)
        if ST is None or not hasattr(F, "scaled_mm") or self.row_off or self.col_off \
                or self.in_features % FP8_BLOCK or self.out_features % FP8_BLOCK or x.dtype != torch.bfloat16:
            return None
        try:
            x2 = x.reshape(-1, self.in_features)
            m = x2.shape[0]
            g = x2.float().view(m, -1, FP8_BLOCK)
            sa = g.abs().amax(-1).clamp(min=FP8_WEIGHT_AMAX_FLOOR) / FP8_MAX                      # [M, K/128]
            xq = (g / sa.unsqueeze(-1)).to(torch.float8_e4m3fn).view(m, -1)
            sa = sa.t().contiguous().t()                                          # outer-dim-major scales
            y = F.scaled_mm(xq, self.weight.t(), sa, ST.BlockWise1x128, self.weight_scale_inv, ST.BlockWise128x128,
                            output_dtype=torch.bfloat16)
            return y.view(*x.shape[:-1], self.out_features)
        except (RuntimeError, TypeError, NotImplementedError) as e:
            self._scaled_mm_ok = False
            warnings.warn(f"block-scaled FP8 matmul unavailable ({str(e).splitlines()[0][:120]}); "
                          "dequantizing block-rows instead", RuntimeWarning, stacklevel=3)
            return None


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight in ``dtype``, whatever it holds (plain, sharded, FP8)."""
    if isinstance(linear, ShardedLinear):
        return linear.dense_weight(dtype)
    return linear.weight if linear.weight.dtype == dtype else linear.weight.to(dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab_range`` of the embedding; ids outside give zeros; one all-reduce sums the ranks
    (exact: one non-zero term per token)."""

    def __init__(self, vocab: int, dim: int, par: ParallelContext):
        super().__init__()
        self.par, self.vocab = par, vocab
        self.lo, self.hi = par.vocab_range(vocab)
        self.shard_dim, self.shard = 0, (self.lo, self.hi)
        self.full_shape = (vocab, dim)
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, dim))

    def checkpoint_slice(self):
        return self.shard_dim, self.shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(inside, ids - self.lo, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.par.all_reduce(out, "embed_all_reduce")


def make_embedding(vocab: int, dim: int, par: ParallelContext) -> nn.Module:
    return nn.Embedding(vocab, dim) if par.tp_size == 1 else VocabParallelEmbedding(vocab, dim, par)


def make_lm_head(dim: int, vocab: int, par: ParallelContext) -> nn.Module:
    """The LM head (kept fp32, never FP8): this rank's vocabulary rows."""
    if par.tp_size == 1:
        return nn.Linear(dim, vocab, bias=False)
    return ShardedLinear(dim, vocab, 0, par.vocab_range(vocab), False)


def head_logits(head: nn.Module, hidden: torch.Tensor, vocab: int, par: ParallelContext) -> torch.Tensor:
    """fp32 full-vocabulary logits on every tensor-parallel rank of this stage."""
    return par.all_gather_last(F.linear(hidden.float(), head.weight.float()), vocab)


# ============================================================================ sizing (indexcache plan --tp/--pp)

def weight_bytes_per_gpu(config: dict, tp: int, pp: int, plan_skip: list, fp8: bool = True) -> list:
    """Resident weight bytes of each stage's ranks (the largest tensor-parallel rank of the stage):
    FP8 for the linears the official checkpoint stores in fp8 (+ 4 B per 128x128 block), bf16 for
    the rest, fp32 for the LM head, indexer head weights and router bias, as the model holds them.
    S layers hold no indexer."""
    c = config
    h, L = c["hidden_size"], c["num_hidden_layers"]
    nh, qk, v = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kl, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    E, mi, ns = c.get("n_routed_experts", 0), c.get("moe_intermediate_size", 0), c.get("n_shared_experts", 0)
    inter, dense = c["intermediate_size"], c.get("first_k_dense_replace", 0)
    vocab, mtp = c["vocab_size"], c.get("num_nextn_predict_layers", 0)
    wb = 1 if fp8 else 2

    def lin(o, i):
        return o * i * wb + (math.ceil(o / 128) * math.ceil(i / 128) * 4 if fp8 else 0)

    def layer(i, indexer):
        b = lin(ql, h) + lin(nh // tp * qk, ql) + lin(kl + rope, h) + lin(nh // tp * (qk - rope + v), kl) \
            + lin(h, nh // tp * v) + 2 * (ql + kl) + 2 * 2 * h
        if indexer:
            b += lin(ih * idim, ql) + lin(idim, h) + 2 * 2 * idim + 4 * ih * h
        moe = E and i >= dense
        if moe:
            b += 2 * E * h + 4 * E + E // tp * 3 * lin(mi, h) + (3 * lin(mi * ns // tp, h) if ns else 0)
        else:
            b += 3 * lin(inter // tp, h)
        return b

    bounds = stage_bounds(L, pp)
    vshard = -(-vocab // tp)
    out = []
    for s in range(pp):
        b = sum(layer(i, not plan_skip[i]) for i in range(bounds[s], bounds[s + 1]))
        if s == 0:
            b += vshard * h * 2
        if s == pp - 1:
            b += vshard * h * 4 + 2 * h
            b += mtp * (layer(L, True) + 2 * 3 * h + 2 * h * 2 * h + vshard * h * 4)
        out.append(b)
    return out


MLA_KV_BYTES = {"fp8_ds_mla": FP8_DS_MLA_BYTES, "bf16": 2 * MLA_KV_WIDTH}  # per token per layer (DESIGN §5)


def scaleout_budget(config: dict, skip_topk: list, tp: int, pp: int, gpu_bytes: float,
                    kv_cache_dtype: str = "fp8_ds_mla", fp8_weights: bool = True) -> dict:
    """Per-GPU memory of one plan: weight bytes, KV and index-K cache bytes per token of context,
    and how many tokens fit beside the weights, for every pipeline stage (the tightest one bounds
    the whole pipeline). Tensor-parallel ranks each hold the whole latent and index-K caches of
    their stage (DESIGN §11). Activations and workspace are not counted."""
    L = config["num_hidden_layers"]
    mtp = config.get("num_nextn_predict_layers", 0)
    kv_layer = MLA_KV_BYTES[kv_cache_dtype] if config.get("kv_lora_rank", MLA_LATENT) == MLA_LATENT else \
        (2 if kv_cache_dtype == "bf16" else 1) * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    bounds = stage_bounds(L, pp)
    weights = weight_bytes_per_gpu(config, tp, pp, skip_topk, fp8_weights)
    stages = []
    for s in range(pp):
        layers = list(range(bounds[s], bounds[s + 1])) + (list(range(L, L + mtp)) if s == pp - 1 else [])
        kv = kv_layer * len(layers)
        ik = INDEX_K_BYTES * sum(1 for i in layers if not skip_topk[i])
        free = gpu_bytes - weights[s]
        stages.append({"stage": s, "layers": [bounds[s], bounds[s + 1]], "weight_bytes": weights[s],
                       "kv_bytes_per_token": kv, "index_k_bytes_per_token": ik,
                       "tokens_fit": max(0, int(free // (kv + ik)))})
    tight = min(stages, key=lambda st: st["tokens_fit"])
    return {"tp": tp, "pp": pp, "gpu_bytes": gpu_bytes, "kv_cache_dtype": kv_cache_dtype, "stages": stages,
            "tokens_fit": tight["tokens_fit"], "bounding_stage": tight["stage"]}
