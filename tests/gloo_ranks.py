"""One harness for the scale-out parity tests (DESIGN.md §11): run a function on ``world``
spawned processes of a gloo group and collect what each rank returned, and the outputs a
family's parity test compares against one process."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from indexcache.runtime.generation import generate


def _rank_main(rank: int, world: int, tmp: Path, fn, args: tuple) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init{world}", rank=rank, world_size=world)
        out = fn(*args)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out = {"failure": traceback.format_exc()}
    torch.save(out, tmp / f"rank{rank}_{world}.pt")


def run_on_ranks(fn, args: tuple, tmp: Path, world: int = 2) -> list:
    """``fn(*args)`` (a module-level function returning a dict of tensors and plain values) on each
    rank of a fresh gloo group; the dicts in rank order. A rank that raised fails the test with its
    traceback."""
    import torch.multiprocessing as mp
    mp.start_processes(_rank_main, args=(world, tmp, fn, args), nprocs=world, join=True, start_method="spawn")
    outs = [torch.load(tmp / f"rank{r}_{world}.pt", weights_only=True) for r in range(world)]
    for r, o in enumerate(outs):
        assert "failure" not in o, f"rank {r}:\n{o['failure']}"
    return outs


def model_outputs(model, ids: torch.Tensor, prompts: list) -> dict:
    """What a parity test compares: the logits of ``ids``, the shared top-k rows they left, and
    four greedy tokens per prompt through the paged generation path."""
    return {"logits": model(ids), "rows": model.topk_buffer[:ids.numel()].clone(),
            "tokens": generate(model, prompts, 4, stop_tokens=[]).tokens}
