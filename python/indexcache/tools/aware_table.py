"""The held-out table of training-free and training-aware patterns (docs/patterns.md), and the
overlap of a trained pattern's S layers with their trained source indexers.
``python -m indexcache.tools.aware_table --entries ENTRIES.json``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from indexcache.config import IndexCacheConfig
from indexcache.loader import load_config
from indexcache.tools.patterns import evaluate, load_all_full, overlap_matrix, source_overlap, text_windows
from indexcache.tools.text import load_text


@torch.no_grad()
def trained_source_overlap(base, trained, windows: torch.Tensor) -> list:
    """Per main layer of the trained checkpoint's pattern: the share of that layer's own
    (``base``, all-F) indexer selection that its source F layer's **trained** indexer also
    selects (the ``overlap`` rule, all-F run of the base model with one F indexer swapped for
    its trained version at a time). F layers: 1.0."""
    from safetensors.torch import load_file

    model = load_all_full(base, dtype=torch.float32)
    plan = IndexCacheConfig.from_config(load_config(trained)).plan()
    src = list(plan.source_layer)[:model.args.num_hidden_layers]
    tensors = {}
    for f in sorted(Path(trained).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    fs = sorted({f for layer, f in enumerate(src) if layer != f})  # F layers that serve an S layer
    out = [1.0] * len(src)
    base_state = {f: {k: v.clone() for k, v in model.model.layers[f].self_attn.indexer.state_dict().items()} for f in fs}
    for f in fs:
        ix = model.model.layers[f].self_attn.indexer
        ix.load_state_dict({name: tensors[f"model.layers.{f}.self_attn.indexer.{name}"].float()
                            for name in base_state[f]})
        m = overlap_matrix(model, windows)
        for layer, s in enumerate(src):
            if s == f and layer != f:
                out[layer] = float(m[layer, f])
        ix.load_state_dict(base_state[f])
    return out


# ---------------------------------------------------------------------------- the held-out table

def heldout_table(base, entries: Sequence[dict], *, windows: int = 8, context: int = 1024, overlap_windows: int = 2,
                  log: Callable = print) -> list:
    """Held-out rows for docs/patterns.md, in one run: per entry ``{"label", "model", "overrides"}``
    (``model`` None = ``base``; ``overrides`` None = the checkpoint as it ships) the pattern,
    perplexity, bits per byte and prefill time (``patterns.evaluate``: the inference ops, fp8
    scoring), and each S layer's top-k overlap with its source F layer over the first
    ``overlap_windows`` windows: from the base all-F model for a training-free pattern, against
    the trained source indexer (:func:`trained_source_overlap`) for a trained checkpoint."""
    win = text_windows(load_text("heldout", windows * context + 1), context, windows)
    matrix = overlap_matrix(load_all_full(base), win[:overlap_windows])
    rows = []
    for e in entries:
        path = Path(e.get("model") or base)
        t0 = time.time()
        r = evaluate(path, [e.get("overrides")], win)[0]
        if Path(path).resolve() == Path(base).resolve():
            src = source_overlap(matrix, r["pattern"])
        else:
            src = trained_source_overlap(base, path, win[:overlap_windows])
        r.update(label=e.get("label", ""), model=str(e.get("model") or base),
                 source_overlap=[None if c == "F" else round(v, 3) for c, v in zip(r["pattern"], src)],
                 eval_s=round(time.time() - t0, 1))
        rows.append(r)
        log(f"{r['label']:<34} {r['pattern']} ppl {r['perplexity']:.3f} bits/byte {r['bits_per_byte']:.4f}")
    base_s = rows[0]["prefill_s"] if rows else 1.0
    for r in rows:
        r["prefill_ratio"] = r["prefill_s"] / base_s
    return rows


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m indexcache.tools.aware_table",
                                description="held-out table of training-free and training-aware patterns")
    p.add_argument("--entries", required=True, help='JSON list of {"label", "model", "overrides"}')
    p.add_argument("--base", default=None, help="the all-F checkpoint (default: the embedded model)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from indexcache.models.tiny import embedded_model_path

    entries = json.loads(Path(args.entries).read_text())
    rows = heldout_table(args.base or embedded_model_path(), entries, windows=args.windows, context=args.context)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("| pattern | F kept | perplexity | bits/byte | prefill vs all-F | S layer: overlap with its source | what |")
    print("|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        ov = ", ".join(f"{l}:{v:.2f}" for l, v in enumerate(r["source_overlap"]) if v is not None) or "–"
        print(f"| `{r['pattern']}` | {r['indexers_kept']:.3f} | {r['perplexity']:.3f} | {r['bits_per_byte']:.3f} | "
              f"{r['prefill_ratio']:.2f} | {ov} | {r['label']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
