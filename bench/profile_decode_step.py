"""Where a CPU decode step's time goes: torch.profiler over plain decode steps after a long prompt,
beside the StageTimer's stages, at each thread count asked for.

    python bench/profile_decode_step.py --model DIR [--context 2048] [--steps 16] [--threads 1,2]
                                        [--dtype bf16] [--decode-step eager|compiled] [--top 25] [--json OUT]

One greedy request: a ``--context``-token random prompt is prefilled (torch's thread count), then
``--steps`` decode steps warm up and ``--steps`` more are timed three ways, one after the other at
each thread count: wall time alone; under the StageTimer (per-stage ms, the rest is "outside");
under torch.profiler (ops by self CPU time, their calls per step, and the host reads of device
data, ``aten::item`` / ``aten::_local_scalar_dense``, per step). Prints one table per thread count
and, with --json, one record per thread count. ``--decode-step compiled``: no stages (the step is
one compiled function; its first warm-up steps compile it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

import torch

from indexcache.models import from_pretrained
from indexcache.models.state import StageTimer
from indexcache.runtime.generation import GenerationSettings, Run, decode_step, prefill

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense")


def new_run(model, ctx: int, steps: int, mode: str, seed: int, timer=None) -> Run:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.args.vocab_size, (ctx,), generator=g).tolist()
    s = GenerationSettings(stop_tokens=[], decode_step=mode, timer=timer)
    run = Run(model, [prompt], 1 + 4 * steps, s)
    prefill(run)
    return run


def steps_of(run: Run, n: int) -> list:
    """Wall seconds of ``n`` decode steps."""
    out = []
    for _ in range(n):
        live = run.live()
        t0 = time.perf_counter()
        decode_step(run, live)
        out.append(time.perf_counter() - t0)
    return out


def profile_threads(model, args, threads: int) -> dict:
    prefill_threads = torch.get_num_threads()
    # a compiled step is one function: no stages to time (its warm-up steps compile it)
    timer = None if args.decode_step == "compiled" else StageTimer()
    run = new_run(model, args.context, args.steps, args.decode_step, args.seed, timer)
    torch.set_num_threads(threads)
    try:
        run.s = replace(run.s, timer=None)
        steps_of(run, args.steps)                      # warm-up
        wall = steps_of(run, args.steps)
        staged, stages = wall, {}
        if timer is not None:
            run.s = replace(run.s, timer=timer)
            timer.times.clear()
            staged = steps_of(run, args.steps)
            stages = {k: v / args.steps * 1e3 for k, v in timer.times.items()}
            run.s = replace(run.s, timer=None)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            profiled = steps_of(run, args.steps)
    finally:
        torch.set_num_threads(prefill_threads)
    events = prof.key_averages()
    ops = sorted((e for e in events if not e.key.startswith("indexcache::layer")), key=lambda e: -e.self_cpu_time_total)
    top = [{"op": e.key, "calls_per_step": e.count / args.steps, "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
            "total_ms_per_step": e.cpu_time_total / 1e3 / args.steps} for e in ops[:args.top]]
    calls = sum(e.count for e in events if e.key.startswith("aten::")) / args.steps
    syncs = sum(e.count for e in events if e.key == SYNC_OPS[0]) / args.steps
    step_ms = statistics.median(wall) * 1e3
    return {"threads": threads, "context": args.context, "steps": args.steps, "decode_step": args.decode_step,
            "step_ms_median": step_ms, "step_ms_min": min(wall) * 1e3, "step_ms_max": max(wall) * 1e3,
            "staged_step_ms": statistics.median(staged) * 1e3, "profiled_step_ms": statistics.median(profiled) * 1e3,
            "stages_ms": stages, "outside_stages_ms": statistics.median(staged) * 1e3 - sum(stages.values()),
            "aten_calls_per_step": calls, "host_syncs_per_step": syncs, "top_ops": top,
            "loadavg": os.getloadavg()}


def show(rec: dict) -> None:
    print(f"\n== {rec['threads']} thread(s), {rec['decode_step']} step after {rec['context']} tokens: "
          f"{rec['step_ms_median']:.1f} ms/step ({rec['step_ms_min']:.1f}-{rec['step_ms_max']:.1f}), "
          f"{rec['aten_calls_per_step']:.0f} aten calls and {rec['host_syncs_per_step']:.0f} host reads (.item) "
          f"per step, load {rec['loadavg'][0]:.2f}")
    print(f"stages (StageTimer, {rec['staged_step_ms']:.1f} ms/step timed):")
    for k, v in sorted(rec["stages_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<12} {v:8.2f} ms")
    print(f"  {'outside':<12} {rec['outside_stages_ms']:8.2f} ms (embedding, head, sampling, Python)")
    print(f"ops by self CPU time (profiled run: {rec['profiled_step_ms']:.1f} ms/step):")
    print(f"  {'op':<40} {'calls/step':>10} {'self ms':>9} {'total ms':>9}")
    for t in rec["top_ops"]:
        print(f"  {t['op'][:40]:<40} {t['calls_per_step']:>10.1f} {t['self_ms_per_step']:>9.2f} {t['total_ms_per_step']:>9.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--decode-step", default="eager")
    ap.add_argument("--hf-overrides", default=None, help="JSON, e.g. '{\"use_index_cache\": true, \"index_topk_freq\": 4}'")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
    model = from_pretrained(args.model, dtype=dtype, hf_overrides=overrides).eval()
    print(f"{args.model}: pattern {model.plan.pattern}, {args.dtype}, torch {torch.__version__}")
    recs = []
    with torch.inference_mode():
        for t in [int(x) for x in args.threads.split(",")]:
            rec = profile_threads(model, args, t)
            show(rec)
            recs.append(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
