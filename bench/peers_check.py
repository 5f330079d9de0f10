"""Times indexcache's CUDA ops next to the peers on the issue-12 and issue-25 shapes, in one run (GPU only).

    python bench/peers_check.py --json peers.json     # run (bench/gpu_check.sh stage 6)
    python bench/peers_check.py --print peers.json    # the table

Peers, each timed only when importable: FlashMLA (``flash_mla``, wheel ``sgl-flash-mla``)
sparse decode on the fp8_ds_mla cache and sparse prefill on bf16; DeepGEMM (``deep_gemm``,
wheel ``sgl-deep-gemm``) ``fp8_mqa_logits`` and ``fp8_paged_mqa_logits`` (or their
``fp8_fp4_*`` names in newer releases, /work/shared/ENGINES.md) on the indexer shapes of issue
25 (64 rows x 64 heads x 128K keys; paged decode batches 1 / 8 / 64 x 128K and 32 x 2 (MTP) x
32K), with TFLOP/s; ``torch.topk``. A peer call that fails (an API that
moved, a shape it does not take) is recorded with its error instead of stopping the run.
Never run on a GPU by its author (written without one); expect to fix peer call details.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback


def t_ms(torch, fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def run(path: str) -> None:
    import torch

    import indexcache.ops as ops

    torch.manual_seed(0)
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: list[dict] = []

    def ours(case, fn):
        try:
            return t_ms(torch, fn)
        except Exception as e:
            traceback.print_exc()
            res.append({"case": case, "ours_ms": None, "peer": "-", "error": f"ours: {type(e).__name__}: {e}"[:200]})
            return None

    def peer(case, ours_ms, name, make, flops=None):
        if ours_ms is None:
            return
        rec = {"case": case, "ours_ms": ours_ms, "peer": name}
        if flops is not None:
            rec["flops"] = flops
        try:
            ms = t_ms(torch, make())
            rec.update(peer_ms=ms, ratio=ms / ours_ms)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        res.append(rec)

    try:
        import flash_mla
    except Exception as e:
        flash_mla = None
        print("flash_mla not importable:", e)
    try:
        import deep_gemm
    except Exception as e:
        deep_gemm = None
        print("deep_gemm not importable:", e)

    # Indexer (issue 25): ours beside DeepGEMM's fp8 MQA logits, with TFLOP/s counted as
    # 2 x rows x heads x 128 x keys (the q.k products; ReLU, weights and scales not counted).
    h, s_kv = 64, 128 * 1024

    def idx_flops(rows, keys):
        return 2.0 * rows * h * 128 * keys

    # Both fp8 paths of ours: mma.sync f16 (the default) and the sm_90a warpgroup MMA
    # (INDEXCACHE_WGMMA=1, read at each launch).
    def indexer_cases(tag):
        # Dense prefill: 64 rows x 64 heads x 128K keys, fp8, every row sees every key.
        s_q, h, s_kv = 64, 64, 128 * 1024
        qv, _ = ops.quantize_fp8(torch.randn(s_q, h, 128, device=dev), 1e-4, True)
        kv, ksc = ops.quantize_fp8(torch.randn(s_kv, 128, device=dev), 1e-4, True)
        ksc = ksc[:, 0].contiguous()
        w = torch.randn(s_q, h, device=dev)
        ks = torch.zeros(s_q, dtype=torch.int32, device=dev)
        ke = torch.full((s_q,), s_kv, dtype=torch.int32, device=dev)
        logits = torch.empty(s_q, s_kv, device=dev)
        case = f"indexer 64 x 64h x 128K{tag}"
        fl = idx_flops(s_q, s_kv)
        m = ours(case, lambda: ops.indexer_logits(qv, kv, ksc, w, ks, ke, out=logits))
        if deep_gemm is not None:
            if hasattr(deep_gemm, "fp8_mqa_logits"):
                peer(case, m, "deep_gemm.fp8_mqa_logits", lambda: lambda: deep_gemm.fp8_mqa_logits(qv, (kv, ksc), w, ks, ke),
                     fl)
            else:
                peer(case, m, "deep_gemm.fp8_fp4_mqa_logits",
                     lambda: lambda: deep_gemm.fp8_fp4_mqa_logits(qv, (kv, ksc), w, ks, ke, s_kv), fl)
        elif m is not None:
            res.append({"case": case, "ours_ms": m, "peer": "-", "flops": fl, "error": "deep_gemm not importable"})
        # The fused scoring + top-2048 on the same shape (no peer: DeepGEMM stops at the logits).
        tk = torch.empty(s_q, 2048, dtype=torch.int32, device=dev)
        case = f"indexer+topk2048 64 x 64h x 128K{tag}"
        m = ours(case, lambda: ops.indexer_topk(qv, kv, ksc, w, ks, ke, 2048, out=tk))
        if m is not None:
            res.append({"case": case, "ours_ms": m, "peer": "-", "flops": fl, "error": "no peer (fused top-k)"})

        # Paged decode: batches of requests of 128K keys (32K for the MTP case), block 64 (132 bytes
        # per token: 128 e4m3 values, then the block's fp32 scales).
        bs = 64
        for batch, next_n, keys in ((1, 1, s_kv), (8, 1, s_kv), (64, 1, s_kv), (32, 2, 32 * 1024)):
            per = keys // bs
            num_blocks = batch * per
            cache = torch.randint(0, 120, (num_blocks, bs * 132), dtype=torch.uint8, device=dev)
            table = torch.randperm(num_blocks, device=dev, dtype=torch.int32).reshape(batch, per).contiguous()
            lens = torch.full((batch,), keys, dtype=torch.int32, device=dev)
            rows = batch * next_n
            q1, _ = ops.quantize_fp8(torch.randn(rows, h, 128, device=dev), 1e-4, True)
            w1 = torch.randn(rows, h, device=dev)
            plog = torch.empty(rows, keys, device=dev)
            case = f"paged b{batch} n{next_n} x 64h x {keys // 1024}K{tag}"
            fl = idx_flops(rows, keys)  # causal decode rows see slightly fewer keys; the peer is counted alike
            m = ours(case, lambda: ops.indexer_logits_paged(q1, w1, cache, table, lens, next_n, keys, out=plog))
            if deep_gemm is None:
                if m is not None:
                    res.append({"case": case, "ours_ms": m, "peer": "-", "flops": fl, "error": "deep_gemm not importable"})
                continue

            def dg():
                f = getattr(deep_gemm, "fp8_paged_mqa_logits", None) or deep_gemm.fp8_fp4_paged_mqa_logits
                kc = cache.view(num_blocks, bs, 1, 132)
                qd = q1.view(batch, next_n, h, 128)
                last = None
                for ctx in (lens, lens.view(batch, 1).expand(batch, next_n).contiguous()):  # 1-D, then 2-D context_lens
                    try:
                        meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, bs, sms)
                        call = lambda ctx=ctx, meta=meta: f(qd, kc, w1, ctx, table, meta, keys)  # noqa: E731
                        call()
                        return call
                    except Exception as e:  # the other context_lens layout
                        last = e
                raise last
            peer(case, m, "deep_gemm.fp8_paged_mqa_logits", dg, fl)


    for wg, tag in (("0", " [mma.sync]"), ("1", " [wgmma]")):
        os.environ["INDEXCACHE_WGMMA"] = wg
        indexer_cases(tag)
    os.environ.pop("INDEXCACHE_WGMMA", None)

    # Top-k: 4 x 128K, k 2048.
    x = torch.randn(4, s_kv, device=dev)
    ks4 = torch.zeros(4, dtype=torch.int32, device=dev)
    ke4 = torch.full((4,), s_kv, dtype=torch.int32, device=dev)
    buf = torch.empty(4, 2048, dtype=torch.int32, device=dev)
    case = "topk 4 x 128K, k 2048"
    m = ours(case, lambda: ops.topk_indices(x, ks4, ke4, 2048, out=buf))
    peer(case, m, "torch.topk", lambda: lambda: torch.topk(x, 2048, dim=1))

    # Sparse MLA: decode batch 64 on fp8_ds_mla, prefill 4K rows on bf16; 128 heads, top-k 2048.
    scale = 0.13523  # DESIGN.md §5 (V3.2)
    n_slots = 64 * 1024
    fp8_cache = torch.zeros(n_slots // 64, 64, 656, dtype=torch.uint8, device=dev)
    ops.mla_kv_cache_insert(torch.randn(n_slots, 512, device=dev), torch.randn(n_slots, 64, device=dev),
                            torch.arange(n_slots, device=dev), fp8_cache)
    bf_cache = torch.randn(n_slots, 576, device=dev).bfloat16()
    for case, rows, decode in (("sparse MLA decode b64 fp8_ds_mla", 64, True), ("sparse MLA prefill 4K bf16", 4096, False)):
        q = torch.randn(rows, 128, 576, device=dev).bfloat16()
        idx = torch.randint(0, n_slots, (rows, 2048), dtype=torch.int32, device=dev)
        out = torch.empty(rows, 128, 512, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(rows, 128, device=dev)
        kvc = fp8_cache if decode else bf_cache
        m = ours(case, lambda: ops.sparse_mla(q, kvc, idx, scale, 512, out=out, lse=lse))
        if flash_mla is None:
            continue
        if decode:
            def fm():
                meta = flash_mla.get_mla_metadata()[0]
                return lambda: flash_mla.flash_mla_with_kvcache(
                    q.view(rows, 1, 128, 576), fp8_cache.view(-1, 64, 1, 656), None, None, 512, meta, None, scale,
                    False, True, idx.view(rows, 1, 2048))
            peer(case, m, "flash_mla.flash_mla_with_kvcache", fm)
        else:
            peer(case, m, "flash_mla.flash_mla_sparse_fwd",
                 lambda: lambda: flash_mla.flash_mla_sparse_fwd(q, bf_cache.view(n_slots, 1, 576),
                                                                idx.view(rows, 1, 2048), scale, 512))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    for r in res:
        print(r)


def show(path: str) -> None:
    """peer/ours is the peer's time over ours (> 1: ours is faster); TFLOP/s where the case
    counts its flops (the indexer cases)."""
    with open(path) as f:
        res = json.load(f)

    def tf(r, key):
        ms = r.get(key)
        return f"{r['flops'] / ms / 1e9:.0f}" if "flops" in r and ms else "-"

    print(f"\n{'peer comparison':<34} {'ours ms':>9} {'TFLOP/s':>8}  {'peer':<32} {'peer ms':>9} {'TFLOP/s':>8} "
          f"{'peer/ours':>9}")
    for r in res:
        o = f"{r['ours_ms']:.3f}" if r.get("ours_ms") is not None else "-"
        if "error" in r:
            print(f"{r['case']:<34} {o:>9} {tf(r, 'ours_ms'):>8}  {r['peer']:<32} {'-':>9} {'-':>8} {'':>9}  "
                  f"{r['error'][:90]}")
        else:
            print(f"{r['case']:<34} {o:>9} {tf(r, 'ours_ms'):>8}  {r['peer']:<32} {r['peer_ms']:>9.3f} "
                  f"{tf(r, 'peer_ms'):>8} {r['ratio']:>9.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--json", help="run on the GPU and write the results here")
    g.add_argument("--print", dest="show", help="print the table of a results file")
    a = ap.parse_args()
    if a.json:
        run(a.json)
    else:
        show(a.show)
