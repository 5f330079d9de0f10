"""DeepSeek-V4 benchmark: paged prefill and decode per IndexCache freq over the CSA layers.

    python bench/bench_v4.py [--contexts 1024,4096] [--freqs 1,2,4] [--decode-steps N] [--json PATH]

A random DeepSeek-V4 at the production attention widths (K=V head 512 with RoPE 64, indexer
128, rates 4 / 128, window 128) but a small hidden size, 8 heads, 16 indexer heads and 8 layers
(sliding, then CSA / HCA alternating: 4 CSA layers). For each (context, freq): one prefill of
``context`` tokens through the paged caches, then ``--decode-steps`` single-token decode steps.
Stage times come from the model's stage ranges (``indexcache::layerN::<stage>``): ``indexer`` =
the CSA indexer's scoring and top-k (its compressor is in ``compress``), ``attn`` = sparse
attention over the window and the compressed entries plus the output projection,
``attn_proj`` = projections, RoPE and cache insert, ``compress`` = the compressors, ``moe``.
``cpu ms``: the process's CPU time per decode step (steadier than wall time on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from indexcache.models import DeepseekV4ForCausalLM
from indexcache.models.state import BatchMeta, StageTimer

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CONFIG = dict(model_type="deepseek_v4", vocab_size=1024, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=8,
              num_attention_heads=8, head_dim=512, qk_rope_head_dim=64, q_lora_rank=128, n_routed_experts=4,
              num_experts_per_tok=2, layer_types=[SLIDING] + [CSA, HCA] * 3 + [CSA], hc_mult=2, sliding_window=128,
              o_groups=2, o_lora_rank=128, index_n_heads=16, index_head_dim=128, index_topk=128,
              compress_rates={CSA: 4, HCA: 128}, mlp_layer_types=["hash_moe"] + ["moe"] * 7,
              max_position_embeddings=65536)


def run(context: int, freq: int, steps: int) -> dict:
    model = DeepseekV4ForCausalLM.from_config(CONFIG, {"use_index_cache": True, "index_topk_freq": freq,
                                                       "index_skip_topk_offset": 1, "max_num_batched_tokens": context},
                                              seed=0)
    cache = model.allocate_cache(-(-(context + steps) // 64))
    cache.manager.allocate(0, context + steps)
    ids = torch.randint(0, CONFIG["vocab_size"], (context + steps,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    model.forward_tokens(ids[:context], BatchMeta.paged_batch(cache, [0], [0], [context]), cache)
    prefill = time.perf_counter() - t0
    timer = StageTimer()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        meta = BatchMeta.paged_batch(cache, [0], [context + i], [1])
        model.compute_logits(model.forward_tokens(ids[context + i:context + i + 1], meta, cache, timer))
    decode, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
    stages = {k: v / steps for k, v in timer.times.items()}
    return {"context": context, "freq": freq, "pattern": model.plan.pattern, "prefill_s": prefill,
            "decode_s_per_token": decode, "decode_cpu_s_per_token": cpu, "decode_stages_s": stages,
            "indexer_share": stages.get("indexer", 0.0) / decode, "index_k_bytes": cache.nbytes()["index_k"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--freqs", default="1,2,4")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    print(f"{'context':>7} {'freq':>4} {'pattern':>7} {'prefill s':>9} {'decode ms':>9} {'cpu ms':>7} {'indexer':>8} "
          f"{'attn':>7} {'compress':>8} {'moe':>7} {'index-K MB':>10}")
    for c in (int(x) for x in a.contexts.split(",")):
        for f in (int(x) for x in a.freqs.split(",")):
            r = run(c, f, a.decode_steps)
            rows.append(r)
            st = r["decode_stages_s"]
            print(f"{c:>7} {f:>4} {r['pattern']:>7} {r['prefill_s']:>9.2f} {1e3 * r['decode_s_per_token']:>9.1f} "
                  f"{1e3 * r['decode_cpu_s_per_token']:>7.1f} "
                  f"{1e3 * st.get('indexer', 0):>8.1f} {1e3 * st.get('attn', 0):>7.1f} {1e3 * st.get('compress', 0):>8.1f} "
                  f"{1e3 * st.get('moe', 0):>7.1f} {r['index_k_bytes'] / 2**20:>10.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
