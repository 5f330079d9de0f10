"""The ``indexcache`` command line: plan, generate, overlap, search, eval, train."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Optional, Sequence


def _load_config_file(path: str) -> dict:
    from .loader import load_config

    try:
        return load_config(path)
    except ValueError as e:
        raise ValueError(f"--config: {e}") from None


def _human(n: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def cmd_plan(args: argparse.Namespace) -> int:
    from .config import IndexCacheConfig
    from .plan import indexer_costs

    if args.config is None and args.layers is None:
        raise ValueError("give --config PATH or --layers N")
    config = _load_config_file(args.config) if args.config else {}
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    if args.mtp_layers is not None:
        config["num_nextn_predict_layers"] = args.mtp_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = IndexCacheConfig.from_config(config, args.hf_overrides)
        plan = cfg.plan()
    notes = list(dict.fromkeys(str(w.message) for w in caught))
    dims = {k: config[k] for k in ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim") if k in config}
    costs = indexer_costs(plan, args.context, dims)
    layers = []
    for layer, (skip, src) in enumerate(zip(plan.skip_topk, plan.source_layer)):
        layers.append({"layer": layer, "type": "S" if skip else "F", "source_layer": src,
                       "mtp": layer >= plan.num_hidden_layers})
    if args.json:
        print(json.dumps({
            "pattern": plan.pattern,
            "num_full": plan.num_full,
            "num_shared": plan.num_shared,
            "num_hidden_layers": plan.num_hidden_layers,
            "num_nextn_predict_layers": plan.num_nextn_predict_layers,
            "use_index_cache": plan.enabled,
            "rule": plan.rule,
            "shipped_by_checkpoint": cfg.shipped_by_checkpoint,
            "replaced": cfg.replaced,
            "hf_overrides": cfg.hf_overrides_json(),
            "layers": layers,
            "costs": costs,
            "warnings": notes,
        }, indent=2))
        return 0
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    head = cfg.describe(plan)
    print(head)
    print(f"pattern: {plan.pattern}")
    print(f"{'layer':>5}  type  reads indices of")
    for row in layers:
        kind = row["type"] + (" (MTP)" if row["mtp"] else "")
        reads = "itself" if row["type"] == "F" else f"layer {row['source_layer']}"
        print(f"{row['layer']:>5}  {kind:<9} {reads}")
    print(f"\nAgainst all-F at context {args.context} tokens (main layers; "
          f"{costs['dims']['index_n_heads']} heads x {costs['dims']['index_head_dim']} indexer):")
    for key, label, unit in (
        ("decode_flops_per_token", "indexer FLOPs per generated token", "FLOP"),
        ("prefill_flops", f"indexer FLOPs per prefill of {args.context} tokens", "FLOP"),
        ("index_k_cache_bytes_per_sequence", "index-K cache per sequence (132 B/token/layer)", "B"),
    ):
        c = costs[key]
        print(f"  {label:<50} {_human(c['all_f'], unit):>12} -> {_human(c['plan'], unit):>12}"
              f"  (removes {_human(c['removed'], unit)}, {100 * c['removed_fraction']:.1f}%)")
    print(f"--hf-overrides '{cfg.hf_overrides_json()}'")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="indexcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the F/S layer plan and what it saves")
    p.add_argument("--config", help="config.json, or a checkpoint directory holding one")
    p.add_argument("--layers", type=int, help="number of main (hidden) layers")
    p.add_argument("--mtp-layers", type=int, help="number of MTP / next-n layers")
    p.add_argument("--hf-overrides", default=None, help="JSON object, as vLLM's --hf-overrides")
    p.add_argument("--context", type=int, default=131072, help="context length T for the cost estimate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)
    from .generate_cli import add_generate_parser

    add_generate_parser(sub)
    from .pattern_cli import add_pattern_parsers

    add_pattern_parsers(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"indexcache {args.command}: error: {e}", file=sys.stderr)
        return 2
