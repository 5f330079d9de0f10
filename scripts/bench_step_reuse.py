"""index_reuse_steps on the embedded model (docs/model.md): teacher-forced decode over held-out
text after a prompt, per R: the recall of the rows reuse would attend over against each F layer's
fresh selection, bits per byte of the decoded bytes, and generate's decode tokens per second.

    PYTHONPATH=python python scripts/bench_step_reuse.py [--prompt 1024] [--steps 256] [--reuse 1 2 4 8]
        [--min-recall 0.5 0.8] [--pattern FSSSFSSS] [--no-rate] [--json OUT]
    PYTHONPATH=python python scripts/bench_step_reuse.py --rate-only --rate-prompt 8192 --rate-new 32 --reuse 1 4 8 --repeat 3

``--min-recall``: each R > 1 also runs adaptively (``index_reuse_min_recall``) at each bar, with
the share of checked steps that recomputed early. ``--pattern``: the F/S plan under the reuse
(default freq 2).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch

from indexcache.models import from_pretrained
from indexcache.models.state import BatchMeta
from indexcache.models.step_reuse import reused_row
from indexcache.models.tiny import embedded_model_path
from indexcache.runtime import generate
from indexcache.tools.text import load_text

BLOCK = 64


def teacher_forced(model, text: list, prompt: int, steps: int):
    """Prefill ``text[:prompt]``, then decode ``text[prompt:prompt + steps]`` one byte a step: (bits
    per byte of the decoded bytes, {F layer: [its attended row per step]}, the cache's selection store)."""
    cache = model.allocate_cache(-(-(prompt + steps + 1) // BLOCK), "auto", BLOCK)
    cache.manager.allocate(0, prompt + steps + 1)
    rows: dict = {}
    hooks = [l.self_attn.sparse_attn.register_forward_hook(
        lambda m, a, o, i=l.layer_id: rows.setdefault(i, []).append(a[1][-1].clone()))
        for l in model.model.layers if l.self_attn.indexer is not None]
    meta = BatchMeta.paged_batch(cache, [0], [0], [prompt])
    h = model.forward_tokens(torch.tensor(text[:prompt]), meta, cache, reuse=False)
    logits = model.compute_logits(h[-1:])
    nll = 0.0
    for t in range(steps):
        target = text[prompt + t]
        nll -= torch.log_softmax(logits[0], -1)[target].item()
        meta = BatchMeta.paged_batch(cache, [0], [prompt + t], [1])
        logits = model.compute_logits(model.forward_tokens(torch.tensor([target]), meta, cache))
    for hk in hooks:
        hk.remove()
    return nll / steps / math.log(2), {i: r[1:] for i, r in rows.items()}, cache.selections  # decode rows only


def recall(fresh: dict, prompt: int, reuse: int) -> dict:
    """Per F layer: the mean share of the fresh selection that reuse R's rows keep (rows R-1
    steps after a recompute at most), over every decode step that has its earlier row."""
    out = {}
    for layer, rs in fresh.items():
        got = []
        for t in range(len(rs)):
            for d in range(1, reuse):
                if t - d < 0:
                    continue
                pos, k = prompt + t, rs[t].numel()
                row = reused_row(rs[t - d], pos - d, pos, k)
                want = set(rs[t][rs[t] >= 0].tolist())
                got.append(len(want & set(row[row >= 0].tolist())) / len(want))
        out[layer] = round(sum(got) / len(got), 4) if got else None
    return out


def decode_rate(model, text: list, prompt: int, new: int) -> float:
    res = generate(model, [text[:prompt]], max_new_tokens=new, decode_step="eager", decode_threads=2, stop_tokens=[])
    return res.decode_tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--rate-prompt", type=int, default=3000)
    ap.add_argument("--rate-new", type=int, default=64)
    ap.add_argument("--reuse", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--min-recall", type=float, nargs="*", default=[])
    ap.add_argument("--pattern", default=None)
    ap.add_argument("--no-rate", action="store_true", help="skip the decode tokens/s runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rate-only", action="store_true",
                    help="only decode tokens/s at --rate-prompt (the reuse values interleaved, --repeat rounds)")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    if a.rate_only:
        return rate_table(a)
    torch.set_num_threads(2)
    text = list(load_text("heldout", a.prompt + a.steps + a.rate_prompt + 16))
    path = embedded_model_path()
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "prompt": a.prompt, "steps": a.steps,
              "plan": a.pattern or "freq 2"}
    base = {"use_index_cache": True, **({"index_topk_pattern": a.pattern} if a.pattern else {"index_topk_freq": 2})}
    runs = [(r, None) for r in a.reuse] + [(r, m) for r in a.reuse if r > 1 for m in a.min_recall]
    fresh = None
    for r, m in runs:
        over = {**base, "index_reuse_steps": r, **({"index_reuse_min_recall": m} if m is not None else {})}
        model = from_pretrained(path, hf_overrides=over, dtype=torch.float32)
        bpb, rows, store = teacher_forced(model, text, a.prompt, a.steps)
        if r == 1:
            fresh = rows
        name = f"reuse_{r}" + (f"_min_recall_{m:g}" if m is not None else "")
        rec = {"bits_per_byte": round(bpb, 4)}
        if m is not None:
            rec["checked_steps"], rec["recomputed_early"] = store.checked, store.recomputed
        elif fresh is not None:
            rec["recall_of_fresh"] = recall(fresh, a.prompt, r)
        if not a.no_rate:
            t0 = time.perf_counter()
            rec["decode_tok_s"] = round(decode_rate(model, text, a.rate_prompt, a.rate_new), 1)
            rec["rate_seconds"] = round(time.perf_counter() - t0, 1)
        report[name] = rec
        print(json.dumps({name: rec}), flush=True)
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def rate_table(a) -> None:
    """Decode tokens/s per R at one context, R values interleaved round by round; median, min, max.
    max_position_embeddings is raised to fit the context (a speed figure: past the embedded model's
    4096 positions its outputs mean nothing)."""
    torch.set_num_threads(2)
    text = list(load_text("heldout", a.rate_prompt + 16))
    over = {"use_index_cache": True, **({"index_topk_pattern": a.pattern} if a.pattern else {"index_topk_freq": 2}),
            "max_position_embeddings": max(4096, a.rate_prompt + a.rate_new + 8)}
    models = {r: from_pretrained(embedded_model_path(), hf_overrides={**over, "index_reuse_steps": r},
                                 dtype=torch.bfloat16) for r in a.reuse}
    rates: dict = {r: [] for r in a.reuse}
    for _ in range(a.repeat):
        for r in a.reuse:
            rates[r].append(decode_rate(models[r], text, a.rate_prompt, a.rate_new))
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(), "threads": 2,
              "context": a.rate_prompt, "new_tokens": a.rate_new, "dtype": "bf16", "plan": a.pattern or "freq 2",
              "decode_tok_s": {f"reuse_{r}": {"median": round(sorted(v)[len(v) // 2], 1), "min": round(min(v), 1),
                                              "max": round(max(v), 1)} for r, v in rates.items()}}
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
