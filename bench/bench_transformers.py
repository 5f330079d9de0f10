"""transformers' DSA model before and after ``indexcache.integrations.transformers.enable``.

    python bench/bench_transformers.py [--quick] [--contexts 1024,2048,...] [--baseline-max 4096]
                                       [--decode-steps N] [--repeats R] [--layers L] [--dtype fp32|bf16]
                                       [--json PATH]

One ``GlmMoeDsaForCausalLM`` with random weights (the kernels' widths: latent 512, RoPE 64,
indexer 128; ``index_topk`` 128 by default, so attention is sparse from 129 tokens), built once
and timed in the same process in three forms:

- ``hf``: transformers' own eager forward (fp32 indexer over every key, K/V expanded for every
  cached token, dense attention under the top-k mask);
- ``ic``: the same model after ``enable(model)`` (fp8 + Hadamard indexer, every layer F);
- ``ic+cache``: ``enable(model, hf_overrides=...)`` with IndexCache, every second layer S
  (``index_topk_freq`` 2, offset 1: F S F S ...).

Per context: the prefill of ``context`` tokens (one forward, cache on), then ``--decode-steps``
single-token steps on that cache (the time of one step). Each figure is the median of
``--repeats`` runs with min and max. transformers' eager path holds ``[S, T]`` fp32 score and
attention matrices per head, so it is run only up to ``--baseline-max`` tokens (its estimated peak
memory is printed for the longer contexts). Prints a table of times and of ratios ``hf / ic`` and
writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build(args):
    import transformers

    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=2048, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, q_lora_rank=512, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_topk=args.index_topk, index_head_dim=128,
        index_n_heads=args.index_heads, first_k_dense_replace=args.layers,  # dense MLPs: time goes to attention
        max_position_embeddings=65536, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.config._attn_implementation = "eager"
    return model.to(dict(fp32=torch.float32, bf16=torch.bfloat16)[args.dtype]).eval()


def time_one(model, ctx, decode_steps):
    ids = torch.randint(0, 2048, (1, ctx + decode_steps), generator=torch.Generator().manual_seed(1))
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(input_ids=ids[:, :ctx], cache=cache, use_cache=True)
        prefill = time.perf_counter() - t0
        steps = []
        for i in range(decode_steps):
            t0 = time.perf_counter()
            model(input_ids=ids[:, ctx + i:ctx + i + 1], cache=cache, use_cache=True)
            steps.append(time.perf_counter() - t0)
    return prefill, statistics.median(steps) if steps else float("nan")


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def baseline_bytes(args, ctx):
    """transformers' eager prefill keeps fp32 [S, T] indexer scores per indexer head and attention
    weights per head at once (plus their masks): a rough peak."""
    return 4 * ctx * ctx * (args.index_heads + 2 * args.heads)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384")
    p.add_argument("--baseline-max", type=int, default=4096, help="longest context for transformers' own forward")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--index-heads", type=int, default=16)
    p.add_argument("--index-topk", type=int, default=128)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--quick", action="store_true", help="2048 tokens only, 2 repeats, 2 decode steps")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.repeats, args.decode_steps = "2048", 2, 2
    contexts = [int(c) for c in args.contexts.split(",")]

    from indexcache.integrations.transformers import enable

    base = build(args)
    forms = {"hf": base,
             "ic": enable(copy.deepcopy(base)),
             "ic+cache": enable(copy.deepcopy(base), hf_overrides={"use_index_cache": True, "index_topk_freq": 2,
                                                                   "index_skip_topk_offset": 1})}
    plans = {k: getattr(m, "indexcache_plan", None) for k, m in forms.items()}
    print(f"# {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtype}; "
          f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, {args.index_heads} indexer heads, "
          f"index_topk {args.index_topk}; ic+cache plan {plans['ic+cache'].pattern}", flush=True)
    results = []
    for ctx in contexts:
        row = {"context": ctx}
        for name, model in forms.items():
            if name == "hf" and ctx > args.baseline_max:
                row[name] = {"skipped": f"context > --baseline-max (peak ~{baseline_bytes(args, ctx) / 2**30:.0f} GiB)"}
                continue
            time_one(model, min(ctx, 256), 1)  # warm-up: first-call allocations
            runs = [time_one(model, ctx, args.decode_steps) for _ in range(args.repeats)]
            row[name] = {"prefill_s": summary([r[0] for r in runs]), "decode_step_s": summary([r[1] for r in runs])}
        results.append(row)
        print(format_row(row), flush=True)
    print()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "command": " ".join(["python", "bench/bench_transformers.py", *(argv or sys.argv[1:])]),
            "config": vars(args), "results": results}, indent=1))
    return results


def _fmt(entry, key):
    if "skipped" in entry:
        return "—"
    s = entry[key]
    return f"{s['median'] * 1e3:.0f} ({s['min'] * 1e3:.0f}-{s['max'] * 1e3:.0f})"


def format_row(row):
    return f"context {row['context']}: " + "; ".join(
        f"{k} prefill {_fmt(v, 'prefill_s')} ms, decode {_fmt(v, 'decode_step_s')} ms"
        for k, v in row.items() if k != "context")


def table(results):
    lines = ["| context | hf prefill ms | ic prefill ms | ic+cache prefill ms | hf decode ms | ic decode ms | "
             "ic+cache decode ms | prefill hf/ic | prefill hf/ic+cache | decode hf/ic | decode hf/ic+cache |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        def ratio(key, other):
            if "skipped" in row["hf"]:
                return "—"
            return f"{row['hf'][key]['median'] / row[other][key]['median']:.2f}x"
        lines.append(f"| {row['context']} | " + " | ".join(
            [_fmt(row[k], "prefill_s") for k in ("hf", "ic", "ic+cache")]
            + [_fmt(row[k], "decode_step_s") for k in ("hf", "ic", "ic+cache")]
            + [ratio("prefill_s", "ic"), ratio("prefill_s", "ic+cache"),
               ratio("decode_step_s", "ic"), ratio("decode_step_s", "ic+cache")]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
