"""The state of one forward: the batch description, the paged caches, the per-forward context
(shared top-k buffer, RoPE angles, which layers run their indexer, stage timing and NVTX ranges)
and, for a differentiable forward, the ``TorchPass`` that switches the blocks to their torch
definitions."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from indexcache import ops

from indexcache.formats import BLOCK_SIZE, FP8_DS_MLA_BYTES, INDEX_HEAD_DIM, INDEX_K_BYTES  # noqa: F401



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
    rids: Optional[tuple] = None      # the requests' ids in the cache (paged_batch; step reuse keys on them)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def paged(self) -> bool:
        return self.slot_mapping is not None

    @property
    def uniform_q(self) -> Optional[int]:
        return self.q_lens[0] if len(set(self.q_lens)) == 1 else None

    def request_ids(self, why: str) -> tuple:
        """``rids``, which a paged forward keyed on them needs (``why``: what keeps state by them);
        a batch built without them is refused by name."""
        if self.rids is None:
            raise ValueError(f"{why} by request id: build a paged forward's batch with "
                             "BatchMeta.paged_batch(cache, rids, ...)")
        return self.rids

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
        # built on the host: torch.repeat_interleave opens an OpenMP region, which at a decode step's
        # few rows waits for a sleeping worker (0.1 ms a call at 2 threads, docs/profiling.md)
        req = torch.tensor([i for i, q in enumerate(q_lens) for _ in range(q)], dtype=torch.int32).to(device)
        lens = torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32, device=device)
        slots = ops.positions_to_slots(pos.view(-1, 1).int(), req, table, cache.block_size).view(-1).long()
        return cls(pos, req, q_lens, ctx_lens, lens, table, cache.block_size, slots, tuple(rids))


# ============================================================================ paged caches

class SelectionStore:
    """Per request id, per layer id: (position of the row, its selection int32 ``[index_topk]``)."""

    def __init__(self):
        self._saved: dict = {}
        # adaptive reuse (index_reuse_min_recall): steps whose reuse the probe layer checked, and of
        # those, the ones whose recall fell short so every F layer recomputed
        self.checked = 0
        self.recomputed = 0

    def get(self, rid, layer_id: int) -> Optional[tuple]:
        return self._saved.get(rid, {}).get(layer_id)

    def put(self, rid, layer_id: int, pos: int, row: torch.Tensor) -> None:
        self._saved.setdefault(rid, {})[layer_id] = (pos, row)

    def free(self, rid) -> None:
        self._saved.pop(rid, None)

    def requests(self) -> list:
        """The request ids holding a saved selection."""
        return list(self._saved)


class CacheManager:
    """Hands out fixed-size blocks to requests; a request's block table grows on demand."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict = {}
        self.on_free: list = []  # callables of a request id, run when it is freed

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
        for hook in self.on_free:
            hook(rid)

    def block_table(self, rids: Sequence, device, width: Optional[int] = None) -> torch.Tensor:
        """int32 ``[len(rids), width]`` (default: the longest table); unused columns hold block 0."""
        tables = [self._tables.get(r, []) for r in rids]
        longest = max([len(t) for t in tables] + [1])
        if width is None:
            width = longest
        elif width < longest:
            raise ValueError(f"a block table of {width} columns cannot hold a request with {longest} blocks")
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(device)


def tensor_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes one cache tensor holds (0 where a layer has none)."""
    return 0 if t is None else t.numel() * t.element_size()


class CacheBytes:
    """``nbytes()`` of a paged cache: its ``layer_bytes(i)`` (KV-side bytes, index-side bytes)
    summed over ``num_layers``."""

    num_layers: int

    def layer_bytes(self, layer_id: int) -> tuple[int, int]:
        raise NotImplementedError

    def nbytes(self) -> dict:
        per = [self.layer_bytes(i) for i in range(self.num_layers)]
        return {"kv": sum(p[0] for p in per), "index_k": sum(p[1] for p in per)}


class GQAPages(CacheBytes):
    """The pages of the GQA families' indexed attention: ``k[i]``, ``v[i]`` ``[num_blocks, block,
    kv_heads, head_dim]`` per layer with attention, ``index_k[i]`` ``[num_blocks, block,
    index_head_dim]`` per layer whose attention has an indexer (F layers), None elsewhere (layers
    without attention, and those of another pipeline stage). ``state_bytes`` adds a family's
    per-request state to a layer's KV-side bytes."""

    def _allocate_pages(self, model, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        args = model.args
        self.k, self.v, self.index_k = [], [], []
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn is None:
                self.k.append(None)
                self.v.append(None)
                self.index_k.append(None)
                continue
            shape = (num_blocks, block_size, attn.n_kv_heads, args.gqa_head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.index_k.append(None if attn.indexer is None else
                                torch.zeros(num_blocks, block_size, args.index_head_dim, dtype=dtype, device=self.device))
        self.num_layers = len(self.k)

    @property
    def kv(self) -> list:
        """Per layer: (K, V) pages, or None."""
        return [None if k is None else (k, v) for k, v in zip(self.k, self.v)]

    def state_bytes(self, layer_id: int) -> int:
        return 0

    def layer_bytes(self, layer_id: int) -> tuple[int, int]:
        """(K + V + per-request state bytes, index-K bytes) held for one layer."""
        kv = tensor_bytes(self.k[layer_id]) + tensor_bytes(self.v[layer_id])
        return kv + self.state_bytes(layer_id), tensor_bytes(self.index_k[layer_id])


class PagedKVCache(CacheBytes):
    """Per-layer paged caches sharing one block table per request.

    ``kv[i]``: MLA latent cache, ``[num_blocks, block, kv_lora_rank + qk_rope_head_dim]`` (576 in
    every production model; bf16/fp32) or uint8 ``[num_blocks, block, 656]`` (``fp8_ds_mla``, 512 +
    64 only). ``index_k[i]``: uint8 ``[num_blocks, block * 132]`` (fp8 keys + fp32 scales) for layers
    whose indexer scores in fp8, fp32 ``[num_blocks, block, index_head_dim]`` for fp32 scoring, and
    None for S layers. Under pipeline parallelism a rank holds only its stage's layers (None for
    the others); under tensor parallelism every rank holds the whole latent and index-K caches.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, kv_cache_dtype: str = "auto",
                 block_size: int = BLOCK_SIZE):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        args = model.args
        self.device = model.topk_buffer.device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_cache_dtype = kv_cache_dtype
        kv_dtype = _kv_dtype(kv_cache_dtype, model.dtype)
        if kv_dtype == torch.uint8 and not args.native_mla:
            raise ValueError(f"kv_cache_dtype 'fp8_ds_mla' stores a 512 + 64 latent; this model's is "
                             f"{args.kv_lora_rank} + {args.qk_rope_head_dim} (use 'bf16' or 'fp32')")
        self.manager = CacheManager(num_blocks, block_size)
        # step reuse (models/step_reuse.py): each request's last selection per F layer, freed with it
        self.selections = SelectionStore()
        self.manager.on_free.append(self.selections.free)
        self.kv, self.index_k = [], []
        for layer in model.model.layers:
            if layer.self_attn is None:  # a layer of another pipeline stage: its caches live there
                self.kv.append(None)
                self.index_k.append(None)
                continue
            if kv_dtype == torch.uint8:
                self.kv.append(torch.zeros(num_blocks, block_size, FP8_DS_MLA_BYTES, dtype=torch.uint8, device=self.device))
            else:
                width = args.kv_lora_rank + args.qk_rope_head_dim
                self.kv.append(torch.zeros(num_blocks, block_size, width, dtype=kv_dtype, device=self.device))
            indexer = layer.self_attn.indexer
            if indexer is None:
                self.index_k.append(None)
            elif indexer.fp8:
                self.index_k.append(torch.zeros(num_blocks, block_size * INDEX_K_BYTES, dtype=torch.uint8, device=self.device))
            else:
                self.index_k.append(torch.zeros(num_blocks, block_size, indexer.head_dim, dtype=torch.float32, device=self.device))

    @property
    def num_layers(self) -> int:
        return len(self.kv)

    def layer_bytes(self, layer_id: int) -> tuple[int, int]:
        """(MLA KV bytes, index-K bytes) held for one layer."""
        return tensor_bytes(self.kv[layer_id]), tensor_bytes(self.index_k[layer_id])


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
class LayerRecord:
    """What an MLA block hands a ``TorchPass`` observer after its projections (all detached)."""
    layer_id: int
    full: bool                          # the layer ran its indexer in this forward
    x: torch.Tensor                     # the block's input [B, T, hidden] (the indexer's input)
    qr: torch.Tensor                    # the query latent [B, T, q_lora_rank]
    q: torch.Tensor                     # per-head queries [B, H, T, nope + rope]
    k: torch.Tensor                     # per-head keys [B, H, T, nope + rope]
    scale: float                        # the softmax scale
    selection: Optional[torch.Tensor]   # int64 [B, T, k] the positions attended (None: causal window)


@dataclass
class TorchPass:
    """A differentiable forward over ``batch`` requests of ``seq`` tokens (rows request-major):
    the blocks run the torch definitions (``reference``, ``differentiable``) instead of the kernels.

    attention ``causal``: every layer attends over its whole causal window (the indexers do not
    run); ``selected``: each F layer's indexer picks its top-k positions (fp32 scores, no
    gradient) and every layer attends over the positions its source F layer picked, as at
    inference. ``observe`` receives each MLA block's ``LayerRecord`` (the training losses)."""
    batch: int
    seq: int
    attention: str
    chunks: list                        # query-row ranges (differentiable.row_chunks)
    recompute: bool = False             # recompute attention chunks in backward
    observe: Optional[Callable[[LayerRecord], None]] = None
    selection: Optional[torch.Tensor] = None  # the last F layer's picks, int64 [B, T, k]

    def __post_init__(self):
        if self.attention not in ("causal", "selected"):
            raise ValueError(f"attention must be 'causal' or 'selected', got {self.attention!r}")


@dataclass
class ForwardContext:
    meta: BatchMeta
    cos: torch.Tensor                    # fp32 [N, rope / 2]
    sin: torch.Tensor
    topk_buffer: torch.Tensor            # the model's shared int32 [rows, index_topk]
    full: Sequence[bool]                 # per layer id (main, then MTP): F, runs its indexer (the plan, as data)
    cache: Optional[PagedKVCache] = None
    timer: Optional[StageTimer] = None
    topk_valid: bool = False             # an F layer has written rows [:N] in this forward
    # No host reads of device data (CUDA-graph capture, runtime/cuda_graph.py): the MoE runs its
    # masked form and the paths that need host-side lengths refuse.
    sync_free: bool = False
    torch_pass: Optional[TorchPass] = None  # set: a differentiable forward (blocks run reference definitions)
    reuse_steps: int = 1                 # index_reuse_steps in force (1: every F layer computes every row)
    decode_reuse: bool = True            # False: every row computes, selections are still saved (prefill)
    reuse_min_recall: Optional[float] = None  # adaptive step reuse: the probe layer's recall bar (None: fixed)
    reuse_forced: set = field(default_factory=set)  # request ids the probe layer sent back to computing
    input_ids: Optional[torch.Tensor] = None  # int64 [N] the rows' token ids, for layers that read them (PLE)

    def is_full(self, layer_id: int) -> bool:
        return bool(self.full[layer_id])

    def reuse_rows(self, rows: torch.Tensor) -> None:
        """Start this forward with top-k rows an F layer wrote earlier (MTP draft steps, pattern search)."""
        self.topk_rows.copy_(rows)
        self.topk_valid = True

    @property
    def topk_rows(self) -> torch.Tensor:
        """Rows ``[:N]`` of the shared buffer: one view a forward (two layers' reads a layer would
        each slice it), made again if the buffer or the row count is replaced."""
        buf, n = self.topk_buffer, self.meta.num_tokens
        made = self.__dict__.get("_topk_rows")
        if made is None or made[0] is not buf or made[1] != n:
            made = self.__dict__["_topk_rows"] = (buf, n, buf[:n])
        return made[2]

    def stage(self, layer_id: int, name: str):
        """A stage of layer ``layer_id``: a ``record_function`` range while torch's profiler runs, an
        NVTX range on CUDA, the StageTimer's time when one is set; otherwise nothing at all (a CPU
        decode step has 5 a layer, and an idle ``record_function`` costs ~15 us). Nothing inside a
        compiled step (its ops are profiled as the compiled graph's)."""
        if torch.compiler.is_compiling():
            return _NO_STAGE
        if self.timer is None and not self.cos.is_cuda and not torch._C._autograd._profiler_enabled():
            return _NO_STAGE
        return self._stage(layer_id, name)

    @contextmanager
    def _stage(self, layer_id: int, name: str):
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


_NO_STAGE = nullcontext()


def row_chunks(n: int, per_row: int, budget: int):
    """Row ranges of at most ``budget // per_row`` rows (bounded working sets in long prefills)."""
    step = max(1, budget // max(per_row, 1))
    for r0 in range(0, n, step):
        yield r0, min(n, r0 + step)
