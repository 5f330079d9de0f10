"""The products of a vLLM decode step on the CPU, vLLM's kernels beside ``indexcache.rows_matmul``.

Runs in .venv-vllm (``bash scripts/setup_vllm.sh``). For a few rows (a decode step's requests) it times
each product the way vLLM runs it and through ``rows_matmul``, which is what the plugin's
``sparse_forward`` and ``few_rows_lm_head`` choose between (docs/vllm.md):

* the absorbed MLA products, per head: ``q_nope @ W_UK_T`` ``[N, P, L]`` and ``latent @ W_UV`` ``[N, L, V]``,
  torch.bmm (vLLM's ``MLAAttention``) vs rows_matmul, the token-major rows as transposed views;
* a linear layer and the LM head: vLLM's oneDNN handle (``onednn_mm``, prepacked) vs rows_matmul.

Weights come from memory as they do in a decode step (each call takes the next of enough copies to
exceed the last-level cache; the LM head is one copy of its own size). Variants interleaved, median
(min-max) of ``--repeat`` passes, microseconds per call; the ratio is vLLM's time over rows_matmul's::

    .venv-vllm/bin/python bench/bench_vllm_products.py --threads 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def timed(fns: dict, copies: int, repeat: int) -> dict:
    """{name: [us per call, one per pass]}; the variants alternate within each pass."""
    out = {k: [] for k in fns}
    for _ in range(repeat):
        for name, f in fns.items():
            f(0)
            t0 = time.perf_counter()
            for i in range(copies):
                f(i)
            out[name].append((time.perf_counter() - t0) / copies * 1e6)
    return out


def cases(args):
    """(label, rows, vLLM's variant, rows_matmul's, copies) for every product and row count."""
    from vllm import _custom_ops as vops

    from indexcache import ops

    heads, copies = args.heads, args.copies
    for name, p, l in (("W_UK_T", args.nope, args.latent), ("W_UV", args.latent, args.v_head)):
        ws = [torch.randn(heads, p, l).bfloat16() for _ in range(copies)]
        for b in args.rows:
            x = torch.randn(b, heads, p).bfloat16().transpose(0, 1)
            yield (f"{name} [{heads},{p},{l}]", b, lambda i, x=x: torch.bmm(x, ws[i]),
                   lambda i, x=x: ops.rows_matmul(x, ws[i], False), copies)
    for name, n, k, c in (("linear", args.linear[0], args.linear[1], copies), ("LM head", args.vocab, args.hidden, 1)):
        ws = [torch.randn(n, k).bfloat16() for _ in range(c)]
        hs = [vops.create_onednn_mm(w.t(), 32) for w in ws]
        for m in args.rows:
            x = torch.randn(m, k).bfloat16()
            yield (f"{name} [{n},{k}]", m, lambda i, x=x: vops.onednn_mm(hs[i], x, None),
                   lambda i, x=x: ops.rows_matmul(x, ws[i], True), c)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--copies", type=int, default=24, help="weight copies cycled (more than the cache holds)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--v-head", type=int, default=64)
    ap.add_argument("--linear", type=int, nargs=2, default=[2048, 512], metavar=("OUT", "IN"))
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import vllm

    rows = []
    print(f"{'product':<24} {'rows':>4} {'vLLM us':>22} {'rows_matmul us':>22} {'vLLM / ours':>11}")
    for label, m, theirs, ours, copies in cases(args):
        t = timed({"vllm": theirs, "rows_matmul": ours}, copies, args.repeat)
        med = {k: statistics.median(v) for k, v in t.items()}
        rows.append({"product": label, "rows": m, "vllm_us": t["vllm"], "rows_matmul_us": t["rows_matmul"],
                     "ratio": med["vllm"] / med["rows_matmul"]})

        def fmt(v):
            return f"{statistics.median(v):8.1f} ({min(v):.0f}-{max(v):.0f})"

        print(f"{label:<24} {m:>4} {fmt(t['vllm']):>22} {fmt(t['rows_matmul']):>22} "
              f"{med['vllm'] / med['rows_matmul']:>10.2f}x", flush=True)
    if args.json:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                   platform.processor())
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "threads": args.threads, "torch": torch.__version__, "vllm": vllm.__version__,
                       "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
