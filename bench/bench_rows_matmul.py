"""A decode row through a weight from DRAM: ``ops.rows_matmul`` vs torch's ``F.linear``, side by side.

    python bench/bench_rows_matmul.py [--threads 1] [--repeat 7] [--rows 1] [--json OUT]

Each shape is a projection of a decode step (the GLM-5 checkpoint of bench_llamacpp.py, 8 layers x
hidden 512, and DeepSeek-V3.2's production widths; the absorbed MLA heads, 16 per-head matrices
against torch.bmm); every call reads a different copy of the weight
(copies cycled until more than 256 MB have been read), so the weight comes from DRAM as it does in
a decode step, where ~100 MB of weights are read once each. The machine's own ceiling beside them:
one ``copy_`` of a 256 MB buffer (bytes read + written per second, measured before and after).
The variants run interleaved, ``--repeat`` rounds; each figure is the median of the rounds with
min / max. Prints one table (GB/s of weight read, and ours / torch) and, with --json, one record
per shape: {"shape", "g", "w_nk", "dtype", "rows", "threads", "ours_gb_s", "ours_min", "ours_max", "torch_gb_s",
"torch_min", "torch_max", "ratio", "copy_gb_s", "cpu_model"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bench_ops import cpu_model
from indexcache import ops

# (name, N, K): out features x in features, a linear layer's [N, K] weight
SHAPES = [
    ("glm5 bench LM head", 50260, 512),
    ("glm5 bench indexer wq_b", 4096, 256),
    ("glm5 bench expert gate/up", 256, 512),
    ("glm5 bench kv_a", 576, 512),
    ("v3.2 q_a", 1536, 7168),
    ("v3.2 kv_a", 576, 7168),
    ("v3.2 q_b", 24576, 1536),
    ("v3.2 expert gate/up", 2048, 7168),
    ("v3.2 expert down", 7168, 2048),
]
# (name, G, N, K, w_nk): the absorbed MLA heads, one [K, N] (W_UK: q_nope into the latent) or [N, K]
# (W_UV: the latent out to v) matrix per head, bf16 of the GLM-5 bench checkpoint's 16 heads
HEAD_SHAPES = [
    ("glm5 bench W_UK heads [K, N]", 16, 512, 64, False),
    ("glm5 bench W_UV heads [N, K]", 16, 64, 512, True),
]
READ_BYTES = 256 << 20


def copies_of(shape: tuple, dtype) -> list:
    per = torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
    return [torch.randn(*shape).to(dtype) for _ in range(max(2, READ_BYTES // per))]


def rate(fn, weights: list) -> float:
    """GB/s of weight read by one pass of ``fn`` over every copy."""
    t0 = time.perf_counter()
    for w in weights:
        fn(w)
    dt = time.perf_counter() - t0
    return sum(w.numel() * w.element_size() for w in weights) / dt / 1e9


def copy_rate() -> float:
    src = torch.empty(READ_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return 2 * READ_BYTES / (time.perf_counter() - t0) / 1e9


def bench_shape(name, n, k, args, dtype, g: int = 0, w_nk: bool = True) -> dict:
    """One shape, 2-D (``g`` 0: ``[N, K]``, against F.linear) or per head (``g`` matrices, ``[N, K]``
    or ``[K, N]`` as ``w_nk`` says, against torch.bmm)."""
    lead = (g,) if g else ()
    weights = copies_of(lead + ((n, k) if w_nk else (k, n)), dtype)
    x = torch.randn(*lead, args.rows, k).to(dtype)
    out = torch.empty(*lead, args.rows, n)
    if not g:
        theirs = lambda w: F.linear(x, w)  # noqa: E731
    else:
        theirs = (lambda w: torch.bmm(x, w.transpose(1, 2))) if w_nk else (lambda w: torch.bmm(x, w))  # noqa: E731
    variants = {
        "ours": lambda w: ops.rows_matmul(x, w, w_nk, out=out),
        "torch": theirs,
    }
    for fn in variants.values():  # touch every copy once
        rate(fn, weights)
    got = {v: [] for v in variants}
    for _ in range(args.repeat):
        for v, fn in variants.items():
            got[v].append(rate(fn, weights))
    rec = {"shape": name, "g": g, "w_nk": w_nk, "n": n, "k": k, "dtype": str(dtype).replace("torch.", ""),
           "rows": args.rows, "threads": torch.get_num_threads(), "cpu_model": cpu_model()}
    for v, r in got.items():
        rec.update({f"{v}_gb_s": statistics.median(r), f"{v}_min": min(r), f"{v}_max": max(r)})
    rec["ratio"] = rec["ours_gb_s"] / rec["torch_gb_s"]
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    records = []
    with torch.inference_mode():
        copies = [copy_rate() for _ in range(3)]
        for name, n, k in SHAPES:
            records.append(bench_shape(name, n, k, args, dtype))
        for name, g, n, k, w_nk in HEAD_SHAPES:
            records.append(bench_shape(name, n, k, args, dtype, g, w_nk))
        copies += [copy_rate() for _ in range(3)]
    copy = statistics.median(copies)
    print(f"{cpu_model()}, {args.threads} thread(s), {args.rows} row(s), {args.dtype} weights; "
          f"copy_ of 256 MB: {copy:.1f} GB/s read + written (min {min(copies):.1f}, max {max(copies):.1f})")
    print(f"{'shape':28} {'N x K':>13} {'ours GB/s (min-max)':>22} {'torch GB/s (min-max)':>22} {'ours/torch':>10}")
    for r in records:
        r["copy_gb_s"] = copy
        print(f"{r['shape']:28} {r['n']:>6} x {r['k']:<5} {r['ours_gb_s']:7.1f} ({r['ours_min']:.1f}-{r['ours_max']:.1f})"
              f"{'':>5} {r['torch_gb_s']:7.1f} ({r['torch_min']:.1f}-{r['torch_max']:.1f}){'':>5} {r['ratio']:9.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
