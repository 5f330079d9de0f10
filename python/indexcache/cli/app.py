"""The ``indexcache`` command line: plan, generate, overlap, search, eval, train."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Optional, Sequence


def _load_config_file(path: str) -> dict:
    from indexcache.loader import load_config

    try:
        return load_config(path)
    except ValueError as e:
        raise ValueError(f"--config: {e}") from None


def _human(n: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def _family_reading(config: dict) -> tuple[Optional[list], dict]:
    """(the main layer ids a family's plan covers when they are not all of its layers, as
    MiniMax-M3's sparse layers (DESIGN.md §2), else None; the keys IndexCache reads), both
    through the family's own reading of its config.json."""
    if not config.get("model_type") and not config.get("architectures"):
        return None, config
    from indexcache.models.registry import model_class
    try:
        cls = model_class(config)
        args = cls.args_class.from_config(cls.family_config(config), cls.model_type, cls.config_defaults)
    except (ValueError, KeyError, TypeError):
        return None, config  # not a config a family reads (e.g. a partial one for --layers): every layer
    indexed = cls.indexed_layers(args)
    return (indexed if len(indexed) != args.num_hidden_layers else None), cls.index_cache_config(config)


def cmd_plan(args: argparse.Namespace) -> int:
    from indexcache.config import IndexCacheConfig
    if args.config is None and args.layers is None:
        raise ValueError("give --config PATH or --layers N")
    if args.gpu_mem and args.config is None:
        raise ValueError("--gpu-mem needs --config (the model's widths)")
    if args.tp < 1 or args.pp < 1:
        raise ValueError("--tp and --pp must be >= 1")
    config = _load_config_file(args.config) if args.config else {}
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    if args.mtp_layers is not None:
        config["num_nextn_predict_layers"] = args.mtp_layers
    csa = _deepseek_v4_csa(config, args)
    v4 = csa is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        indexed, ic_keys = _family_reading(config) if args.layers is None else (None, config)
        indexed = csa if v4 else indexed
        cfg = IndexCacheConfig.from_config(ic_keys, args.hf_overrides)
        plan = cfg.plan() if indexed is None else cfg.plan(len(indexed), 0, indexed)
    notes = list(dict.fromkeys(str(w.message) for w in caught))
    widths = config.get("text_config") if isinstance(config.get("text_config"), dict) else config  # a VL config's text tower
    dims = {k: widths[k] for k in ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim") if k in widths}
    costs = _deepseek_v4_costs(config, plan, args.context) if v4 else _costs(config, plan, args, indexed, dims)
    main_id = (lambda i: i) if indexed is None else (lambda i: indexed[i])  # plan position -> main layer id
    layers = []
    for layer, (skip, src) in enumerate(zip(plan.skip_topk, plan.source_layer)):
        layers.append({"layer": main_id(layer), "type": "S" if skip else "F", "source_layer": main_id(src),
                       "mtp": layer >= plan.num_hidden_layers, "indexed_position": layer})
    scaleout = _scaleout(args, config, plan) if args.pp > 1 or args.tp > 1 or args.gpu_mem else None
    if args.json:
        print(json.dumps({
            "scaleout": scaleout,
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
            "indexed_layers": indexed,
            "costs": costs,
            "warnings": notes,
        }, indent=2))
        return 0
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    head = cfg.describe(plan)
    print(head)
    print(f"pattern: {plan.pattern}")
    if indexed is not None:
        print(f"over the {'CSA' if v4 else 'indexed'} layers {', '.join(map(str, indexed))} (the others run no indexer)")
    print(f"{'layer':>5}  type  reads indices of")
    for row in layers:
        kind = row["type"] + (" (MTP)" if row["mtp"] else "")
        reads = "itself" if row["type"] == "F" else f"layer {row['source_layer']}"
        print(f"{row['layer']:>5}  {kind:<9} {reads}")
    _print_costs(costs, args.context, csa)
    print(f"--hf-overrides '{cfg.hf_overrides_json()}'")
    if scaleout:
        _print_scaleout(scaleout)
    return 0


def _deepseek_v4_csa(config: dict, args: argparse.Namespace) -> Optional[list]:
    """DeepSeek-V4's CSA layer ids (its plan covers those only, DESIGN §2); None for other families."""
    if config.get("model_type") != "deepseek_v4":
        return None
    from indexcache.models.deepseek_v4 import csa_layers_of
    if args.pp > 1 or args.tp > 1 or args.gpu_mem:
        raise ValueError("--tp / --pp / --gpu-mem size V3.2-layout caches; DeepSeek-V4's are not sized yet")
    return csa_layers_of(config)


def _costs(config: dict, plan, args: argparse.Namespace, indexed: Optional[list], dims: dict) -> dict:
    """What the plan removes, in the family's own terms; for the hybrids also one request's whole
    cache, its constant linear-attention state apart."""
    from indexcache.models.hybrid_sizing import hybrid_sequence_cache
    from indexcache.plan import indexer_costs

    if config.get("model_type") in ("qwen4_exp", "qwen4_exp_text") and args.layers is None:
        from indexcache.models.qwen4_exp import qsa_indexer_costs  # QSA: one key per block of tokens
        costs = qsa_indexer_costs(config, plan, args.context)
    elif config.get("model_type") in ("glm5_next", "glm5_next_text") and indexed is not None:
        from indexcache.models.glm5_next import kpool_indexer_costs  # scores pools of keys, not keys
        costs = kpool_indexer_costs(config, plan, args.context)
    else:
        return indexer_costs(plan, args.context, dims)
    costs["sequence_cache_bytes"] = hybrid_sequence_cache(config, plan.pattern, args.context,
                                                          args.kv_cache_dtype or "auto")
    return costs


def _deepseek_v4_costs(config: dict, plan, context: int) -> dict:
    from indexcache.models.deepseek_v4 import csa_indexer_costs
    return csa_indexer_costs(config, plan, context)


def _print_costs(costs: dict, context: int, csa: Optional[list]) -> None:
    """What the plan removes against all-F; ``csa``: DeepSeek-V4's CSA layers (its index keys are
    per compressed entry)."""
    what = f"{len(csa)} CSA layers, entries of {costs['csa_rate']} tokens" if csa is not None else "main layers"
    print(f"\nAgainst all-F at context {context} tokens ({what}; "
          f"{costs['dims']['index_n_heads']} heads x {costs['dims']['index_head_dim']} indexer):")
    k_label = costs.get("index_k_label") or (f"index-K cache per sequence ({costs['dims']['index_head_dim'] + 4} B/entry/layer)" if csa is not None
               else "index-K cache per sequence (132 B/token/layer)")
    rows = [("decode_flops_per_token", "indexer FLOPs per generated token", "FLOP"),
            ("prefill_flops", f"indexer FLOPs per prefill of {context} tokens", "FLOP"),
            ("index_k_cache_bytes_per_sequence", k_label, "B")]
    if csa is not None:
        rows.append(("index_k_bytes_per_token", "index-K bytes per token of context", "B"))
    seq = costs.get("sequence_cache_bytes")
    if seq is not None:
        what = {"auto": "bf16"}.get(seq["kv_cache_dtype"], seq["kv_cache_dtype"])
        rows.append(("sequence_cache_bytes", f"whole cache per sequence (attention in {what})", "B"))
    for key, label, unit in rows:
        c = costs[key]
        print(f"  {label:<50} {_human(c['all_f'], unit):>12} -> {_human(c['plan'], unit):>12}"
              f"  (removes {_human(c['removed'], unit)}, {100 * c['removed_fraction']:.1f}%)")
    if seq is not None:
        print(f"    of which linear-attention state {_human(seq['linear_state_bytes'], 'B')} per request "
              "(constant in context; IndexCache leaves it)")


def _scaleout(args, config: dict, plan) -> dict:
    """Pipeline stages of the plan as given (top-k rows handed to a stage that begins on S) and of
    the engines' fallback (each stage's first layer forced F); per-GPU memory with --gpu-mem."""
    from indexcache.models.hybrid_sizing import hybrid_scaleout, is_hybrid
    from indexcache.models.sizing import scaleout_budget
    from indexcache.parallel import stage_bounds, stage_start_full_pattern
    from indexcache.plan import build_layer_plan, indexer_costs

    if is_hybrid(config):
        if not args.gpu_mem:
            raise ValueError(f"--tp / --pp without --gpu-mem: {config['model_type']} prints its per-GPU memory only")
        return hybrid_scaleout(config, plan.pattern, args.tp, args.pp, args.gpu_mem, args.kv_cache_dtype or "auto",
                               args.num_seqs)
    if "num_hidden_layers" not in config:
        raise ValueError("--tp / --pp / --gpu-mem: the config has no num_hidden_layers (not a DSA config this "
                         "tool can size)")
    if args.num_seqs != 1:
        raise ValueError("--num-seqs counts per-request linear-attention state: only the hybrid families have it")
    args.kv_cache_dtype = args.kv_cache_dtype or "fp8_ds_mla"
    if args.kv_cache_dtype not in ("fp8_ds_mla", "bf16"):
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype!r}: a DSA latent cache is fp8_ds_mla or bf16")
    L, mtp = plan.num_hidden_layers, plan.num_nextn_predict_layers
    bounds = stage_bounds(L, args.pp)
    full_first = stage_start_full_pattern(plan.pattern, L, args.pp)
    fallback = plan if full_first == plan.pattern else build_layer_plan(L, mtp, use_index_cache=True,
                                                                       index_topk_pattern=full_first)
    dims = {k: config[k] for k in ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim") if k in config}
    topk = int(config.get("index_topk", 2048))
    plans = {}
    for name, p in (("handoff", plan), ("stage_starts_full", fallback)):
        handoffs = [b for b in bounds[1:-1] if p.skip_topk[b]]
        entry = {"pattern": p.pattern, "num_full": p.num_full, "num_shared": p.num_shared,
                 "costs": indexer_costs(p, args.context, dims),
                 "stages_starting_on_s": handoffs, "topk_bytes_per_token_handed_off": 4 * topk * len(handoffs)}
        if args.gpu_mem:
            entry["memory"] = scaleout_budget(config, p.skip_topk, args.tp, args.pp, args.gpu_mem * 1e9,
                                              args.kv_cache_dtype)
        plans[name] = entry
    out = {"tp": args.tp, "pp": args.pp, "stage_bounds": bounds, "plans": plans}
    if args.gpu_mem:
        all_f = build_layer_plan(L, mtp)
        out["all_f_memory"] = scaleout_budget(config, all_f.skip_topk, args.tp, args.pp, args.gpu_mem * 1e9,
                                              args.kv_cache_dtype)
    return out


def _print_scaleout(so: dict) -> None:
    if "plan_memory" in so:  # a hybrid family: per-GPU memory only
        from indexcache.models.hybrid_sizing import print_hybrid_scaleout
        return print_hybrid_scaleout(so)
    print(f"\nScale-out: tp {so['tp']} x pp {so['pp']}; stages start at layers {so['stage_bounds'][:-1]}")
    names = ("handoff", "stage_starts_full") if so["pp"] > 1 else ("handoff",)
    for name, label in (("handoff", "as given, top-k rows handed to the next stage"),
                        ("stage_starts_full", "engines' fallback, each stage's first layer F"))[:len(names)]:
        e = so["plans"][name]
        c = e["costs"]
        print(f"  {label}: {e['pattern']} ({e['num_full']} F / {e['num_shared']} S)")
        print(f"    indexer FLOPs per generated token {_human(c['decode_flops_per_token']['plan'], 'FLOP')}, "
              f"index-K per sequence {_human(c['index_k_cache_bytes_per_sequence']['plan'], 'B')}, "
              f"top-k rows handed off {e['topk_bytes_per_token_handed_off']} B/token "
              f"(stages starting on S: {e['stages_starting_on_s'] or 'none'})")
    if "all_f_memory" not in so:
        return
    base = so["all_f_memory"]
    print(f"  per GPU ({base['gpu_bytes'] / 1e9:.0f} GB, KV cache {base['kv_cache_dtype']}; activations not counted):")
    print(f"    {'plan':<18} {'stage':>5} {'weights':>11} {'KV B/token':>11} {'index-K B/token':>16} {'tokens fit':>12}")
    rows = [("all F", base)] + [(n if so["pp"] > 1 else "plan", so["plans"][n]["memory"]) for n in names]
    for name, m in rows:
        for st in m["stages"]:
            print(f"    {name:<18} {st['stage']:>5} {_human(st['weight_bytes'], 'B'):>11} {st['kv_bytes_per_token']:>11} "
                  f"{st['index_k_bytes_per_token']:>16} {st['tokens_fit']:>12}")
    for name in names:
        m = so["plans"][name]["memory"]
        more = m["tokens_fit"] - base["tokens_fit"]
        print(f"    {name if so['pp'] > 1 else 'plan'}: {m['tokens_fit']} tokens of context per GPU, {more:+d} against all F "
              f"({100 * more / max(base['tokens_fit'], 1):+.1f}%)")


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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (per-GPU memory)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: the plan as given and the engines' fallback")
    p.add_argument("--gpu-mem", type=float, default=None, metavar="GB",
                   help="GPU memory (10^9 bytes): weights, cache bytes per token and tokens that fit per GPU "
                        "(needs --config)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["fp8_ds_mla", "bf16", "auto", "fp32"],
                   help="cache format for --gpu-mem: DSA fp8_ds_mla (default) or bf16; GLM-5.3-Flash / "
                        "Qwen3.8-Flash-Next auto (= bf16, default), bf16 or fp32")
    p.add_argument("--num-seqs", type=int, default=1,
                   help="requests live at once: their linear-attention state is taken off before the tokens "
                        "that fit (GLM-5.3-Flash, Qwen3.8-Flash-Next)")
    p.set_defaults(func=cmd_plan)
    from indexcache.cli.generate import add_generate_parser

    add_generate_parser(sub)
    from indexcache.cli.pattern_commands import add_pattern_parsers

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
