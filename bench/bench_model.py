"""Model benchmark: prefill and decode of the DeepSeek-V3.2 reference model per IndexCache freq.

    python bench/bench_model.py [--configs tiny,medium] [--contexts 1024,4096,...] [--freqs 1,2,4,8]
                                [--decode-steps N] [--dtype bf16] [--json PATH] [--plot PNG] [--markdown MD]

For each (config, context, freq): one prefill of ``context`` tokens through the paged caches
(one forward), then ``--decode-steps`` single-token decode steps at that context. Stage times
come from the model's own stage ranges (``indexcache::layerN::<stage>``): ``indexer`` = the
indexer's projections, RoPE, fp8 quantization and index-K cache insert; ``topk`` = scoring +
top-k (one fused op); ``mla_proj`` = MLA projections, RoPE, absorption, KV-cache insert;
``attention`` = sparse MLA + W_UV + o_proj; ``moe`` / ``mlp``. The indexer share is
(indexer + topk) / total at freq 1; the Amdahl bound for a plan keeping a fraction r of the
layers F is ``1 / ((1 - s) + s * r)``. Memory: indexer parameters plus the index-K cache for
``context`` tokens (132 B / token / F layer).

Weights are random (seeded); timings do not depend on them except through MoE routing balance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.state import BatchMeta, StageTimer
from indexcache.models.tiny import tiny_config

CONFIGS = {
    "tiny": tiny_config(),
    # ~115M parameters: 12 layers, 32 indexer heads, top-512 (so sparse from 1K tokens)
    "medium": tiny_config(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=12,
                          num_attention_heads=8, q_lora_rank=256, qk_nope_head_dim=64, v_head_dim=64,
                          n_routed_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2,
                          index_n_heads=32, index_topk=512, max_position_embeddings=65536,
                          rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}
STAGES = ("indexer", "topk", "mla_proj", "attention", "moe", "mlp")


def build(cfg, freq, ctx, dtype, src=None):
    overrides = {"max_num_batched_tokens": max(ctx, 64), "num_nextn_predict_layers": 0}
    if freq > 1:
        overrides.update(use_index_cache=True, index_topk_freq=freq)
    if src is None:
        return DeepseekV32ForCausalLM.from_config(cfg, overrides, dtype=dtype, seed=0)
    model = DeepseekV32ForCausalLM.from_config(cfg, overrides, dtype=dtype, init="empty")
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in src.state_dict().items() if k in own}, strict=True)
    return model


def run_one(model, ctx, decode_steps, device, repeats):
    """Best of ``repeats`` runs (the first run of a shape pays one-off kernel/JIT setup)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = torch.randint(0, 256, (ctx + decode_steps,), generator=torch.Generator().manual_seed(1)).to(device)
    best = None
    for _ in range(repeats):
        cache = model.allocate_cache(-(-(ctx + decode_steps + 1) // 64))
        cache.manager.allocate(0, ctx + decode_steps + 1)
        pre = StageTimer()
        sync()
        t0 = time.perf_counter()
        model.forward_tokens(ids[:ctx], BatchMeta.paged_batch(cache, [0], [0], [ctx]), cache, pre)
        sync()
        prefill = time.perf_counter() - t0
        dec = StageTimer()
        t0 = time.perf_counter()
        for j in range(decode_steps):
            model.forward_tokens(ids[ctx + j:ctx + j + 1], BatchMeta.paged_batch(cache, [0], [ctx + j], [1]), cache, dec)
        sync()
        decode = (time.perf_counter() - t0) / max(decode_steps, 1)
        if best is None or prefill + decode < best[0] + best[2]:
            best = (prefill, pre, decode, dec)
        del cache
    prefill, pre, decode, dec = best
    mem_params = sum(model.indexer_param_count()[: model.args.num_hidden_layers]) * model.dtype.itemsize
    mem_cache = model.plan.num_full * ctx * 132
    return {"prefill_s": prefill, "decode_s_per_token": decode,
            "prefill_stages": dict(pre.times), "decode_stages": {k: v / max(decode_steps, 1) for k, v in dec.times.items()},
            "indexer_param_bytes": mem_params, "index_cache_bytes": mem_cache,
            "pattern": model.plan.pattern, "num_full": model.plan.num_full}


def share(stages):
    total = sum(stages.values())
    return (stages.get("indexer", 0) + stages.get("topk", 0)) / total if total else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,medium")
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--freqs", default="1,2,4,8")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the best is kept")
    ap.add_argument("--json", default=None, help="write all records here")
    ap.add_argument("--plot", default=None, help="PNG: speedup vs context per freq")
    ap.add_argument("--markdown", default=None, help="write the table as a Markdown file (e.g. docs/performance.md)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    freqs = [int(f) for f in a.freqs.split(",")]
    if 1 not in freqs:
        freqs = [1] + freqs
    records = []
    for name in a.configs.split(","):
        cfg = CONFIGS[name]
        for ctx in [int(c) for c in a.contexts.split(",")]:
            base = None
            src = None
            for freq in freqs:
                model = build(cfg, freq, ctx, dtype, src).to(a.device)
                src = src or model
                r = run_one(model, ctx, a.decode_steps, a.device, a.repeats)
                r.update(config=name, context=ctx, freq=freq, layers=model.args.num_hidden_layers)
                if freq == 1:
                    base = r
                f_frac = r["num_full"] / r["layers"]
                for phase, key, st in (("prefill", "prefill_s", "prefill_stages"), ("decode", "decode_s_per_token", "decode_stages")):
                    s = share(base[st])
                    r[f"{phase}_indexer_share"] = share(r[st])
                    r[f"{phase}_speedup"] = base[key] / r[key]
                    r[f"{phase}_amdahl_bound"] = 1.0 / ((1 - s) + s * f_frac)
                records.append(r)
                print(f"{name:>6} ctx {ctx:>6} freq {freq} {r['pattern']:<12} prefill {r['prefill_s']*1e3:9.1f} ms "
                      f"(x{r['prefill_speedup']:.2f}, bound x{r['prefill_amdahl_bound']:.2f}, indexer {100*r['prefill_indexer_share']:.0f}%)  "
                      f"decode {r['decode_s_per_token']*1e3:7.2f} ms/tok (x{r['decode_speedup']:.2f}, bound "
                      f"x{r['decode_amdahl_bound']:.2f}, indexer {100*r['decode_indexer_share']:.0f}%)  "
                      f"indexer mem {(r['indexer_param_bytes'] + r['index_cache_bytes']) / 2**20:.1f} MiB", flush=True)
                del model
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
    if a.plot:
        plot(records, a.plot)
    if a.markdown:
        Path(a.markdown).write_text(markdown(records, a, Path(a.plot).name if a.plot else None))
    return 0


def plot(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = sorted({r["config"] for r in records})
    fig, axes = plt.subplots(len(configs), 2, figsize=(10, 3.6 * len(configs)), squeeze=False)
    for row, name in enumerate(configs):
        for col, phase in enumerate(("prefill", "decode")):
            ax = axes[row][col]
            for freq in sorted({r["freq"] for r in records}):
                rs = sorted((r for r in records if r["config"] == name and r["freq"] == freq), key=lambda r: r["context"])
                if freq == 1 or not rs:
                    continue
                line, = ax.plot([r["context"] for r in rs], [r[f"{phase}_speedup"] for r in rs], "o-", label=f"freq {freq}")
                ax.plot([r["context"] for r in rs], [r[f"{phase}_amdahl_bound"] for r in rs], "--", color=line.get_color(), alpha=0.6)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{name}: {phase} speedup vs freq 1 (dashed: Amdahl bound)")
            ax.set_xlabel("context (tokens)")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(records, a, png):
    out = ["# Model performance (CPU)", "",
           f"Command: `python bench/bench_model.py --configs {a.configs} --contexts {a.contexts} --freqs {a.freqs} "
           f"--decode-steps {a.decode_steps} --dtype {a.dtype} --repeats {a.repeats}`; torch {torch.__version__}, "
           f"{torch.get_num_threads()} threads. Kernels: `indexcache.ops` (the blocks call them).", "",
           "Speedups are against freq 1 of the same config and context; *bound* is Amdahl's from the indexer "
           "share measured at freq 1 and the fraction of layers kept F. Indexer memory = indexer parameters + "
           "index-K cache for the context.", ""]
    if png:
        out += [f"![speedup]({png})", ""]
    out += ["| config | context | freq | pattern | prefill ms | x | bound | indexer % | decode ms/tok | x | bound | "
            "indexer % | indexer MiB |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        out.append(f"| {r['config']} | {r['context']} | {r['freq']} | `{r['pattern']}` | {r['prefill_s']*1e3:.1f} | "
                   f"{r['prefill_speedup']:.2f} | {r['prefill_amdahl_bound']:.2f} | {100*r['prefill_indexer_share']:.0f} | "
                   f"{r['decode_s_per_token']*1e3:.2f} | {r['decode_speedup']:.2f} | {r['decode_amdahl_bound']:.2f} | "
                   f"{100*r['decode_indexer_share']:.0f} | {(r['indexer_param_bytes'] + r['index_cache_bytes']) / 2**20:.2f} |")
    out += ["", "Stage seconds per record are in the JSON (`prefill_stages`, `decode_stages`)."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
