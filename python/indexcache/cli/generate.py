"""``indexcache generate``: run a DSA model (DeepSeek-V3.2 or GLM-5.x) on a prompt.

Without ``--model`` it runs on the embedded tiny default (built on first use, see
:mod:`indexcache.models.tiny`). Prints the IndexCache plan, the text, and prefill / decode
tokens per second.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text with a DSA model (DeepSeek-V3.2, GLM-5.x)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--hf-overrides", default=None, help="JSON object, as vLLM's --hf-overrides")
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text")
    p.add_argument("--repeat-prompt", type=int, default=1, metavar="N",
                   help="use the prompt text N times over (a long context from a short prompt)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens per step (0 = off)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp32", "fp8_ds_mla"])
    p.add_argument("--indexer-fp32", action="store_true", help="score the indexer in fp32 instead of fp8")
    p.add_argument("--prefill-chunk-size", type=int, default=None, help="tokens per prefill forward")
    p.add_argument("--decode-step", default="auto", choices=["auto", "eager", "static", "graph", "compiled"],
                   help="plain decode steps: auto = a CUDA graph on CUDA when the model allows, else eager; "
                        "compiled = the step compiled by torch.compile on the CPU (the first step compiles: "
                        "seconds, timed apart)")
    p.add_argument("--decode-threads", default="auto", metavar="auto|N",
                   help="CPU threads per decode step: auto = the count whose first steps time fastest")
    p.add_argument("--prefill-threads", default="auto", metavar="auto|N",
                   help="CPU threads for prefill: auto = for prompts of 256+ tokens, the count a short matmul "
                        "probe times fastest (runtime/threads.py; shorter prompts keep torch's count)")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up run before timing")
    p.add_argument("--compare", action="append", default=[], metavar="JSON",
                   help="also run with these --hf-overrides (repeatable) and print every run side by side, "
                        "e.g. '{\"use_index_cache\": true, \"index_topk_freq\": 4}'")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list, one per run, with --compare)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (under torchrun; default: world size / --pp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (under torchrun)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp8", "bf16"],
                   help="auto: an FP8 checkpoint stays FP8 in memory; bf16: dequantize at load")
    p.add_argument("--pp-stage-starts-full", action="store_true",
                   help="force the first layer of every pipeline stage to F (the engines' fallback)")
    p.set_defaults(func=cmd_generate)
    return p


def _threads(text: str, flag: str = "--decode-threads"):
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{flag} {text!r}: give 'auto' or a count >= 1")
    return int(text)


def _run(path, overrides, args, tokenizer):
    from indexcache.runtime import generate
    from indexcache.models import from_pretrained

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = from_pretrained(
            path, hf_overrides=overrides, dtype=args.dtype, device=args.device,
            indexer_fp8=False if args.indexer_fp32 else None, tp_size=args.tp, pp_size=args.pp,
            weights=args.weights, pp_stage_starts_full=args.pp_stage_starts_full)
    notes = list(dict.fromkeys(str(w.message) for w in caught))
    ids = tokenizer.encode(args.prompt * args.repeat_prompt)
    if not ids:
        raise ValueError("empty prompt")
    kw = dict(temperature=args.temperature, top_p=args.top_p, num_speculative_tokens=args.num_speculative_tokens,
              kv_cache_dtype=args.kv_cache_dtype, prefill_chunk_size=args.prefill_chunk_size, seed=args.seed,
              decode_step=args.decode_step, decode_threads=args.decode_threads, prefill_threads=args.prefill_threads)
    if not args.no_warmup:  # first calls pay one-off kernel setup; keep it out of the timings
        # (eager for a compiled run: its step compiles for the timed run's shapes, timed apart there)
        generate(model, [ids[:8]], 2, **dict(kw, decode_step="eager") if args.decode_step == "compiled" else kw)
    res = generate(model, [ids], args.max_new_tokens, **kw)
    return model, res, tokenizer.decode(res.tokens[0]), notes


def _threads_note(res, device: str) -> str:
    import torch

    if device != "cpu":
        return "host threads n/a"
    return f"{res.decode_threads} of {torch.get_num_threads()} threads"


def _prefill_threads_note(res, device: str) -> str:
    import torch

    if device != "cpu":
        return ""
    return f", {res.prefill_threads} of {torch.get_num_threads()} threads"


def _quiet_unless_rank0() -> bool:
    """Under torchrun every rank runs the same generation; only rank 0 prints."""
    import os
    if int(os.environ.get("RANK", "0")) == 0:
        return True
    sys.stdout = open(os.devnull, "w")
    return False


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from indexcache.config import parse_overrides
    from indexcache.runtime import load_tokenizer
    from indexcache.loader import load_config
    from indexcache.models.tiny import embedded_model_path

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    if args.max_new_tokens < 1 or args.repeat_prompt < 1:
        raise ValueError("--max-new-tokens and --repeat-prompt must be >= 1")
    args.decode_threads = _threads(args.decode_threads)  # None for auto
    args.prefill_threads = _threads(args.prefill_threads, "--prefill-threads")
    from indexcache.parallel import init_from_env
    if init_from_env(args.device):  # launched by torchrun: one process per rank
        _quiet_unless_rank0()
    embedded = args.model is None
    path = embedded_model_path() if embedded else args.model
    tokenizer = load_tokenizer(path, load_config(path))
    for ov in args.compare:
        parse_overrides(ov)  # a bad JSON fails before any load
    runs = [(ov, *_run(path, ov, args, tokenizer)) for ov in [args.hf_overrides] + args.compare]
    if args.json:
        out = [{
            "model": str(path), "embedded_default": embedded, "hf_overrides": ov, "pattern": m.plan.pattern,
            "num_full": m.plan.num_full, "num_shared": m.plan.num_shared, "prompt": args.prompt * args.repeat_prompt,
            "completion": text, "tokens": res.tokens[0], "finish_reason": res.finish_reasons[0],
            "prompt_tokens": res.prompt_tokens, "prefill_seconds": res.prefill_seconds,
            "prefill_tokens_per_s": res.prefill_tokens_per_s, "decode_tokens": res.decode_tokens,
            "decode_seconds": res.decode_seconds, "decode_tokens_per_s": res.decode_tokens_per_s,
            "acceptance_rate": res.acceptance_rate, "decode_step": res.decode_step,
            "compile_seconds": res.compile_seconds,
            "decode_threads": res.decode_threads, "prefill_threads": res.prefill_threads, "warnings": notes,
        } for ov, m, res, text, notes in runs]
        print(json.dumps(out[0] if len(out) == 1 else out))
        return 0
    from indexcache.models.tiny import is_shipped

    kind = "trained on the standard library" if is_shipped(path) else "random weights"
    where = f"{path} (embedded default, {kind})" if embedded else str(path)
    print(f"model: {where}; {args.device} {args.dtype}; indexer {'fp32' if args.indexer_fp32 else 'fp8'}")
    for ov, model, res, text, notes in runs:
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
        print(f"\n== --hf-overrides {ov or '(none)'}")
        print(model.plan_summary())
        print("--- text ---")
        prompt = args.prompt * args.repeat_prompt
        print((f"[... {len(prompt) - 120} chars] " + prompt[-120:] if len(prompt) > 200 else prompt) + text)
        print("------------")
        line = (f"prefill: {res.prompt_tokens} tokens in {res.prefill_seconds:.3f} s ({res.prefill_tokens_per_s:.1f} tok/s"
                f"{_prefill_threads_note(res, args.device)}); "
                f"decode: {res.decode_tokens} tokens in {res.decode_seconds:.3f} s ({res.decode_tokens_per_s:.1f} tok/s, "
                f"{res.decode_step} steps, {_threads_note(res, args.device)})")
        if res.decode_step == "compiled":
            line += f"; compiling took {res.compile_seconds:.1f} s (its first steps, not in the decode figure)"
        if res.acceptance_rate is not None:
            line += f"; MTP acceptance {res.acceptance_rate:.2f} ({res.accepted_tokens}/{res.draft_tokens})"
        print(line)
    if len(runs) > 1:
        first = runs[0][2]
        print(f"\n{'run':<9} {'pattern':<24} {'F/S':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'speedup':>15} "
              f"{'tokens as first':>16}")
        for i, (ov, model, res, _, _) in enumerate(runs):
            fs = f"{model.plan.num_full}/{model.plan.num_shared}"
            same = next((j for j, (a, b) in enumerate(zip(res.tokens[0], first.tokens[0])) if a != b),
                        min(len(res.tokens[0]), len(first.tokens[0])))
            speed = (f"x{res.prefill_tokens_per_s / first.prefill_tokens_per_s:.2f}/"
                     f"x{res.decode_tokens_per_s / first.decode_tokens_per_s:.2f}")
            print(f"{'first' if i == 0 else f'compare {i}':<9} {model.plan.pattern:<24} {fs:>7} "
                  f"{res.prefill_tokens_per_s:>14.1f} {res.decode_tokens_per_s:>13.1f} {speed:>15} "
                  f"{f'{same}/{len(first.tokens[0])}':>16}")
        print("speedup: prefill/decode against the first run; tokens as first: how many leading generated "
              "tokens equal the first run's")
    return 0
