"""vLLM CPU throughput of a DSA model through the indexcache plugin: IndexCache freq 1 vs freq 4.

Runs in .venv-vllm (``bash scripts/setup_vllm.sh``)::

    .venv-vllm/bin/python bench/bench_vllm.py --requests 1 4 --prompt-len 512 --decode 32 --repeats 3

A random GLM-5-shaped checkpoint (production latent widths 512 + 64, indexer 128; small hidden size
and layer count so that the indexer and attention are a visible share of the work) is written once
by transformers. For each setting and request count the engine serves ``requests`` prompts of
``prompt-len`` tokens: prefill tokens/s from a 1-token generation, decode tokens/s from the extra time
of a ``decode``-token generation. Medians over ``repeats``. Prints a table and writes JSON.

With ``--model DIR`` an existing checkpoint is served instead (bench/bench_llamacpp.py's, to set vLLM
beside llama.cpp and ``indexcache generate`` on the same weights), one request at a time, each decode
step timed alone through the engine's step loop; the engine's threads are the process's (vLLM's CPU
worker binds ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0`` or ``0-1``)::

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python bench/bench_vllm.py \
        --model /work/llcache/models/glm5-L8-h512-k512-s0-all-F --prompt-len 2048 --decode 64 --repeats 3

``--modes eager compiled`` times vLLM's eager model (its default for the DSA architectures) and its
compiled one (``VLLM_USE_BREAKABLE_CUDAGRAPH=0``: torch.compile, traced once, inductor) side by side,
with the engine's start-up time (the compile is in it). Each configuration (freq, mode) runs in a
child process of its own, as a served model does, so no engine's compile or process state reaches
the next (with a since-removed indexer split, ``--freqs 4 1`` in one process crashed in the second
engine, docs/vllm.md); ``--in-process`` measures them all in this process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402


def write_checkpoint(path: Path, layers: int, hidden: int, topk: int, seed: int = 0, heads: int = 8,
                     index_heads: int = 8, max_positions: int = 8192) -> Path:
    import transformers

    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=hidden, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, index_topk=topk, index_head_dim=128, index_n_heads=index_heads,
        first_k_dense_replace=1, max_position_embeddings=max_positions, routed_scaling_factor=2.5, n_group=1,
        topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid")
    model = transformers.GlmMoeDsaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def measure(path, freq: int, requests: list[int], prompt_len: int, decode: int, repeats: int, kv_mib: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    overrides = {"use_index_cache": True, "index_topk_freq": freq, "index_skip_topk_offset": 1}
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=prompt_len + decode + 8,
              kv_cache_memory_bytes=kv_mib << 20, enforce_eager=True, seed=0, hf_overrides=overrides,
              max_num_seqs=max(requests), max_num_batched_tokens=max(requests) * prompt_len)
    g = torch.Generator().manual_seed(1)
    rows = []
    try:
        def run(n, max_tokens):
            ps = [TokensPrompt(prompt_token_ids=torch.randint(0, 512, (prompt_len,), generator=g).tolist())
                  for _ in range(n)]
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
            t0 = time.perf_counter()
            llm.generate(ps, sp, use_tqdm=False)
            return time.perf_counter() - t0

        run(1, 2)  # warm-up
        for n in requests:
            pre, dec = [], []
            for _ in range(repeats):
                t_pre = run(n, 1)
                t_all = run(n, 1 + decode)
                pre.append(n * prompt_len / t_pre)
                dec.append(n * decode / max(t_all - t_pre, 1e-9))
            rows.append({"freq": freq, "requests": n, "prefill_tok_s": statistics.median(pre),
                         "decode_tok_s": statistics.median(dec)})
    finally:
        del llm
        gc.collect()
    return rows


def engine_mode(mode: str) -> dict:
    """LLM keywords for ``eager`` (what vLLM runs the DSA architectures as by default: it defaults them to
    breakable CUDA graphs, which turns compilation off on every platform) or ``compiled`` (vLLM's CPU
    default for other models: torch.compile traced once, inductor)."""
    if mode == "compiled":
        if os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") != "0":  # vLLM caches its settings once an engine ran
            raise RuntimeError("compiled mode: set VLLM_USE_BREAKABLE_CUDAGRAPH=0 before the first engine "
                               "(main() does)")
        return {"enforce_eager": False}
    if mode != "eager":
        raise ValueError(f"mode {mode!r}: eager or compiled")
    return {"enforce_eager": True}


def measure_steps(path, freq: int, prompt_len: int, decode: int, repeats: int, kv_mib: int, vocab: int,
                  mode: str = "eager"):
    """One request at a time through the engine's own step loop (``LLMEngine.add_request`` /
    ``step``): prefill tokens/s from the first step, decode tokens/s from the median of the
    ``decode`` steps after it (each step's wall time alone, so a noisy prefill does not enter it);
    median, min and max over ``repeats`` requests."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    overrides = {"use_index_cache": True, "index_topk_freq": freq, "index_skip_topk_offset": 1}
    t0 = time.perf_counter()
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=prompt_len + decode + 8,
              kv_cache_memory_bytes=kv_mib << 20, seed=0, hf_overrides=overrides,
              max_num_seqs=1, max_num_batched_tokens=prompt_len, enable_prefix_caching=False, **engine_mode(mode))
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(1)
    pre, dec = [], []
    try:
        for rep in range(repeats + 1):  # the first request warms up
            prompt = TokensPrompt(prompt_token_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist())
            sp = SamplingParams(temperature=0.0, max_tokens=1 + decode, ignore_eos=True, detokenize=False)
            engine.add_request(f"r{rep}", prompt, sp)
            times = []
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            if rep:
                pre.append(prompt_len / times[0])
                dec.append(1.0 / statistics.median(times[1:]))
    finally:
        del llm
        gc.collect()
    return [{"freq": freq, "mode": mode, "start_s": start_s, "requests": 1, "context": prompt_len,
             "threads": torch.get_num_threads(),
             "prefill_tok_s": statistics.median(pre), "decode_tok_s": statistics.median(dec),
             "decode_tok_s_min": min(dec), "decode_tok_s_max": max(dec)}]


def child_rows(args, freq: int, mode: str) -> list:
    """measure_steps for one configuration in a fresh process (this script with ``--in-process``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, "--model", args.model, "--prompt-len", str(args.prompt_len),
               "--decode", str(args.decode), "--repeats", str(args.repeats), "--kv-mib", str(args.kv_mib),
               "--freqs", str(freq), "--modes", mode, "--in-process", "--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rows"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--freqs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kv-mib", type=int, default=256)
    ap.add_argument("--json", default="bench_vllm.json")
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "compiled"],
                    help="with --model: eager (vLLM's default for DSA architectures) and/or compiled "
                         "(VLLM_USE_BREAKABLE_CUDAGRAPH=0: vLLM's CPU torch.compile), interleaved per freq")
    ap.add_argument("--model", help="serve this checkpoint (e.g. bench_llamacpp.py's) instead of writing one; "
                                    "one request at a time, decode timed step by step (measure_steps)")
    ap.add_argument("--in-process", action="store_true",
                    help="with --model: every configuration in this process, not one child process each")
    args = ap.parse_args(argv)
    if "compiled" in args.modes:
        # vLLM sets this to 1 for the DSA architectures unless it is set, and reads it once per process;
        # an eager engine (enforce_eager) is the same model either way
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
    import vllm

    if args.model:
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        rows = []
        for freq in args.freqs:
            for mode in args.modes:
                if args.in_process:
                    rows += measure_steps(args.model, freq, args.prompt_len, args.decode, args.repeats,
                                          args.kv_mib, vocab, mode)
                else:
                    rows += child_rows(args, freq, mode)
        for r in rows:
            print(f"freq {r['freq']}, {r['mode']} (engine start {r['start_s']:.0f} s), context {r['context']}, "
                  f"{r['threads']} threads: prefill {r['prefill_tok_s']:.1f} "
                  f"tok/s, decode {r['decode_tok_s']:.1f} tok/s ({r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f})")
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "vllm": vllm.__version__, "torch": torch.__version__,
                                               "args": vars(args), "rows": rows}, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp), args.layers, args.hidden, args.topk)
        rows = []
        for freq in args.freqs:
            rows += measure(path, freq, args.requests, args.prompt_len, args.decode, args.repeats, args.kv_mib)
    info = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "vllm": vllm.__version__,
            "torch": torch.__version__, "args": vars(args), "rows": rows}
    print(f"vLLM {vllm.__version__} CPU, {info['cpu']}; GLM-5-shaped random model, {args.layers} layers, "
          f"hidden {args.hidden}, index_topk {args.topk}, prompts of {args.prompt_len}, {args.decode} decode steps, "
          f"bf16, median of {args.repeats}")
    print(f"{'freq':>4} {'requests':>8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for r in rows:
        print(f"{r['freq']:>4} {r['requests']:>8} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.2f}")
    Path(args.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
