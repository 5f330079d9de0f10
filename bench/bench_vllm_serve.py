"""``vllm serve`` + ``vllm bench serve`` (vLLM's own client) through the indexcache plugin: all-F vs IndexCache.

Runs in .venv-vllm (``bash scripts/setup_vllm.sh``)::

    .venv-vllm/bin/python bench/bench_vllm_serve.py --input-len 6144 --range-ratio 0.33 --output-len 32 \\
        --num-prompts 4 --rounds 2 --result-dir docs/results

A random GLM-5-shaped checkpoint with the production attention widths (latent 512 + rope 64, indexer
heads of 128, ``index_topk`` 2048 by default) and a small hidden size and layer count is written once by
transformers, with a character-level tokenizer over its 512 token ids: token ``i`` is the one character
U+4E00 + i. vLLM's random dataset decodes token ids to text and encodes them again, which this tokenizer
maps back to the same ids, and a prompt of n tokens is n characters, within the server's guard of the
longest token's length per token ("your prompt contains N characters (more than ...)").
For every round, each setting in turn (the order alternates between rounds) gets a fresh
``vllm serve`` process on a free port of 127.0.0.1; once ``/health`` answers, one warm-up request is
sent and ``vllm bench serve --dataset-name random`` runs against it with the same seed (the same
prompts for every setting and round); then the server's process group is stopped. The load average is
read before and after each client run. Prints request throughput, TTFT and TPOT per setting (median
over rounds, with min/max) and the ratio of each setting to the first, keeps vLLM's result JSON of
every run and writes one summary JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm import cpu_model, write_checkpoint  # noqa: E402

from indexcache.integrations.vllm_server import free_port, http, start, stop, wait_ready  # noqa: E402

VLLM_BIN = Path(sys.executable).with_name("vllm")
VOCAB = 512  # write_checkpoint's vocab_size
FIRST_CHAR = 0x4E00  # CJK ideographs: word characters, one each
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_e2el_ms")
START_TIMEOUT_S = 600


def write_tokenizer(path: Path) -> None:
    """One character per token id: decode(ids) is len(ids) characters and encodes back to exactly ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={chr(FIRST_CHAR + i): i for i in range(VOCAB)},
                                   unk_token=chr(FIRST_CHAR)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def settings(freqs: list[int], reuse: list[int]) -> list[tuple[str, dict | None]]:
    """(name, --hf-overrides) per IndexCache frequency and ``index_reuse_steps``: freq 1 with R 1 is all-F
    (no overrides)."""
    out = []
    for f in freqs:
        for r in reuse:
            if f < 1 or r < 1:
                raise ValueError(f"--freqs / --reuse: every value must be >= 1, got freq {f}, reuse {r}")
            if f == 1 and r == 1:
                out.append(("all-F", None))
                continue
            over = {"use_index_cache": True, "index_topk_freq": f}
            if r > 1:
                over["index_reuse_steps"] = r
            out.append(((f"freq {f}" if f > 1 else "all-F") + (f" R{r}" if r > 1 else ""), over))
    return out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def serve_command(args, ckpt: Path, port: int, overrides: dict | None) -> list[str]:
    cmd = [str(VLLM_BIN), "serve", str(ckpt), "--served-model-name", "glm5-shaped", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--kv-cache-memory-bytes", str(args.kv_mib << 20), "--seed", "0"]
    if overrides is not None:
        cmd += ["--hf-overrides", json.dumps(overrides)]
    return cmd


def client_command(args, ckpt: Path, port: int, result_dir: Path, filename: str) -> list[str]:
    cmd = [str(VLLM_BIN), "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
           "--model", "glm5-shaped", "--tokenizer", str(ckpt), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-range-ratio", str(args.range_ratio),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--ignore-eos", "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", filename]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    return cmd


def one_run(args, ckpt: Path, name: str, overrides: dict | None, rnd: int, result_dir: Path, logs: Path) -> dict:
    port = free_port()
    tag = name.replace(" ", "")
    log = logs / f"serve_{tag}_r{rnd}.log"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = start(serve_command(args, ckpt, port, overrides), log)
    try:
        base = f"http://127.0.0.1:{port}"
        start_s = wait_ready(proc, base, log, START_TIMEOUT_S)
        http(base + "/v1/completions", {"model": "glm5-shaped", "prompt": [1, 2, 3, 4], "max_tokens": 2,
                                        "ignore_eos": True, "temperature": 0.0})
        filename = f"vllm_bench_serve_{tag}_r{rnd}.json"
        cmd = client_command(args, ckpt, port, result_dir, filename)
        load_before = loadavg()
        t0 = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.client_timeout, env=env)
        wall = time.monotonic() - t0
        load_after = loadavg()
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
        plan = next((ln.split("indexcache: ", 1)[1] for ln in log.read_text().splitlines()
                     if "IndexCache plan" in ln), "no IndexCache plan logged")
    finally:
        stop(proc)
    result = json.loads((result_dir / filename).read_text())
    if result.get("completed") != args.num_prompts:
        raise RuntimeError(f"{name}, round {rnd}: {result.get('completed')} of {args.num_prompts} requests completed; "
                           f"client output:\n{done.stdout[-3000:]}")
    row = {"setting": name, "round": rnd, "overrides": overrides, "result_json": str(result_dir / filename),
           "plan": plan, "server_start_s": round(start_s, 1), "client_wall_s": round(wall, 1),
           "load_before": load_before, "load_after": load_after, "completed": result.get("completed"),
           "total_input_tokens": result.get("total_input_tokens")}
    row.update({m: result.get(m) for m in METRICS})
    print(f"  round {rnd} {name:>8}: {row['request_throughput']:.4f} req/s, TTFT median "
          f"{row['median_ttft_ms']:.0f} ms, TPOT median {row['median_tpot_ms']:.1f} ms "
          f"(load {load_before[0]} -> {load_after[0]}; {plan})", flush=True)
    return row


def summarize(rows: list[dict], names: list[str]) -> dict:
    out = {}
    for n in names:
        mine = [r for r in rows if r["setting"] == n]
        out[n] = {m: {"median": statistics.median(r[m] for r in mine), "min": min(r[m] for r in mine),
                      "max": max(r[m] for r in mine)} for m in METRICS}
    return out


def print_table(summary: dict, names: list[str]) -> None:
    base = names[0]
    head = f"{'metric':>20}" + "".join(f"{n + ' median [min, max]':>34}" for n in names)
    head += "".join(f"{n + ' / ' + base:>16}" for n in names[1:])
    print(head)
    for m in METRICS:
        line = f"{m:>20}"
        for n in names:
            s = summary[n][m]
            line += f"{s['median']:>14.4g} [{s['min']:.4g}, {s['max']:.4g}]".rjust(34)
        for n in names[1:]:
            line += f"{summary[n][m]['median'] / summary[base][m]['median']:>16.3f}"
        print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input-len", type=int, default=6144)
    ap.add_argument("--range-ratio", type=float, default=0.33)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-concurrency", type=int, default=1,
                    help="requests in flight at once (0: all at once)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--freqs", type=int, nargs="+", default=[1, 4], help="1 is all-F (no overrides)")
    ap.add_argument("--reuse", type=int, nargs="+", default=[1],
                    help="index_reuse_steps per frequency (1: every decode step computes)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--index-heads", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-timeout", type=float, default=1800)
    ap.add_argument("--checkpoint", type=Path, help="reuse this directory (written there if it has no config.json)")
    ap.add_argument("--result-dir", type=Path, default=Path("."))
    ap.add_argument("--json", type=Path, help="summary JSON (default: <result-dir>/bench_vllm_serve.json)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.num_prompts < 1:
        raise ValueError("--rounds and --num-prompts must be >= 1")
    if args.range_ratio < 0 or args.range_ratio >= 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    longest = int(args.input_len * (1 + args.range_ratio)) + args.output_len
    args.max_model_len = longest + 64
    todo = settings(args.freqs, args.reuse)
    names = [n for n, _ in todo]
    import torch
    import vllm

    args.result_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or Path(tmp) / "ckpt"
        if not (ckpt / "config.json").exists():
            ckpt.mkdir(parents=True, exist_ok=True)
            write_checkpoint(ckpt, args.layers, args.hidden, args.topk, heads=args.heads,
                             index_heads=args.index_heads, max_positions=max(8192, args.max_model_len))
            write_tokenizer(ckpt)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        rows = []
        for rnd in range(args.rounds):
            for name, overrides in (todo if rnd % 2 == 0 else todo[::-1]):
                rows.append(one_run(args, ckpt, name, overrides, rnd, args.result_dir, logs))
    summary = summarize(rows, names)
    info = {"started_utc": started, "cpu": cpu_model(), "cores": os.cpu_count(), "vllm": vllm.__version__,
            "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
            "serve_command": " ".join(serve_command(args, Path("CKPT"), 0, todo[-1][1])),
            "client_command": " ".join(client_command(args, Path("CKPT"), 0, Path("DIR"), "FILE")),
            "rows": rows, "summary": summary}
    print(f"\nvLLM {vllm.__version__} CPU ({info['cpu']}, {info['cores']} cores); GLM-5-shaped random checkpoint: "
          f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, latent 512 + rope 64, indexer "
          f"{args.index_heads} x 128, index_topk {args.topk}; bf16; random dataset, input {args.input_len} "
          f"(range ratio {args.range_ratio}), output {args.output_len}, {args.num_prompts} prompts, "
          f"max concurrency {args.max_concurrency or 'all'}; median over {args.rounds} rounds [min, max]")
    print_table(summary, names)
    out = args.json or args.result_dir / "bench_vllm_serve.json"
    out.write_text(json.dumps(info, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
