"""Process groups and the pipeline-stage hand-off (DESIGN.md §11): ``ParallelContext`` (this
rank's place, the collectives, the splits of heads, experts and vocabulary), torchrun
initialisation and the stage boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from indexcache.formats import FP8_LINEAR_NAMES

from .linear import Linear, ShardedLinear


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
        non-FP8 layer is a ``Linear`` (an ``nn.Linear`` with the same parameters)."""
        fp8 = self.fp8 and name in FP8_LINEAR_NAMES
        sharded = split is not None and self.tp_size > 1
        if not fp8 and not sharded:
            return Linear(in_features, out_features)
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

    def send_next(self, hidden: torch.Tensor, topk_rows: Optional[torch.Tensor], valid: bool,
                  forced: Sequence[int] = ()) -> None:
        """Stage s -> s+1 (rank r -> r + tp): the residual stream, its "top-k rows valid" flag and,
        when the next stage begins on an S layer (both sides know it from the plan), the rows [:N].
        ``forced``: under adaptive step reuse, per request of the batch 1 where the probe layer sent
        it back to computing (models/step_reuse.py); both sides know the batch's size."""
        dist, dst = _dist(), self.rank + self.tp_size
        flag = torch.tensor([int(valid), *forced], dtype=torch.int32, device=hidden.device)
        for t in (flag, hidden.contiguous()) + (() if topk_rows is None else (topk_rows.contiguous(),)):
            self._count("stage_send", t)
            dist.send(t, dst)

    def recv_prev(self, hidden: torch.Tensor, topk_rows: Optional[torch.Tensor],
                  num_forced: int = 0) -> tuple[bool, list]:
        """Receive :meth:`send_next` into ``hidden`` and ``topk_rows`` (a view of the shared buffer,
        None when this stage begins on an F layer); returns the valid flag and the ``num_forced``
        per-request flags."""
        dist, src = _dist(), self.rank - self.tp_size
        flag = torch.zeros(1 + num_forced, dtype=torch.int32, device=hidden.device)
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
        flags = flag.tolist()
        return bool(flags[0]), flags[1:]

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


def check_divisible(par: Optional[ParallelContext], sizes) -> None:
    """A family's own widths that tensor parallelism splits (``sizes``: (field, value) pairs): every
    one that ``par.tp_size`` does not divide, named in one ValueError."""
    tp = 1 if par is None else par.tp_size
    bad = [f"{what} {n} is not divisible by tp_size {tp}" for what, n in sizes if n % tp]
    if bad:
        raise ValueError(f"cannot split this model over tp_size {tp}: " + "; ".join(bad))


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
