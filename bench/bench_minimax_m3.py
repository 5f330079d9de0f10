"""MiniMax-M3 benchmark: prefill and decode per IndexCache freq over the sparse layers.

    python bench/bench_minimax_m3.py [--contexts 4096,8192] [--freqs 1,2,4] [--decode-steps N]
                                     [--dtype bf16|fp32] [--threads N] [--json PATH]

A random model at MiniMax-M3's attention widths (head_dim 128, 4 KV heads = 4 indexer heads of
128, blocks of 128 keys, top 16 blocks: sparse beyond 2048 tokens) with a small hidden size and
8 layers, 6 of them ``minimax_m3_sparse``. For each (context, freq): one prefill of ``context``
tokens through the paged cache, then ``--decode-steps`` single-token steps. Stage times come from
the model's stage ranges: ``indexer`` (the block indexer: projections, RoPE, index-K insert,
scoring and block top-k in one op), ``attn_proj`` (GQA projections, QK-norm, RoPE, K/V insert),
``attention`` (dense or block-sparse attention + o_proj), ``moe`` / ``mlp``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from indexcache.models import BatchMeta, MiniMaxM3ForCausalLM
from indexcache.models.state import StageTimer

SPARSE, FULL = "minimax_m3_sparse", "full_attention"
CONFIG = dict(model_type="minimax_m3_vl_text", vocab_size=1024, hidden_size=512, intermediate_size=256,
              dense_intermediate_size=1024, shared_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=128, rotary_dim=64,
              rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
              num_local_experts=8, num_experts_per_tok=2, index_n_heads=4, index_head_dim=128, index_block_size=128,
              index_topk_blocks=16, index_local_blocks=1, layer_types=[FULL, SPARSE, SPARSE, SPARSE, FULL] + [SPARSE] * 3,
              mlp_layer_types=["dense"] + ["sparse"] * 7, max_position_embeddings=65536, max_num_batched_tokens=32768)


def run_point(context: int, freq: int, decode_steps: int, dtype) -> dict:
    ov = {"use_index_cache": freq > 1, "index_topk_freq": freq} if freq > 1 else None
    model = MiniMaxM3ForCausalLM.from_config(CONFIG, ov, dtype=dtype, seed=0)
    cache = model.allocate_cache(-(-(context + decode_steps) // 64) + 1)
    cache.manager.allocate(0, context + decode_steps)
    ids = torch.randint(0, CONFIG["vocab_size"], (context + decode_steps,), generator=torch.Generator().manual_seed(1))
    timer = StageTimer()
    t0 = time.perf_counter()
    model.forward_tokens(ids[:context], BatchMeta.paged_batch(cache, [0], [0], [context]), cache, timer)
    prefill = time.perf_counter() - t0
    stages = dict(timer.times)
    t0 = time.perf_counter()
    for i in range(decode_steps):
        meta = BatchMeta.paged_batch(cache, [0], [context + i], [1])
        model.forward_tokens(ids[context + i:context + i + 1], meta, cache)
    decode = (time.perf_counter() - t0) / max(decode_steps, 1)
    return {"context": context, "freq": freq, "pattern": model.plan.pattern, "prefill_s": prefill,
            "decode_step_s": decode, "stages_s": stages, "index_k_bytes": cache.nbytes()["index_k"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--freqs", default="1,2,4")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    rows = []
    print("| context | freq | pattern | prefill s | indexer s | attention s | decode step ms | index-K MB |")
    print("|---|---|---|---|---|---|---|---|")
    for context in (int(c) for c in a.contexts.split(",")):
        for freq in (int(f) for f in a.freqs.split(",")):
            r = run_point(context, freq, a.decode_steps, dtype)
            rows.append(r)
            st = r["stages_s"]
            print(f"| {context} | {freq} | {r['pattern']} | {r['prefill_s']:.2f} | {st.get('indexer', 0.0):.2f} | "
                  f"{st.get('attention', 0.0):.2f} | {1e3 * r['decode_step_s']:.1f} | {r['index_k_bytes'] / 2**20:.1f} |",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
