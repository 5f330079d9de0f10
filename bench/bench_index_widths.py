"""The key-pooled (GLM-5.3-Flash) and QSA (Qwen3.8-Flash-Next) indexers' scoring + top-k: the fused
``ops.indexer_topk`` (per-row windows over the pooled / block keys, no score matrix) against the
paths the two indexers took before it, side by side in one run.

    python bench/bench_index_widths.py [--threads N] [--repeat N] [--json PATH] [--ctx N] [--rows N]

Shapes: GLM-5.3-Flash's indexer (32 heads, index_kpool 16, index_topk 2048 -> 128 pools) and a QSA
indexer (16 heads, compress ratio 4, budget 2048 -> 512 blocks), both at head widths 64, 128 and
192, ``--rows`` query rows at the end of a ``--ctx``-token request (the pools / blocks it sees
complete). "before": kpool at width != 128 scored by reference.indexer_logits (``[rows, pools]``)
then ``ops.topk_indices`` (at 128 it already ran the fused op: the two rows time the same op);
QSA: torch einsum over row chunks, ReLU, head sum, then ``ops.topk_indices``. Each variant runs
``--repeat`` times interleaved; the table gives the median with [min, max] and before / after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from indexcache import ops
from indexcache import reference as ref


def once(fn, iters=3):
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e3 * (time.perf_counter() - t0) / iters


def case_inputs(rows, keys, heads, d, gen):
    q = torch.randn(rows, heads, d, generator=gen)
    k = torch.randn(keys, d, generator=gen)
    w = torch.rand(rows, heads, generator=gen)
    ke = torch.arange(keys - rows + 1, keys + 1, dtype=torch.int32).clamp(min=0)
    return q, k, w, torch.zeros(rows, dtype=torch.int32), ke


def kpool_before(q, k, w, ks, ke, topk, d):
    if d == 128:
        return ops.indexer_topk(q, k, None, w, ks, ke, topk)
    return ops.topk_indices(ref.indexer_logits(q, k, None, w, ks, ke), ks, ke, topk)


def qsa_before(q, k, w, ks, ke, topk, d):
    logits = torch.einsum("thd,sd->ths", q, k).relu().sum(dim=1) / d ** 0.5
    cols = torch.arange(k.shape[0])
    logits = torch.where(cols < ke.unsqueeze(1), logits, torch.full_like(logits, float("-inf")))
    return ops.topk_indices(logits.contiguous(), ks, ke, topk)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, heads, pool, topk_tokens, before in (("kpool", 32, 16, 2048, kpool_before), ("qsa", 16, 4, 2048, qsa_before)):
        for d in (64, 128, 192):
            q, k, w, ks, ke = case_inputs(args.rows, args.ctx // pool, heads, d, gen)
            topk = topk_tokens // pool
            after = ops.indexer_topk(q, k, None, w, ks, ke, topk)
            assert torch.equal(after, ops.topk_indices(ref.indexer_logits(q, k, None, w, ks, ke), ks, ke, topk))
            unit = torch.ones_like(w) if name == "qsa" else w
            cases.append((name, heads, d, k.shape[0], topk,
                          lambda q=q, k=k, w=unit, ks=ks, ke=ke, t=topk, d=d, b=before: b(q, k, w, ks, ke, t, d),
                          lambda q=q, k=k, w=unit, ks=ks, ke=ke, t=topk: ops.indexer_topk(q, k, None, w, ks, ke, t)))
    times = {i: ([], []) for i in range(len(cases))}
    for _ in range(args.repeat):  # interleaved: every variant once per round
        for i, (*_, before, after) in enumerate(cases):
            times[i][0].append(once(before))
            times[i][1].append(once(after))
    load = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, {args.rows} rows at the end of a {args.ctx}-token request, "
          f"load {load:.2f}, {args.repeat} interleaved repeats: median ms [min, max]")
    print(f"{'indexer':7} {'heads':>5} {'d':>4} {'keys':>6} {'topk':>5} {'before':>24} {'fused op':>24} {'before/after':>12}")
    records = []
    for i, (name, heads, d, keys, topk, *_) in enumerate(cases):
        b, a = times[i]
        mb, ma = statistics.median(b), statistics.median(a)
        print(f"{name:7} {heads:5} {d:4} {keys:6} {topk:5} {mb:9.2f} [{min(b):6.2f},{max(b):6.2f}] "
              f"{ma:9.2f} [{min(a):6.2f},{max(a):6.2f}] {mb / ma:12.2f}")
        records.append({"indexer": name, "heads": heads, "d": d, "keys": keys, "topk": topk, "rows": args.rows,
                        "before_ms": mb, "before_min": min(b), "before_max": max(b), "after_ms": ma,
                        "after_min": min(a), "after_max": max(a), "speedup": mb / ma,
                        "threads": torch.get_num_threads(), "load": load})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
