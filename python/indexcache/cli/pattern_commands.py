"""``indexcache overlap | search | eval | train``: choose an F/S pattern for a checkpoint."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path


def _common(p: argparse.ArgumentParser, split: str, windows: int) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    p.add_argument("--text", default=None, help="a text file to use (default: a split of the standard library)")
    p.add_argument("--split", default=split, choices=["train", "calib", "heldout"],
                   help=f"standard-library split when no --text is given (default {split})")
    p.add_argument("--context", type=int, default=None, help="tokens per window (default: min(1024, max positions))")
    p.add_argument("--windows", type=int, default=windows, help=f"windows of text to use (default {windows})")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _setup(args, all_full: bool = True):
    """(checkpoint path, all-F model (None unless ``all_full``), token windows, text bytes per token)."""
    import torch

    from indexcache.runtime import load_tokenizer
    from indexcache.loader import load_config
    from indexcache.models import ModelArgs, model_class
    from indexcache.models.tiny import embedded_model_path
    from indexcache.tools.patterns import load_all_full, token_windows
    from indexcache.tools.text import load_text

    if args.windows < 1:
        raise ValueError(f"--windows must be >= 1, got {args.windows}")
    path = Path(args.model) if args.model else embedded_model_path()
    config = load_config(path)
    family = model_class(config)
    max_pos = family.args_class.from_config(family.family_config(config), family.model_type,
                                    family.config_defaults).max_position_embeddings
    tokenizer = load_tokenizer(path, config)
    model = load_all_full(path, dtype=torch.float32) if all_full else None
    context = args.context or min(1024, max_pos)
    if context > max_pos:
        raise ValueError(f"--context {context} exceeds max_position_embeddings {max_pos}")
    if args.text:
        text = Path(args.text).read_bytes()
    else:  # enough bytes for the windows at any tokenizer's rate (a token is rarely over 16 bytes)
        text = load_text(args.split, 16 * (args.windows * context + 1))
    windows, bytes_per_token = token_windows(text, tokenizer, context, args.windows)
    return path, model, windows, bytes_per_token


def _plot(path, draw) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    draw(fig, ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_overlap(args) -> int:
    from indexcache.config import IndexCacheConfig
    from indexcache.tools.patterns import overlap_matrix, source_overlap

    path, model, windows, _ = _setup(args)
    m = overlap_matrix(model, windows)
    n = m.shape[0]
    pattern = None
    if args.hf_overrides:
        pattern = IndexCacheConfig.from_config({"num_hidden_layers": n}, args.hf_overrides).plan(n, 0).pattern
    src = source_overlap(m, pattern) if pattern else None
    if args.png:
        def draw(fig, ax):
            im = ax.imshow(m.numpy(), vmin=0, vmax=1, cmap="viridis")
            ax.set_xlabel("layer j")
            ax.set_ylabel("layer i")
            ax.set_title(f"top-{model.args.index_topk} overlap: share of layer i's tokens that layer j also picks")
            for i in range(n):
                for j in range(n):
                    ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if m[i, j] < 0.6 else "black")
            fig.colorbar(im, ax=ax)
        _plot(args.png, draw)
    if args.json:
        print(json.dumps({"model": str(path), "index_topk": model.args.index_topk, "indexed_layers": model.indexed,
                          "context": windows.shape[1] - 1,
                          "windows": windows.shape[0], "matrix": m.tolist(), "pattern": pattern,
                          "source_overlap": src}))
        return 0
    a = model.args
    what = (f"top-{a.index_topk_blocks} block ({a.index_block_size} keys, per KV head)" if a.index_block_size
            else f"top-{a.index_topk}")
    if getattr(a, "indexer_compress_ratio", 0):  # QSA: blocks of tokens, the query's own block included
        what = f"QSA block ({a.indexer_budget // a.indexer_compress_ratio} of {a.indexer_compress_ratio} tokens)"
    print(f"{what} overlap over {windows.shape[0]} x {windows.shape[1] - 1} tokens "
          f"(row i: share of layer i's selection that layer j also selects)")
    if len(model.indexed) != a.num_hidden_layers:
        print(f"indexed positions 0..{n - 1} are layers {', '.join(map(str, model.indexed))}")
    print("      " + "".join(f"{j:>6}" for j in range(n)))
    for i in range(n):
        print(f"{i:>5} " + "".join(f"{m[i, j]:>6.2f}" for j in range(n)))
    adjacent = [float(m[i, i - 1]) for i in range(1, n)]
    print(f"adjacent layers (i vs i-1): mean {sum(adjacent) / len(adjacent):.3f}, min {min(adjacent):.3f}")
    if src:
        print(f"pattern {pattern}: overlap with the F layer each layer reads")
        print("  " + " ".join(f"{l}:{v:.2f}" for l, v in enumerate(src)))
    if args.png:
        print(f"heatmap: {args.png}")
    return 0


def cmd_search(args) -> int:
    from indexcache.tools.patterns import PatternRunner, uniform_pattern

    if args.method == "overlap" and (args.log or args.min_full != 1):
        raise ValueError("--log and --min-full are for --method greedy (the overlap search is one pass)")
    path, model, windows, bytes_per_token = _setup(args)
    bits = 1 / (math.log(2) * bytes_per_token)  # nats per token -> bits per byte of the text
    runner = PatternRunner(model, windows)
    t0 = time.perf_counter()
    if args.method == "overlap":
        steps, chosen = _search_by_overlap(model, windows, runner)
    else:
        steps, chosen = _search_greedy(args, runner)
    search_seconds = time.perf_counter() - t0
    uniform = {}
    for freq in (2, 4, 8):
        pat = uniform_pattern(runner.num_layers, freq)
        uniform[freq] = {"pattern": pat, "num_full": pat.count("F"), "loss": runner.pattern_loss(pat)}
    if args.png:
        _plot_search(args.png, steps, chosen, uniform, bits)
    if args.json:
        print(json.dumps({"model": str(path), "method": args.method, "search_seconds": search_seconds,
                          "bytes_per_token": bytes_per_token, "steps": steps, "budgets": chosen, "uniform": uniform}))
        return 0
    if steps:
        print(f"{'step':>4} {'turned S':>8} {'F':>3} {'loss bits/byte':>15}  pattern")
    for s in steps:
        print(f"{s['step']:>4} {'-' if s['layer'] is None else s['layer']:>8} {s['num_full']:>3} "
              f"{s['loss'] * bits:>15.4f}  {s['pattern']}")
    print(f"\n{args.method} search: {search_seconds:.2f} s")
    print("uniform patterns on the same text:")
    for freq, u in uniform.items():
        print(f"  freq {freq}: {u['pattern']} ({u['num_full']} F) {u['loss'] * bits:.4f} bits/byte")
    print("\nbudgets:")
    for name, c in chosen.items():
        extra = f", mean source overlap {c['source_overlap']:.3f}" if "source_overlap" in c else ""
        print(f"  {name} ({c['num_full']} F): {c['pattern']} {c['loss'] * bits:.4f} bits/byte{extra}")
        print(f"    --hf-overrides '{c['hf_overrides']}'")
    if args.png:
        print(f"plot: {args.png}")
    return 0


def _search_greedy(args, runner) -> tuple:
    """The greedy loss search's steps and the 1/2, 1/4, 1/8 budgets' patterns from them."""
    from indexcache.tools.patterns import budgets, greedy_search, hf_overrides_for

    steps = greedy_search(runner, Path(args.log) if args.log else None, min_full=args.min_full,
                          progress=not args.json)
    chosen = {}
    for name, keep in budgets(runner.num_layers).items():
        match = [s for s in steps if s["num_full"] == keep]
        if match:
            chosen[name] = {"num_full": keep, "pattern": match[0]["pattern"], "loss": match[0]["loss"],
                            "hf_overrides": hf_overrides_for(match[0]["pattern"])}
    return steps, chosen


def _search_by_overlap(model, windows, runner) -> tuple:
    """The 1/2, 1/4, 1/8 budgets chosen from the overlap matrix (one all-F forward, no loss pass;
    the loss of each chosen pattern is then measured for the report)."""
    from indexcache.tools.patterns import budgets, hf_overrides_for, overlap_matrix, overlap_search

    matrix = overlap_matrix(model, windows)
    chosen = {}
    for name, keep in budgets(runner.num_layers).items():
        pattern, mean = overlap_search(matrix, keep)
        chosen[name] = {"num_full": keep, "pattern": pattern, "source_overlap": mean,
                        "hf_overrides": hf_overrides_for(pattern)}
    for c in chosen.values():  # after the search: evaluation, not part of its time
        c["loss"] = runner.pattern_loss(c["pattern"])
    return [], chosen


def _plot_search(path, steps, chosen, uniform, bits) -> None:
    def draw(fig, ax):
        if steps:
            ax.plot([s["num_full"] for s in steps], [s["loss"] * bits for s in steps], "o-", label="greedy search")
        else:
            ax.plot([c["num_full"] for c in chosen.values()], [c["loss"] * bits for c in chosen.values()], "o",
                    markersize=9, label="overlap search")
        for freq, u in uniform.items():
            ax.plot(u["num_full"], u["loss"] * bits, "s", markersize=9, label=f"uniform freq {freq}")
        ax.set_xlabel("F layers (indexers kept)")
        ax.set_ylabel("calibration loss (bits/byte)")
        ax.invert_xaxis()
        ax.legend()
        ax.set_title("IndexCache pattern search")
    _plot(path, draw)


def _overrides_list(args) -> list:
    from indexcache.config import parse_overrides
    from indexcache.tools.patterns import hf_overrides_for

    items = []
    if args.overrides_file:
        try:
            data = json.loads(Path(args.overrides_file).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--overrides-file {args.overrides_file} is not valid JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise ValueError("--overrides-file must hold a JSON list of override objects")
        items += data
    items += list(args.overrides or [])
    if args.search_log:
        steps = [json.loads(line) for line in Path(args.search_log).read_text().splitlines() if line.strip()]
        from indexcache.tools.patterns import budgets

        for keep in sorted(set(budgets(len(steps[0]["pattern"])).values()), reverse=True):
            match = [s for s in steps if s["num_full"] == keep]
            if match:
                items.append(hf_overrides_for(match[0]["pattern"]))
    if not items:
        items = [None, {"use_index_cache": True, "index_topk_freq": 2}, {"use_index_cache": True, "index_topk_freq": 4},
                 {"use_index_cache": True, "index_topk_freq": 8}]
    for i, ov in enumerate(items):
        if ov is not None:
            try:
                parse_overrides(ov)
            except ValueError as e:
                raise ValueError(f"overrides entry {i}: {e}") from None
    return items


def cmd_eval(args) -> int:
    from indexcache.tools.patterns import evaluate

    path, _, windows, bytes_per_token = _setup(args, all_full=False)
    rows = evaluate(path, _overrides_list(args), windows, bytes_per_token=bytes_per_token)
    if args.json:
        print(json.dumps({"model": str(path), "bytes_per_token": bytes_per_token, "rows": rows}))
        return 0
    print(f"held-out: {windows.shape[0]} windows x {windows.shape[1] - 1} tokens ({bytes_per_token:.2f} bytes/token); "
          "perplexity per token; prefill of one window timed")
    print(f"{'pattern':<14} {'F kept':>7} {'ppl':>8} {'bits/byte':>10} {'prefill ms':>11} {'vs first':>9}  overrides")
    for r in rows:
        print(f"{r['pattern']:<14} {r['indexers_kept']:>7.3f} {r['perplexity']:>8.4f} {r['bits_per_byte']:>10.4f} "
              f"{1e3 * r['prefill_s']:>11.1f} {r['prefill_ratio']:>8.2f}x  {r['hf_overrides'] or '(checkpoint)'}")
    return 0


def cmd_train(args) -> int:
    from indexcache.tools.train import TrainSchedule, train

    if args.hf_overrides is not None or args.mode is not None:
        return _cmd_train_aware(args)
    d = TrainSchedule()

    def pick(value, default):
        return default if value is None else value

    sched = TrainSchedule(dense_steps=args.dense_steps, warmup_steps=pick(args.warmup_steps, d.warmup_steps),
                          sparse_steps=pick(args.sparse_steps, d.sparse_steps), batch=pick(args.batch, d.batch),
                          context=pick(args.context_len, d.context), sparse_batch=args.sparse_batch,
                          sparse_context=args.sparse_context_len, seed=args.seed,
                          eval_every=pick(args.eval_every, d.eval_every))
    final = train(Path(args.out), sched, init=Path(args.init) if args.init else None)
    print(f"checkpoint: {final}")
    return 0


def _cmd_train_aware(args) -> int:
    """``train --hf-overrides``: training-aware IndexCache (train_aware.py)."""
    from indexcache.tools.aware import AwareSchedule, train_aware

    if args.hf_overrides is None:
        raise ValueError("--mode needs --hf-overrides with the pattern to train for")
    if not args.init:
        raise ValueError("training-aware IndexCache needs --init CHECKPOINT (the model whose indexers to retrain)")
    d = AwareSchedule()

    def pick(value, default):
        return default if value is None else value

    sched = AwareSchedule(warmup_steps=pick(args.warmup_steps, d.warmup_steps),
                          sparse_steps=pick(args.sparse_steps, d.sparse_steps), batch=pick(args.batch, d.batch),
                          context=pick(args.context_len, d.context), lr=pick(args.lr, d.lr),
                          mode=pick(args.mode, d.mode), seed=args.seed, eval_every=pick(args.eval_every, d.eval_every),
                          chunk_elems=pick(args.chunk_elems, d.chunk_elems))
    train_text = Path(args.text).read_bytes() if args.text else None
    held_text = Path(args.heldout_text).read_bytes() if args.heldout_text else None
    final = train_aware(Path(args.out), Path(args.init), args.hf_overrides, sched, train_text=train_text,
                        heldout_text=held_text, threads=args.threads)
    print(f"checkpoint: {final}")
    return 0


def add_pattern_parsers(sub) -> None:
    p = sub.add_parser("overlap", help="top-k overlap between every pair of layers")
    _common(p, "heldout", 2)
    p.add_argument("--hf-overrides", default=None, help="a pattern (as overrides) to report each layer's source overlap")
    p.add_argument("--png", default=None, help="write the heatmap here")
    p.set_defaults(func=cmd_overlap)

    p = sub.add_parser("search", help="training-free search of an F/S pattern (greedy loss or overlap matrix)")
    _common(p, "calib", 4)
    p.add_argument("--log", default=None, help="JSON-lines log; an existing one is resumed")
    p.add_argument("--min-full", type=int, default=1, help="stop at this many F layers (default 1)")
    p.add_argument("--method", default="greedy", choices=["greedy", "overlap"],
                   help="greedy: turn to S the layer that raises the loss least, step by step (a loss pass per "
                        "candidate); overlap: the pattern maximising each S layer's top-k overlap with its F "
                        "source, a dynamic programme over the overlap matrix (one all-F forward)")
    p.add_argument("--png", default=None, help="write the loss-vs-F-layers plot here")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("eval", help="held-out perplexity and prefill time for a list of overrides")
    _common(p, "heldout", 8)
    p.add_argument("--overrides", action="append", help="an --hf-overrides JSON (repeatable)")
    p.add_argument("--overrides-file", default=None, help="a JSON list of override objects")
    p.add_argument("--search-log", default=None, help="add the 1/2, 1/4, 1/8 patterns from a search log")
    p.set_defaults(func=cmd_eval)

    from indexcache.tools.train import TrainSchedule

    p = sub.add_parser("train", help="train the small DSA model on the standard library (CPU), or with "
                                     "--hf-overrides retrain a checkpoint's kept indexers for a pattern")
    p.add_argument("--out", required=True, help="work directory (resumable); the checkpoint lands in OUT/checkpoint")
    p.add_argument("--dense-steps", type=int, default=TrainSchedule.dense_steps)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help=f"indexer warm-up steps (default {TrainSchedule.warmup_steps}; training-aware 60)")
    p.add_argument("--sparse-steps", type=int, default=None,
                   help=f"sparse steps (default {TrainSchedule.sparse_steps}; training-aware 10)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"dense-phase batch (default {TrainSchedule.batch}; training-aware: every step, 2)")
    p.add_argument("--context-len", type=int, default=None,
                   help=f"dense-phase context (default {TrainSchedule.context}; training-aware: every step, 512)")
    p.add_argument("--sparse-batch", type=int, default=TrainSchedule.sparse_batch)
    p.add_argument("--sparse-context-len", type=int, default=TrainSchedule.sparse_context,
                   help="context of the indexer warm-up and sparse phases")
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations (and resumable points)")
    p.add_argument("--seed", type=int, default=TrainSchedule.seed)
    p.add_argument("--init", default=None, help="start from this checkpoint (e.g. more warm-up with --dense-steps 0)")
    g = p.add_argument_group("training-aware IndexCache (with --hf-overrides; needs --init)")
    g.add_argument("--hf-overrides", default=None,
                   help="the pattern to train for, e.g. '{\"use_index_cache\": true, \"index_topk_freq\": 4}': each F "
                        "indexer learns the mean attention of every layer it serves; the checkpoint ships the pattern")
    g.add_argument("--mode", choices=["indexers", "model"], default=None,
                   help="indexers: only the kept indexers train (default); model: the main layers too, in the sparse stage")
    g.add_argument("--lr", type=float, default=None, help="indexer learning rate (default 3e-3)")
    g.add_argument("--text", default=None, help="training text file (default: the standard library's train split)")
    g.add_argument("--heldout-text", default=None, help="held-out text file (default: the standard library's held-out split)")
    g.add_argument("--chunk-elems", type=int, default=None,
                   help="attention/indexer scores per query chunk (bounds memory on long contexts; default 2^24)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_train)
