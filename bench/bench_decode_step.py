"""Plain decode through generate(): the eager step vs the sync-free static step vs (on CUDA) the
CUDA-graph step, each under every --decode-threads choice, interleaved and repeated, side by
side in one run.

    python bench/bench_decode_step.py [--device cpu|cuda] [--batch 4] [--new-tokens 24]
                                      [--repeat 3] [--dtype bf16] [--decode-threads auto,1,2]
                                      [--json PATH]

Runs the embedded default model (or --model DIR) on --batch prompts of different lengths and
prints decode tokens per second per mode (median, min, max over --repeat rounds; the modes take
turns within each round) and each mode's ratio to eager, plus whether every mode generated the
same tokens as eager (greedy). ``auto`` threads: generate's timed choice (runtime/threads.py),
its trial steps included in the time. With --json, one record per mode. generate() allocates a fresh
cache per call, so the graph mode's time includes one capture (a warm-up forward and the
capture) per batch size per call; raise --new-tokens to amortise it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from indexcache.runtime import ByteTokenizer, generate, load_tokenizer
from indexcache.models import from_pretrained
from indexcache.models.tiny import embedded_model_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-threads", default="auto",
                    help="comma-separated: auto and/or counts (CPU), e.g. auto,1,2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    threads = [None if t == "auto" else int(t) for t in args.decode_threads.split(",")]
    path = args.model or embedded_model_path()
    model = from_pretrained(path, dtype=args.dtype, device=args.device)
    tok = ByteTokenizer() if args.model is None else load_tokenizer(path)
    text = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)
    prompts = [text[: 120 + 90 * i] for i in range(args.batch)]
    modes = ["eager", "static"] + (["graph"] if args.device == "cuda" else [])
    generate(model, [text[:8]], 2, decode_step=modes[-1])  # one-off set-up out of the timings
    variants = [(m, t) for m in modes for t in threads]
    speed = {v: [] for v in variants}
    tokens, chosen = {}, {}
    for _ in range(args.repeat):
        for m, t in variants:
            res = generate(model, prompts, args.new_tokens, stop_tokens=[], decode_step=m, decode_threads=t)
            speed[m, t].append(res.decode_tokens_per_s)
            tokens[m, t] = res.tokens
            chosen.setdefault((m, t), []).append(res.decode_threads)
    base = statistics.median(speed[variants[0]])
    where = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"decode, {args.batch} requests x {args.new_tokens} tokens, {args.device} ({where}) {args.dtype}, "
          f"{args.repeat} rounds")
    print(f"{'mode':<8} {'threads':>8} {'chosen':>10} {'tok/s median':>13} {'min':>8} {'max':>8} {'vs first':>9} "
          f"{'tokens as first':>16}")
    records = []
    for v in variants:
        (m, t), sp = v, speed[v]
        med = statistics.median(sp)
        same = tokens[v] == tokens[variants[0]]
        picked = ",".join(str(c) for c in chosen[v])
        print(f"{m:<8} {t or 'auto':>8} {picked:>10} {med:>13.1f} {min(sp):>8.1f} {max(sp):>8.1f} {med / base:>8.2f}x "
              f"{str(same):>16}")
        records.append({"mode": m, "decode_threads": t or "auto", "chosen_threads": chosen[v], "tok_per_s": med,
                        "tok_per_s_min": min(sp), "tok_per_s_max": max(sp), "vs_first": med / base,
                        "same_tokens_as_first": same, "device": args.device, "where": where, "batch": args.batch,
                        "new_tokens": args.new_tokens, "dtype": args.dtype, "torch_threads": torch.get_num_threads()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
