"""bf16 prompt-row projections on the CPU: torch's bf16 GEMM against this package's widened form
(``parallel.linear.linear`` on a CPU without a native bf16 GEMM: x widened once, the weight a
``WIDEN_BLOCK_BYTES`` block at a time, fp32 GEMMs rounded to bf16) and torch's fp32 GEMM on the same
values (the ceiling), interleaved, one thread by default, CPU seconds.

    python bench/bench_linear_widen.py [--rows 2048] [--threads 1] [--repeat 5] [--json OUT]

Shapes: the GLM-5 bench checkpoint's projections (bench_llamacpp.py: hidden 512, 16 heads, q_lora
256, latent 512 + 64, indexer 32 x 128, MoE intermediate 256) and V3.2's widest (7168 -> 1536,
1536 -> 24576 at 16 heads of a TP 8 shard is 3072). On a CPU with a native bf16 GEMM the widened
column still times the widened form (forced), for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from indexcache.parallel import linear as plinear

SHAPES = [  # (name, K, N)
    ("q_a_proj", 512, 256), ("q_b_proj", 256, 2048), ("kv_a_proj", 512, 576), ("o_proj", 1024, 512),
    ("indexer wq_b", 256, 4096), ("expert gate", 512, 256), ("dense up", 512, 1024),
    ("V3.2 q_a_proj", 7168, 1536), ("V3.2 q_b_proj TP8", 1536, 3072),
]


def cpu_ms(fn, min_time: float = 0.2) -> float:
    fn()
    n, t0 = 0, time.process_time()
    while True:
        fn()
        n += 1
        el = time.process_time() - t0
        if el >= min_time:
            return 1e3 * el / n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = plinear._native_bf16_gemm()
    plinear._native_bf16_gemm = lambda: False  # time the widened form on every CPU
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, k, n in SHAPES:
            x = torch.randn(args.rows, k, generator=g).to(torch.bfloat16)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
            xf, wf = x.float(), w.float()
            fns = {"torch bf16": lambda: F.linear(x, w), "widened": lambda: plinear.linear(x, w),
                   "torch fp32": lambda: F.linear(xf, wf)}
            times = {v: [] for v in fns}
            for _ in range(args.repeat):
                for v, fn in fns.items():
                    times[v].append(cpu_ms(fn))
            flop = 2 * args.rows * k * n
            row = {"shape": name, "rows": args.rows, "k": k, "n": n}
            for v, ts in times.items():
                med = statistics.median(ts)
                row[v] = {"ms": med, "min": min(ts), "max": max(ts), "gflop_s": flop / med / 1e6}
            row["widened_vs_torch_bf16"] = row["torch bf16"]["ms"] / row["widened"]["ms"]
            row["widened_share_of_fp32"] = row["torch fp32"]["ms"] / row["widened"]["ms"]
            rows.append(row)
    print(f"{args.rows} rows, {args.threads} thread(s), CPU ms median (min-max) of {args.repeat}; "
          f"native bf16 GEMM here: {native}; torch {torch.__version__}")
    print("| shape | K x N | torch bf16 ms | widened ms | torch fp32 ms | widened / torch bf16 | "
          "fp32 / widened | widened GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        f = lambda v: f"{r[v]['ms']:.2f} ({r[v]['min']:.2f}-{r[v]['max']:.2f})"  # noqa: E731
        print(f"| {r['shape']} | {r['k']} x {r['n']} | {f('torch bf16')} | {f('widened')} | {f('torch fp32')} | "
              f"{r['widened_vs_torch_bf16']:.2f}x | {r['widened_share_of_fp32']:.2f} | {r['widened']['gflop_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "threads": args.threads, "native_bf16_gemm": native,
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                      fh, indent=1)


if __name__ == "__main__":
    main()
