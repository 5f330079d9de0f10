"""Tensor parallel on CPU (gloo): per-rank resident memory, prefill and decode time at TP 1 and TP 2
side by side, and the bytes each rank communicates per token per layer.

Each layout runs in its own spawned processes (one thread per rank, so TP 2 uses two cores where
TP 1 uses one) on the same random checkpoint, written once to a temporary directory. Prints a
table and writes JSON (``--out``). GPU/NCCL figures need a GPU machine (see docs/performance.md).

    python bench/bench_parallel.py [--hidden 1024 --layers 4 --prompt 512 --decode 16 --dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _config(a) -> dict:
    from indexcache.models.tiny import tiny_config
    return tiny_config(
        vocab_size=4096, hidden_size=a.hidden, intermediate_size=2 * a.hidden, moe_intermediate_size=a.hidden // 2,
        num_hidden_layers=a.layers, num_nextn_predict_layers=0, num_attention_heads=a.heads, q_lora_rank=a.hidden // 2,
        qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, first_k_dense_replace=1, index_n_heads=8, index_topk=256,
        max_position_embeddings=8192, bos_token_id=None, eos_token_id=None)


def _rank(rank, world, tmp, a):
    import torch.distributed as dist

    from indexcache.runtime import generate
    from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init{world}", rank=rank, world_size=world)
    model = DeepseekV32ForCausalLM.from_pretrained(tmp / "ckpt", dtype=a.dtype, tp_size=world if world > 1 else None,
                                                   hf_overrides={"use_index_cache": True, "index_topk_freq": 2})
    prompt = [(7 * i + 3) % 4096 for i in range(a.prompt)]
    generate(model, [prompt[:16]], 2)  # warm-up
    model.par.comm_bytes.clear()
    t0 = time.perf_counter()
    res = generate(model, [prompt], a.decode)
    wall = time.perf_counter() - t0
    out = {"rank": rank, "weight_bytes": model.resident_weight_bytes(),
           "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "prefill_s": res.prefill_seconds, "decode_s": res.decode_seconds, "decode_tokens": res.decode_tokens,
           "wall_s": wall, "tokens": res.tokens[0], "comm_bytes": dict(model.par.comm_bytes),
           "tokens_processed": a.prompt + res.decode_tokens}
    torch.save(out, tmp / f"out{world}_{rank}.pt")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = _config(a)
        DeepseekV32ForCausalLM.from_config(cfg, dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32,
                                           seed=0).save_pretrained(tmp / "ckpt")
        rows = {}
        for tp in a.tp:
            mp.start_processes(_rank, args=(tp, tmp, a), nprocs=tp, join=True, start_method="spawn")
            rows[tp] = [torch.load(tmp / f"out{tp}_{r}.pt") for r in range(tp)]
    base = rows[a.tp[0]][0]
    print(f"model: hidden {a.hidden}, {a.layers} layers, {a.heads} heads, 16 experts; {a.dtype}; prompt {a.prompt}, "
          f"decode {a.decode}; one thread per rank")
    print(f"{'tp':>3} {'weights/rank':>13} {'max RSS/rank':>13} {'prefill s':>10} {'decode s':>9} {'prefill x':>10} "
          f"{'decode x':>9} {'comm B/token/layer':>19} {'same tokens':>12}")
    result = {"args": vars(a), "config": cfg, "layouts": {}}
    for tp, rs in rows.items():
        r0 = rs[0]
        comm = sum(r0["comm_bytes"].values()) / (r0["tokens_processed"] * a.layers)
        same = all(r["tokens"] == base["tokens"] for r in rs)
        print(f"{tp:>3} {max(r['weight_bytes'] for r in rs) / 2**20:>10.1f} MiB "
              f"{max(r['max_rss_bytes'] for r in rs) / 2**20:>9.0f} MiB {r0['prefill_s']:>10.3f} {r0['decode_s']:>9.3f} "
              f"{base['prefill_s'] / r0['prefill_s']:>9.2f}x {base['decode_s'] / r0['decode_s']:>8.2f}x "
              f"{comm:>19.0f} {str(same):>12}")
        result["layouts"][tp] = {"ranks": rs, "comm_bytes_per_token_per_layer": comm, "same_tokens": same}
    print("comm: bytes each rank sends into all-reduces/all-gathers per token (prompt + generated) per layer; "
          "x: speed against the first layout")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
