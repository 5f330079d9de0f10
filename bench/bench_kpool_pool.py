"""GLM-5.3-Flash's paged key pooling (the pools completing in a step): one ``ops.kpool_pool_paged``
for the batch against the per-request torch loop ``_paged_pools`` ran before it (gather the pool's
``k | gate`` rows, ``pooled_keys``' softmax-weighted sum, scatter into the cache), side by side.

    python bench/bench_kpool_pool.py [--threads N] [--repeat N]

Shapes: GLM-5.3-Flash's indexer (index_kpool 16, head width 128, fp32 cache in blocks of 64). Cases:
a decode step of 32 requests each completing a pool, one where 2 of the 32 do, a prefill of 4 x
2048 tokens, a chunk of 512 tokens after 1000 for 2 requests. The two variants run interleaved;
the table gives the median ms with [min, max] over ``--repeat`` timings (each the mean of 5 calls),
and the largest difference between their pooled keys.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from indexcache import ops
from indexcache.models.blocks.kpool_indexer import pooled_keys

P, D, BS = 16, 128, 64


def loop_before(raw_cache, pool_cache, ape, table, ctx, q):
    """``_paged_pools``' pooling before the op: one gather / softmax / scatter per request."""
    flat_raw, flat_pool, per_block, table = raw_cache.view(-1, 2 * D), pool_cache.view(-1, D), BS // P, table.long()
    for b, (c, m) in enumerate(zip(ctx, q)):
        done, total = c // P, (c + m) // P
        if total > done:
            pos = torch.arange(done * P, total * P)
            rows = flat_raw[table[b, pos // BS] * BS + pos % BS]
            first = torch.arange(done, total) * P
            flat_pool[table[b, first // BS] * per_block + (first % BS) // P] = pooled_keys(rows[:, :D], rows[:, D:], ape)


def op_after(raw_cache, pool_cache, ape, table, ctx, q):
    lens = torch.tensor([ctx, q], dtype=torch.int32)
    ops.kpool_pool_paged(raw_cache, pool_cache, ape, table, lens[0], lens[1])


def timed(fn, iters=5):
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e3 * (time.perf_counter() - t0) / iters


def run_case(name, ctx, q, repeat, gen):
    width = max(-(-(c + m) // BS) for c, m in zip(ctx, q))
    nb = len(ctx) * width
    raw, ape = torch.randn(nb, BS, 2 * D, generator=gen), torch.randn(P, D, generator=gen)
    table = torch.randperm(nb, generator=gen).to(torch.int32).view(len(ctx), width).contiguous()
    pools = {f: torch.zeros(nb, BS // P, D) for f in (loop_before, op_after)}
    times = {f: [] for f in pools}
    for _ in range(repeat):
        for f, pool in pools.items():
            times[f].append(timed(lambda: f(raw, pool, ape, table, ctx, q)))
    diff = (pools[loop_before] - pools[op_after]).abs().max().item()
    cells = []
    for f in pools:
        t = times[f]
        cells.append(f"{statistics.median(t):.3f} [{min(t):.3f}, {max(t):.3f}]")
    ratio = statistics.median(times[loop_before]) / statistics.median(times[op_after])
    print(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.1f}x | {diff:.1e} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print("| step | loop before ms | op ms | before / after | max diff |\n|---|---|---|---|---|")
    run_case("decode 32, each completing a pool", [16 * k + 15 for k in range(10, 42)], [1] * 32, args.repeat, gen)
    run_case("decode 32, 2 completing", [16 * k + (15 if k % 16 == 0 else 3) for k in range(10, 42)], [1] * 32,
             args.repeat, gen)
    run_case("prefill 4 x 2048", [0] * 4, [2048] * 4, args.repeat, gen)
    run_case("chunk 512 after 1000, 2 requests", [1000] * 2, [512] * 2, args.repeat, gen)


if __name__ == "__main__":
    main()
