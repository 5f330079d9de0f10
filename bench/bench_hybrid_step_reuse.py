"""Decode tokens per second of the two hybrid families' test models (tests/test_hybrid_step_reuse.py's
configs, random weights, its IndexCache patterns) with ``index_reuse_steps`` 1 against R > 1
(docs/model.md, "IndexCache across decode steps"): ``generate`` from a random prompt of each
context, eager decode, the R values interleaved round by round; median (min-max) per cell.

    PYTHONPATH=python:tests .venv/bin/python bench/bench_hybrid_step_reuse.py --contexts 1024 4096 --new 32 --repeat 3 [--json OUT]

``--stages``: instead, a decode loop of ``--new`` single-token steps after the prompt (random
tokens), timed with a ``StageTimer``: ms per step in the F layers' indexer stages ("indexer" +
"topk") and in the whole step, per R, interleaved the same way.
"""

import argparse
import json
import platform
import random
import statistics

import torch
import test_hybrid_step_reuse as T

from indexcache.models import BatchMeta
from indexcache.models.state import StageTimer
from indexcache.runtime.generation import generate


def staged(model, prompt: list, new: int, rng) -> tuple:
    """(indexer + topk ms per decode step, wall ms per decode step) over ``new`` steps after ``prompt``."""
    import time
    cache = model.allocate_cache(-(-(len(prompt) + new) // T.BS), "auto", T.BS)
    cache.manager.allocate(0, len(prompt) + new)
    meta = BatchMeta.paged_batch(cache, [0], [0], [len(prompt)])
    model.forward_tokens(torch.tensor(prompt), meta, cache, reuse=False)
    timer, t0 = StageTimer(), time.perf_counter()
    for i in range(new):
        meta = BatchMeta.paged_batch(cache, [0], [len(prompt) + i], [1])
        model.forward_tokens(torch.tensor([rng.randrange(3, 256)]), meta, cache, timer)
    wall = (time.perf_counter() - t0) * 1e3 / new
    return (timer.times.get("indexer", 0.0) + timer.times.get("topk", 0.0)) * 1e3 / new, wall


def models(family: str, reuses: list, context: int) -> dict:
    cls, cfg, pattern = T.FAMILIES[family]
    cfg = dict(cfg, max_position_embeddings=max(cfg["max_position_embeddings"], 2 * context))
    over = {"use_index_cache": True, "index_topk_pattern": pattern}
    return {r: cls.from_config(cfg, {**over, "index_reuse_steps": r}, seed=5).eval() for r in reuses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["glm", "qwen"], choices=sorted(T.FAMILIES))
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--reuse", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--new", type=int, default=32, help="tokens decoded per run")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (each runs every R once, in turn)")
    ap.add_argument("--json", default=None, help="write the runs here")
    ap.add_argument("--stages", action="store_true", help="time the indexer stages of a decode loop instead")
    args = ap.parse_args()
    rng = random.Random(0)
    out = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "runs": []}
    for family in args.families:
        for context in args.contexts:
            ms = models(family, args.reuse, context)
            prompt = [rng.randrange(3, 256) for _ in range(context)]
            generate(ms[args.reuse[0]], [prompt[:16]], 2, stop_tokens=[], decode_step="eager")  # warm-up
            rates, walls = {r: [] for r in args.reuse}, {r: [] for r in args.reuse}
            for _ in range(args.repeat):
                for r in args.reuse:
                    if args.stages:
                        idx, wall = staged(ms[r], prompt, args.new, rng)
                        out["runs"].append({"family": family, "context": context, "reuse": r, "indexer_ms": idx,
                                            "step_ms": wall})
                        rates[r].append(idx)
                        walls[r].append(wall)
                        continue
                    res = generate(ms[r], [prompt], args.new, stop_tokens=[], decode_step="eager")
                    rates[r].append(res.decode_tokens_per_s)
            cells = []
            for r in args.reuse:
                v = rates[r]
                if not args.stages:
                    out["runs"].append({"family": family, "context": context, "reuse": r, "decode_tok_s": v})
                cells.append(f"R {r}: {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                             + (f" ms indexer, {statistics.median(walls[r]):.1f} ms step" if args.stages else " tok/s"))
            base = statistics.median(rates[args.reuse[0]])
            ratio = ", ".join(f"R {r} / R {args.reuse[0]} {statistics.median(rates[r]) / base:.2f}x"
                              for r in args.reuse[1:])
            print(f"{family} context {context}: " + "; ".join(cells) + f"; {ratio}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
