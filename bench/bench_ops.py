"""Op benchmarks: ours vs the reference.py path vs torch built-ins, side by side in one run.

    python bench/bench_ops.py [--quick] [--device cpu|cuda] [--json PATH] [--threads N]
                              [--isa auto|portable|avx2|avx512bf16|blas[,...]] [--repeat N] [--sinks]

Prints one table and, with --json, a list of records
{"op", "shape", "s_kv", "impl", "ms", "ms_min", "ms_max", "baseline", "baseline_ms", "speedup",
 "isa_path", "cpu_model", "cpu_flags", "fp32_matmul_gflop_per_s", "bf16_matmul_gflop_per_s",
 "matmul_gflop_per_s", "matmul_dtype", "matmul_fraction", ...}.
The machine's ceiling is torch.mm's rate in fp32 and in bf16 (same threads, measured at the start
and at the end of the run, the better of the two kept); "matmul_fraction" is an op's GFLOP/s as a
share of the better of the two dtypes ("matmul_dtype"): bf16 on AVX-512 BF16 and AMX CPUs, fp32 on
AVX2-only CPUs, where torch has no fast bf16 matmul (there the bf16 baselines, which would take
minutes, are skipped and sparse MLA's reference runs in fp32).
With several --isa values each op runs on every CPU path in turn, interleaved and repeated
(--repeat), so the paths compare under the same machine load; "ms" is the median of the
repeats, "ms_min"/"ms_max" their spread.
Shapes are DeepSeek-V3.2's (64 indexer heads x 128, k 2048; 128 MLA heads, 576/512),
with the number of query rows scaled to fit; the block_sparse group is MiniMax-M3's (4 indexer
heads x 128, blocks of 128, top 16; attention 64 query / 4 KV heads x 128); the delta_rule group is
the hybrids' linear attention (KDA 32 heads, Gated DeltaNet 16/32 heads, 128 x 128 state; prefill
4K tokens vs transformers' chunk form, decode 64 sequences vs its recurrent form).
--sinks adds sparse MLA with attention sinks (fp32 [h_q], HY-V4) as impl "indexcache+sinks",
timed interleaved with the sink-free call on each path (same inputs, same repeats); its
"baseline" is the sink-free median, so "speedup" near 1.0 means the sinks cost nothing.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import indexcache._C as _C
from indexcache import ops
from indexcache import reference as ref


CLOCK = time.perf_counter  # --cpu-time: time.process_time (CPU seconds of all our threads)


def timeit(fn, device, min_time=0.3, max_iters=50):
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    start = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - start < min_time or len(times) < 3):
        t0 = CLOCK()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(CLOCK() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]  # median, ms


ISAS = ["auto"]   # CPU paths to run ours on (--isa)
BF16_FAST = True  # torch's bf16 matmul is at least a quarter of its fp32 rate here (else bf16 baselines are skipped)
REPEAT = 1        # interleaved repeats per path (--repeat)
SINKS = False     # --sinks: sparse MLA also with attention sinks, interleaved with the sink-free call


def time_ours(fn, device, op="", dtype="", **kw):
    """Times fn on every path in ISAS, interleaved REPEAT times: {isa: (median, min, max, path)};
    path is the one the op's kernels took for inputs of dtype (_C._cpu_isa(op, dtype), whatever
    the call's heads), or the request with no op."""
    return {isa: t for (isa, _), t in time_variants({"": fn}, device, op, dtype, **kw).items()}


def time_variants(fns, device, op="", dtype="", **kw):
    """Like time_ours for several functions {name: fn}, interleaved within each repeat and path
    (so they meet the same machine load): {(isa, name): (median, min, max, path)}."""
    runs = {(isa, name): [] for isa in ISAS for name in fns}
    paths = {}
    for _ in range(REPEAT):
        for isa in ISAS:
            if device == "cpu":
                _C._set_cpu_isa(isa)
                paths[isa] = _C._cpu_isa(op, dtype)
            try:
                for name, fn in fns.items():
                    runs[(isa, name)].append(timeit(fn, device, **kw))
            finally:
                _C._set_cpu_isa("auto")
    out = {}
    for (isa, name), t in runs.items():
        t = sorted(t)
        out[(isa, name)] = (t[len(t) // 2], t[0], t[-1], paths.get(isa, device))
    return out


def record(records, op, shape, s_kv, impl, ms, baseline, baseline_ms, **extra):
    if isinstance(ms, tuple):
        ms, lo, hi, path = ms
        extra = {"ms_min": lo, "ms_max": hi, "isa_path": path, **extra}
    records.append({"op": op, "shape": shape, "s_kv": int(s_kv), "impl": impl, "ms": ms, "baseline": baseline,
                    "baseline_ms": baseline_ms, "speedup": baseline_ms / ms, **extra})


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def matmul_gflops(device, dtype, n=2048):
    """torch.mm's rate for an n x n x n product (GFLOP/s). A dtype the CPU has no fast kernel for
    (bf16 on AVX2-only CPUs runs at ~1 GFLOP/s) is measured at n=512 only, to keep the run short."""
    def rate(m, **kw):
        a = torch.randn(m, m, device=device, dtype=dtype)
        b = torch.randn(m, m, device=device, dtype=dtype)
        return 2 * m**3 / (timeit(lambda: torch.mm(a, b), device, **kw) * 1e-3) / 1e9

    small = rate(512, min_time=0.1, max_iters=5)
    return rate(n) if small > 20 else small


class Ceiling:
    """The machine's matmul rates in fp32 and bf16, kept as the best of every measurement."""

    def __init__(self, device):
        self.device = device
        self.rates = {"fp32": 0.0, "bf16": 0.0}

    def measure(self):
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            self.rates[name] = max(self.rates[name], matmul_gflops(self.device, dt))

    @property
    def dtype(self):
        return max(self.rates, key=self.rates.get)

    @property
    def best(self):
        return self.rates[self.dtype]

    def share(self, gflops):
        return {"matmul_fraction": gflops / self.best}


def indexer_inputs(s_q, s_kv, h, device):
    q = torch.randn(s_q, h, 128, device=device)
    k = torch.randn(s_kv, 128, device=device)
    w = torch.randn(s_q, h, device=device)
    qv, qs = ops.quantize_fp8(q, ref.INDEX_Q_EPS)
    kv, ksc = ops.quantize_fp8(k, ref.INDEX_K_EPS)
    ks = torch.zeros(s_q, dtype=torch.int32, device=device)
    ke = torch.full((s_q,), s_kv, dtype=torch.int32, device=device)
    return q, k, w, qv, kv, ksc[:, 0].contiguous(), ref.indexer_weights(w, qs[..., 0]), ks, ke


def reference_bf16_logits(q, k, w):
    # The reference formula run through bf16 matmuls (same FLOPs as ours, torch's GEMM).
    dots = torch.matmul(q.bfloat16().reshape(-1, 128), k.bfloat16().t()).reshape(q.shape[0], q.shape[1], -1)
    return (dots.float().relu() * w.unsqueeze(-1)).sum(1)


def bench_topk(records, device, quick):
    rows, topk = 64, 2048
    for s_kv in (4096, 32768, 131072):
        logits = torch.randn(rows, s_kv, device=device)
        ks = torch.zeros(rows, dtype=torch.int32, device=device)
        ke = torch.full((rows,), s_kv, dtype=torch.int32, device=device)
        out = torch.empty(rows, topk, dtype=torch.int32, device=device)
        ours = time_ours(lambda: ops.topk_indices(logits, ks, ke, topk, out=out), device)
        base = timeit(lambda: torch.topk(logits, topk, dim=1), device)
        for t in ours.values():
            gbs = rows * s_kv * 4 / (t[0] * 1e-3) / 1e9
            record(records, "topk", f"{rows}x{s_kv} k{topk}", s_kv, "indexcache", t, "torch.topk", base, gb_per_s=gbs)


def bench_indexer(records, device, quick):
    s_q, h, topk = 64, 64, 2048
    for s_kv in ([4096, 32768] if quick else [4096, 32768, 65536]):
        q, k, w, qv, kv, ksc, wq, ks, ke = indexer_inputs(s_q, s_kv, h, device)
        flops = 2 * s_q * h * s_kv * 128
        shape = f"{s_q}q x {h}h x {s_kv}"
        out = torch.empty(s_q, s_kv, device=device)
        ours = time_ours(lambda: ops.indexer_logits(qv, kv, ksc, wq, ks, ke, out=out), device, min_time=0.5,
                         max_iters=10)
        wf = ref.indexer_weights(w)
        ref32 = timeit(lambda: ref.indexer_logits(q, k, None, wf, ks, ke), device, min_time=0.1, max_iters=3)
        bases = [("reference_fp32", ref32)]
        if BF16_FAST:
            bases.append(("reference_bf16", timeit(lambda: reference_bf16_logits(q, k, wf), device, min_time=0.1,
                                                   max_iters=3)))
        for t in ours.values():
            gf = flops / (t[0] * 1e-3) / 1e9
            for name, b in bases:
                record(records, "indexer_logits", shape, s_kv, "indexcache_fp8", t, name, b, gflop_per_s=gf)
        buf = torch.empty(s_q, topk, dtype=torch.int32, device=device)
        fused = time_ours(lambda: ops.indexer_topk(qv, kv, ksc, wq, ks, ke, topk, out=buf), device, min_time=0.5,
                          max_iters=10)
        b32 = timeit(lambda: torch.topk(ref.indexer_logits(q, k, None, wf, ks, ke), topk, dim=1), device, min_time=0.1, max_iters=3)
        bases = [("reference_fp32", b32)]
        if BF16_FAST:
            bases.append(("reference_bf16", timeit(lambda: torch.topk(reference_bf16_logits(q, k, wf), topk, dim=1),
                                                   device, min_time=0.1, max_iters=3)))
        for t in fused.values():
            gf = flops / (t[0] * 1e-3) / 1e9
            for name, b in bases:
                record(records, "fused_logits_topk", shape, s_kv, "indexcache_fp8", t, name, b, gflop_per_s=gf,
                       logits_bytes_avoided=s_q * s_kv * 4)


def reference_bf16_mla(q, cache, idx, scale):
    """The gather + softmax reference through torch's matmuls, in bf16 (fp32 where BF16_FAST is
    off: on AVX2-only CPUs torch's bf16 matmul runs at ~1 GFLOP/s, so fp32 is torch's best)."""
    if not BF16_FAST:
        q, cache = q.float(), cache.float()
    kv = cache.reshape(-1, 576)
    valid = idx >= 0
    g = kv[idx.clamp(min=0).long()]  # [s_q, k, 576] bf16
    s = torch.matmul(q, g.transpose(1, 2)).float() * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, g[..., :512])


def bench_mla(records, device, quick):
    h, topk, bs = 128, 2048, 64
    cases = [("sparse_mla_decode", 16 if quick else 64), ("sparse_mla_prefill", 32 if quick else 128)]
    for op, s_q in cases:
        s_kv = 8192 if op == "sparse_mla_decode" else 4096
        blocks = s_kv // bs
        cache = torch.randn(blocks, bs, 576, device=device).bfloat16()
        q = torch.randn(s_q, h, 576, device=device).bfloat16()
        if op == "sparse_mla_decode":
            idx = torch.stack([torch.randperm(s_kv)[:topk] for _ in range(s_q)]).int().to(device)
        else:  # causal prefill rows over the last s_q positions, short windows padded with -1
            idx = torch.full((s_q, topk), -1, dtype=torch.int32)
            for t in range(s_q):
                n = min(topk, s_kv - s_q + t + 1)
                idx[t, :n] = torch.randperm(s_kv - s_q + t + 1)[:n].int()
            idx = idx.to(device)
        scale = ref.mla_softmax_scale(128, 64, 1.0, 40.0)
        out = torch.empty(s_q, h, 512, device=device, dtype=torch.bfloat16)
        lse = torch.empty(s_q, h, device=device)
        fns = {"indexcache": lambda: ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse)}
        if SINKS:
            sinks = torch.randn(h, device=device) * 3
            fns["indexcache+sinks"] = lambda: ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse, sinks=sinks)
        ours = time_variants(fns, device, op="sparse_mla", min_time=0.5, max_iters=10)
        base = timeit(lambda: reference_bf16_mla(q, cache, idx, scale), device, min_time=0.3, max_iters=5)
        base_name = "reference_bf16" if BF16_FAST else "reference_fp32"
        n_valid = int((idx >= 0).sum())
        flops = 2 * h * n_valid * (576 + 512)
        for (isa, name), t in ours.items():
            gf = flops / (t[0] * 1e-3) / 1e9
            if name == "indexcache":
                record(records, op, f"{s_q}q x {h}h x k{topk} bf16", s_kv, name, t, base_name, base, gflop_per_s=gf)
            else:  # against the sink-free call of the same path and repeats: ~1.0x when sinks are free
                record(records, op, f"{s_q}q x {h}h x k{topk} bf16", s_kv, name, t, "no sinks",
                       ours[(isa, "indexcache")][0], gflop_per_s=gf)


def bench_mla_v4(records, device, quick):
    """DeepSeek-V4-Flash attention through sparse_mla: d_qk 512 (K = V), 512 selected compressed
    entries + a 128-entry sliding window (extra_indices), 64 heads, sinks; decode rows."""
    h, topk, window, bs, s_q, s_kv = 64, 512, 128, 64, 8 if quick else 32, 16384
    cache = torch.randn(s_kv // bs, bs, 1, 512, device=device).bfloat16()
    q = torch.randn(s_q, h, 512, device=device).bfloat16()
    idx = torch.stack([torch.randperm(s_kv - window)[:topk] for _ in range(s_q)]).int().to(device)
    win = (s_kv - window + torch.arange(window)).int().expand(s_q, window).contiguous().to(device)
    sinks, scale = torch.randn(h, device=device) * 3, 512 ** -0.5
    out, lse = torch.empty(s_q, h, 512, device=device, dtype=torch.bfloat16), torch.empty(s_q, h, device=device)
    fns = {"indexcache": lambda: ops.sparse_mla(q, cache, idx, scale, out=out, lse=lse, sinks=sinks, extra_indices=win)}
    ours = time_variants(fns, device, op="sparse_mla", min_time=0.5, max_iters=10)

    def reference():  # gather window + selected rows, softmax with the sink as one more logit
        qq, kv = (q, cache.reshape(-1, 512)) if BF16_FAST else (q.float(), cache.reshape(-1, 512).float())
        g = kv[torch.cat((idx, win), 1).long()]
        s = torch.matmul(qq, g.transpose(1, 2)).float() * scale
        s = torch.cat((s, sinks.view(1, h, 1).expand(s_q, h, 1)), -1)
        return torch.matmul(torch.softmax(s, -1)[..., :-1].to(qq.dtype), g)

    base = timeit(reference, device, min_time=0.3, max_iters=5)
    flops = 2 * h * s_q * (topk + window) * (512 + 512)
    for (isa, name), t in ours.items():
        record(records, "sparse_mla_v4_decode", f"{s_q}q x {h}h x k{topk}+w{window}", s_kv, name, t,
               "reference_bf16" if BF16_FAST else "reference_fp32", base, gflop_per_s=flops / (t[0] * 1e-3) / 1e9)


def bench_k_cache(records, device, quick):
    n, bs = (8192 if quick else 32768), 64
    k = torch.randn(n, 128, device=device)
    slots = torch.randperm(n, device=device)
    cache = torch.zeros(n // bs, bs * 132, dtype=torch.uint8, device=device)

    def reference():
        v, s = ref.quantize_fp8(k, ref.INDEX_K_EPS)
        blk, off = slots // bs, slots % bs
        cache[:, : bs * 128].view(-1, bs, 128)[blk, off] = v.view(torch.uint8)
        cache[:, bs * 128:].view(-1, bs, 4)[blk, off] = s.view(torch.uint8).reshape(-1, 4)

    ours = time_ours(lambda: ops.index_k_cache_insert(k, slots, cache), device)
    base = timeit(reference, device)
    for t in ours.values():
        gbs = n * (128 * 4 + 132) / (t[0] * 1e-3) / 1e9
        record(records, "k_quant_cache", f"{n} tokens x 128", n, "indexcache", t, "reference_fp32", base, gb_per_s=gbs)


def dense_block_topk(q, k, n_ctx, block_size, topk, local):
    """transformers' way for one request's last rows: all [s_q, h, s_kv] scores, mask, amax, topk."""
    s_q = q.shape[0]
    pos = torch.arange(n_ctx - s_q, n_ctx, device=q.device)
    sc = torch.einsum("thd,sd->hts", q, k)
    sc = sc.masked_fill(torch.arange(n_ctx, device=q.device).view(1, 1, -1) > pos.view(1, -1, 1), float("-inf"))
    bs = sc.view(q.shape[1], s_q, -1, block_size).amax(-1)
    for j in range(local):
        bs.scatter_(-1, (pos // block_size - j).clamp(min=0).view(1, -1, 1).expand(q.shape[1], -1, 1), float("inf"))
    return bs.topk(topk, dim=-1)


def gather_block_attention(q, kc, vc, table, pos, blocks, block_size, scale):
    """Gather the selected blocks' keys per (row, KV head), then matmul + masked softmax (one request)."""
    s_q, h_q, d = q.shape
    h_kv, g = kc.shape[2], h_q // kc.shape[2]
    keys_pos = (blocks.long().unsqueeze(-1) * block_size + torch.arange(block_size)).flatten(2)  # [s_q, h_kv, n]
    ok = (blocks.long().unsqueeze(-1) >= 0).expand(-1, -1, -1, block_size).flatten(2) & (keys_pos <= pos.view(-1, 1, 1))
    kp = keys_pos.clamp(min=0)
    slot = table[0, kp // kc.shape[1]].long() * kc.shape[1] + kp % kc.shape[1]
    heads = torch.arange(h_kv).view(1, -1, 1)
    kk = kc.reshape(-1, h_kv, d)[slot, heads]  # [s_q, h_kv, n, d]
    vv = vc.reshape(-1, h_kv, d)[slot, heads]
    s = torch.matmul(q.view(s_q, h_kv, g, d), kk.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~ok.unsqueeze(2), float("-inf")), dim=-1)
    return torch.matmul(p, vv).reshape(s_q, h_q, d)


def bench_block_sparse(records, device, quick):
    """MiniMax-M3's ops at its shapes: 4 indexer heads x 128, blocks of 128, top 16 blocks, 1 local;
    attention 64 query heads over 4 KV heads x 128, fp32."""
    h, d, bsz, topk = 4, 128, 128, 16
    s_q = 64
    for n_ctx in ([8192, 32768] if quick else [8192, 32768, 131072]):
        q = torch.randn(s_q, h, d, device=device)
        k = torch.randn(n_ctx, d, device=device)
        ks = torch.zeros(s_q, dtype=torch.int32, device=device)
        ke = torch.arange(n_ctx - s_q + 1, n_ctx + 1, dtype=torch.int32, device=device)
        out = torch.empty(s_q, h, topk, dtype=torch.int32, device=device)
        ours = time_ours(lambda: ops.block_topk(q, k, ks, ke, bsz, topk, 1, out=out), device, min_time=0.3, max_iters=10)
        base = timeit(lambda: dense_block_topk(q, k, n_ctx, bsz, topk, 1), device, min_time=0.1, max_iters=3)
        flops = 2 * h * d * int((ke - ks).sum())
        for t in ours.values():
            record(records, "block_topk", f"{s_q}q x {h}h x {n_ctx} fp32", n_ctx, "indexcache", t, "torch_dense", base,
                   gflop_per_s=flops / (t[0] * 1e-3) / 1e9, scores_bytes_avoided=s_q * h * n_ctx * 4)
    h_q, h_kv, page = 64, 4, 64
    for op, rows, n_ctx in (("block_attn_decode", 1, 32768), ("block_attn_prefill", 64, 32768)):
        reqs = 16 if op == "block_attn_decode" else 1
        kc = torch.randn(reqs * n_ctx // page, page, h_kv, d, device=device)
        vc = torch.randn_like(kc)
        table = torch.randperm(kc.shape[0], device=device).int().view(reqs, -1)
        req = torch.arange(reqs, dtype=torch.int32, device=device).repeat_interleave(rows)
        pos = torch.arange(n_ctx - rows, n_ctx, dtype=torch.int32, device=device).repeat(reqs)
        qa = torch.randn(reqs * rows, h_q, d, device=device)
        nb = n_ctx // bsz
        blocks = torch.stack([torch.randperm(nb - 1)[:topk - 1] for _ in range(reqs * rows * h_kv)]).int()
        blocks = torch.cat([blocks, torch.full((blocks.shape[0], 1), nb - 1, dtype=torch.int32)], 1)
        blocks = blocks.view(reqs * rows, h_kv, topk).to(device)
        res = (torch.empty_like(qa), torch.empty(qa.shape[0], h_q, device=device))
        ours = time_ours(lambda: ops.block_sparse_attention(qa, kc, vc, table, req, pos, blocks, bsz, d ** -0.5, out=res),
                         device, min_time=0.3, max_iters=10)
        if reqs == 1:
            base = timeit(lambda: gather_block_attention(qa, kc, vc, table, pos, blocks, bsz, d ** -0.5), device,
                          min_time=0.1, max_iters=3)
            base_name = "torch_gather"
        else:
            base = timeit(lambda: ref.block_sparse_attention(qa, kc, vc, table, req, pos, blocks, bsz, d ** -0.5),
                          device, min_time=0.1, max_iters=3)
            base_name = "reference"
        keys = topk * bsz  # every selected block is whole (the query's own block is the last one, full)
        flops = 2 * 2 * qa.shape[0] * h_q * keys * d
        for t in ours.values():
            record(records, op, f"{reqs * rows}q x {h_q}/{h_kv}h x {topk}blk fp32", n_ctx, "indexcache", t, base_name,
                   base, gflop_per_s=flops / (t[0] * 1e-3) / 1e9)


def delta_rule_inputs(T, h_k, h_v, d, per_channel, batch, device, dtype=torch.bfloat16):
    """Normalised q, k as the models feed them, log-decays in [-0.1, 0), one sequence per slot."""
    q = torch.nn.functional.normalize(torch.randn(T, h_k, d, device=device), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(T, h_k, d, device=device), dim=-1).to(dtype)
    v = torch.randn(T, h_v, d, device=device).to(dtype)
    g = -torch.rand((T, h_v, d) if per_channel else (T, h_v), device=device) * 0.1
    beta = torch.rand(T, h_v, device=device)
    state = torch.randn(batch, h_v, d, d, device=device) * 0.1
    cu = torch.linspace(0, T, batch + 1, device=device).round().to(torch.int32)
    si = torch.arange(batch, dtype=torch.int32, device=device)
    return q, k, v, g, beta, state, cu, si


def bench_delta_rule(records, device, quick):
    """The hybrids' linear attention (issue 34), bf16 q/k/v, d_k = d_v = 128: KDA (GLM-5.3-Flash,
    per-channel gate, 32 heads) and Gated DeltaNet (Qwen3.8-Flash-Next, per-head gate, 16 query/key
    and 32 value heads). Prefill: one sequence of 4K tokens (2K with --quick) against transformers'
    chunk form (chunk_kimi_delta_attention / torch_chunk_gated_delta_rule, fp32 torch ops: its
    reference path without flash-linear-attention), GFLOP/s counted as the chunk form's work,
    T h_v (6 d_k d_v + 2 C (d_k + d_v)) with C = 64. Decode: 64 sequences x 1 token against
    transformers' recurrent form, rated by the state bytes read and written (2 x 4 d_k d_v per
    sequence and head)."""
    try:
        from transformers.models.glm5_next import modeling_glm5_next as kda_mod
        from transformers.models.qwen4_exp import modeling_qwen4_exp as gdn_mod
    except ImportError:  # pragma: no cover - transformers is in the dev requirements
        kda_mod = gdn_mod = None
    d, C = 128, 64
    T = 2048 if quick else 4096
    for name, per_channel, h_k, h_v in (("kda", True, 32, 32), ("gdn", False, 16, 32)):
        q, k, v, g, beta, state, cu, si = delta_rule_inputs(T, h_k, h_v, d, per_channel, 1, device)
        ours = time_ours(lambda: ops.delta_rule(q, k, v, g, beta, state, cu, si, d ** -0.5), device, "delta_rule",
                         "bf16", min_time=0.3, max_iters=5)
        base, base_name = float("nan"), "transformers_chunk"
        if kda_mod is not None:
            fn = kda_mod.chunk_kimi_delta_attention if per_channel else gdn_mod.torch_chunk_gated_delta_rule
            init = state.clone()
            # One timed call, no warm-up: the KDA form builds a [chunks, 64, 64, d_k] decay tensor
            # (2 GB at 4K tokens x 32 heads) and takes a minute or more on 2 cores.
            t0 = time.perf_counter()
            fn(q[None], k[None], v[None], g[None], beta[None], initial_state=init, output_final_state=True)
            if device == "cuda":
                torch.cuda.synchronize()
            base = 1e3 * (time.perf_counter() - t0)
        flops = T * h_v * (6 * d * d + 2 * C * 2 * d)
        for t in ours.values():
            record(records, f"delta_rule_prefill_{name}", f"{T}t x {h_k}/{h_v}h x {d} bf16", T, "indexcache", t,
                   base_name, base, gflop_per_s=flops / (t[0] * 1e-3) / 1e9)
        B = 64
        q, k, v, g, beta, state, cu, si = delta_rule_inputs(B, h_k, h_v, d, per_channel, B, device)
        ours = time_ours(lambda: ops.delta_rule(q, k, v, g, beta, state, cu, si, d ** -0.5), device, "delta_rule",
                         "bf16", min_time=0.3, max_iters=20)
        base, base_name = float("nan"), "transformers_recurrent"
        if kda_mod is not None:
            init = state.clone()
            if per_channel:
                fn = lambda: kda_mod.recurrent_kimi_delta_attention(q[:, None], k[:, None], v[:, None], g[:, None],
                                                                    beta[:, None], init, True)
            else:
                fn = lambda: gdn_mod.torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                                      beta[:, None], initial_state=init,
                                                                      output_final_state=True)
            base = timeit(fn, device, min_time=0.2, max_iters=10)
        state_bytes = 2 * B * h_v * d * d * 4
        for t in ours.values():
            record(records, f"delta_rule_decode_{name}", f"{B} seqs x 1t x {h_k}/{h_v}h x {d} bf16", 1, "indexcache",
                   t, base_name, base, gb_per_s=state_bytes / (t[0] * 1e-3) / 1e9)


# --ops matrix: op x dtype x heads x path (issue 31), one thread's share of the machine.
MATRIX_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matrix_record(records, op, dtype, heads, shape, flops, ours, fp32_rate):
    """One record per requested path; baseline: auto's median, 'auto_path' what auto took."""
    auto = ours.get("auto")
    for isa, t in ours.items():
        gf = flops / (t[0] * 1e-3) / 1e9
        record(records, op, f"{shape} {dtype} {heads}h", 0, f"request={isa}", t, "auto",
               auto[0] if auto else t[0], gflop_per_s=gf, dtype=dtype, heads=heads, request=isa,
               auto_path=auto[3] if auto else "", fp32_matmul_fraction=gf / fp32_rate if fp32_rate else 0.0)


def mla_selection(rows, n, topk, how):
    """[rows, topk] slots of an n-slot cache: 'random' (rows share ~topk/n of their keys) or
    'request' (the rows of one request, as an indexer picks them: each keeps 7/8 of a common
    top-k and draws the rest at random)."""
    if how == "random":
        return torch.randint(0, n, (rows, topk), dtype=torch.int32)
    idx = torch.randperm(n)[:topk].int().repeat(rows, 1)
    own = torch.rand(rows, topk).argsort(dim=1)[:, : topk // 8]
    idx.scatter_(1, own, torch.randint(0, n, (rows, topk // 8), dtype=torch.int32))
    return idx


def matrix_sparse_mla(records, device, rows, fp32_rate, select="random"):
    n = 8192
    for dtype, dt in MATRIX_DTYPES.items():
        for h in (8, 16, 128):
            cache = torch.randn(n, 1, 576).to(dt)
            q = torch.randn(rows, h, 576).to(dt)
            idx = mla_selection(rows, n, 512, select)
            out, lse = torch.empty(rows, h, 512, dtype=dt), torch.empty(rows, h)
            ours = time_ours(lambda: ops.sparse_mla(q, cache, idx, 0.1, out=out, lse=lse), device, "sparse_mla", dtype,
                             min_time=0.3, max_iters=5)
            shape = f"{rows}q k512" + ("" if select == "random" else f" {select}")
            matrix_record(records, "sparse_mla", dtype, h, shape, 2 * rows * h * 512 * 1088, ours, fp32_rate)


def matrix_indexer(records, device, rows, fp32_rate, select=None):
    n = 8192
    for dtype in ("fp32", "bf16", "fp8"):
        for h in (8, 16, 64):
            q, k, w, qv, kv, ksc, wq, ks, ke = indexer_inputs(rows, n, h, device)
            args = (qv, kv, ksc, wq) if dtype == "fp8" else (q.to(MATRIX_DTYPES[dtype]), k.to(MATRIX_DTYPES[dtype]),
                                                              None, ref.indexer_weights(w))
            buf = torch.empty(rows, 2048, dtype=torch.int32)
            ours = time_ours(lambda: ops.indexer_topk(*args, ks, ke, 2048, out=buf), device, "indexer", dtype,
                             min_time=0.3, max_iters=5)
            matrix_record(records, "indexer_topk", dtype, h, f"{rows}q x {n}", 2 * rows * h * n * 128, ours, fp32_rate)


def matrix_block_sparse(records, device, rows, fp32_rate, select=None):
    h_kv, bsz, topk, page, n_ctx = 4, 128, 16, 64, 8192
    for dtype, dt in MATRIX_DTYPES.items():
        for h_q in (8, 16, 64):
            kc = torch.randn(n_ctx // page, page, h_kv, 128).to(dt)
            vc = torch.randn_like(kc)
            table = torch.randperm(kc.shape[0]).int().view(1, -1)
            req, pos = torch.zeros(rows, dtype=torch.int32), torch.arange(n_ctx - rows, n_ctx, dtype=torch.int32)
            qa = torch.randn(rows, h_q, 128).to(dt)
            nb = n_ctx // bsz
            blocks = torch.stack([torch.randperm(nb - 1)[:topk] for _ in range(rows * h_kv)]).int().view(rows, h_kv, topk)
            res = (torch.empty_like(qa), torch.empty(rows, h_q))
            ours = time_ours(lambda: ops.block_sparse_attention(qa, kc, vc, table, req, pos, blocks, bsz, 0.088, out=res),
                             device, "block_sparse_attention", dtype, min_time=0.3, max_iters=5)
            matrix_record(records, "block_sparse_attention", dtype, h_q, f"{rows}q /{h_kv}kv x{topk}blk",
                          2 * 2 * rows * h_q * topk * bsz * 128, ours, fp32_rate)


# --matrix-ops names -> their part of the matrix.
MATRIX_OPS = {"sparse_mla": matrix_sparse_mla, "indexer_topk": matrix_indexer,
              "block_sparse_attention": matrix_block_sparse}


def bench_matrix(records, device, quick, fp32_rate, which=tuple(MATRIX_OPS), mla_select="random", rows=None):
    """sparse_mla (64 rows x top-512 of 8192, 576/512), indexer_topk (64 rows x 8192 keys, top-2048)
    and block_sparse_attention (64 rows, 4 KV heads x 128, 16 blocks of 128) in fp32 and bf16 (the
    indexer also fp8), at 8, 16 and 128 (indexer 64, block-sparse 64 query) heads, on every path;
    which: the ops to run (MATRIX_OPS keys); mla_select: sparse_mla's key selection (mla_selection);
    rows: query rows per call (default 64, 16 with quick; 1 is a decode row's shape)."""
    unknown = [w for w in which if w not in MATRIX_OPS]
    if unknown:
        raise ValueError(f"--matrix-ops: unknown {unknown}; choose from {sorted(MATRIX_OPS)}")
    for name in which:
        MATRIX_OPS[name](records, device, rows or (16 if quick else 64), fp32_rate, mla_select)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller shapes; under 5 minutes on 2 CPU cores")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--isa", default="auto",
                    help="CPU path(s) for our ops, comma-separated: auto, portable, avx2, avx512bf16, blas")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved repeats per path (median, min, max)")
    ap.add_argument("--ops", default="topk,k_cache,indexer,mla,block_sparse,mla_v4,delta_rule",
                    help="which groups to run; 'matrix' (CPU only, not in the default): op x dtype x heads "
                         "{8, 16, 64/128} on every --isa path, with the path each took and auto's")
    ap.add_argument("--matrix-ops", default=",".join(MATRIX_OPS),
                    help="with --ops matrix: which ops' rows to run, comma-separated")
    ap.add_argument("--matrix-rows", type=int, default=None,
                    help="with --ops matrix: query rows per call (default 64, 16 with --quick; 1: a decode row)")
    ap.add_argument("--mla-select", default="random", choices=["random", "request"],
                    help="the matrix's sparse_mla key selection: random rows, or the rows of one request "
                         "sharing 7/8 of their keys as an indexer's picks do")
    ap.add_argument("--sinks", action="store_true",
                    help="sparse MLA also with attention sinks, interleaved with the sink-free call")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time CPU seconds of the process (all threads) instead of wall time: on a machine "
                         "shared with other work this compares paths' cost more steadily; it counts idle "
                         "OpenMP spinning, so it overstates ops that leave threads waiting")
    args = ap.parse_args()
    if args.matrix_rows is not None and args.matrix_rows < 1:
        ap.error(f"--matrix-rows must be at least 1, got {args.matrix_rows}")
    global ISAS, REPEAT, CLOCK, BF16_FAST, SINKS
    SINKS = args.sinks
    if args.cpu_time:
        CLOCK = time.process_time
    ISAS = [s.strip() for s in args.isa.split(",") if s.strip()] if args.device == "cpu" else ["auto"]
    REPEAT = max(1, args.repeat)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    records: list = []
    ceiling = Ceiling(args.device)
    ceiling.measure()
    BF16_FAST = ceiling.rates["bf16"] >= 0.25 * ceiling.rates["fp32"]
    model, flags = cpu_model(), cpu_flags()
    isa_flags = sorted(f for f in flags if f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16"))
    print(f"device {args.device}, {torch.get_num_threads()} threads; CPU {model} ({' '.join(isa_flags)}); "
          f"torch.mm fp32 {ceiling.rates['fp32']:.0f}, bf16 {ceiling.rates['bf16']:.1f} GFLOP/s")
    groups = set(args.ops.split(","))
    if "topk" in groups:
        bench_topk(records, args.device, args.quick)
    if "k_cache" in groups:
        bench_k_cache(records, args.device, args.quick)
    if "indexer" in groups:
        bench_indexer(records, args.device, args.quick)
    if "mla" in groups:
        bench_mla(records, args.device, args.quick)
    if "block_sparse" in groups:
        bench_block_sparse(records, args.device, args.quick)
    if "mla_v4" in groups:
        bench_mla_v4(records, args.device, args.quick)
    if "delta_rule" in groups:
        bench_delta_rule(records, args.device, args.quick)
    if "matrix" in groups and args.device == "cpu":
        bench_matrix(records, args.device, args.quick, ceiling.rates["fp32"],
                     [s.strip() for s in args.matrix_ops.split(",") if s.strip()], args.mla_select, args.matrix_rows)
    if any("gflop_per_s" in r for r in records):
        ceiling.measure()  # again at the end: the better of the two measurements is the ceiling
    for r in records:
        if "gflop_per_s" in r:
            r["matmul_fraction"] = r["gflop_per_s"] / ceiling.best
        if "fp32_matmul_fraction" in r:
            r["fp32_matmul_fraction"] = r["gflop_per_s"] / ceiling.rates["fp32"]
    print(f"matmul ceiling: fp32 {ceiling.rates['fp32']:.0f}, bf16 {ceiling.rates['bf16']:.1f} GFLOP/s "
          f"(torch.mm, best of start and end); shares below are of the {ceiling.dtype} rate")
    head = (f"{'op':<24} {'shape':<26} {'path':<11} {'ms':>9} {'min-max':>17} {'baseline':<15} {'base ms':>9} "
            f"{'speedup':>8}  rate")
    print(head)
    print("-" * len(head))
    for r in records:
        rate = ""
        if "gflop_per_s" in r:
            rate = f"{r['gflop_per_s']:.0f} GFLOP/s ({100 * r['matmul_fraction']:.0f}% of {ceiling.dtype} matmul)"
        if "fp32_matmul_fraction" in r:
            rate += f", {100 * r['fp32_matmul_fraction']:.0f}% of fp32; request {r['request']}, auto took {r['auto_path']}"
        elif "gb_per_s" in r:
            rate = f"{r['gb_per_s']:.1f} GB/s"
        spread = f"{r.get('ms_min', r['ms']):.2f}-{r.get('ms_max', r['ms']):.2f}"
        op = r["op"] + ("+sinks" if r["impl"].endswith("+sinks") else "")
        print(f"{op:<24} {r['shape']:<26} {r.get('isa_path', ''):<11} {r['ms']:>9.3f} {spread:>17} "
              f"{r['baseline']:<15} {r['baseline_ms']:>9.3f} {r['speedup']:>7.2f}x  {rate}")
    if args.json:
        meta = {"device": args.device, "threads": torch.get_num_threads(),
                "fp32_matmul_gflop_per_s": ceiling.rates["fp32"], "bf16_matmul_gflop_per_s": ceiling.rates["bf16"],
                "matmul_gflop_per_s": ceiling.best, "matmul_dtype": ceiling.dtype,
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "cpu_model": model,
                "cpu_flags": isa_flags, "amx": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
                "repeat": REPEAT, "clock": "cpu" if args.cpu_time else "wall", "sinks": SINKS}
        for r in records:
            r.update(meta)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
