"""llama.cpp side by side with this package on the same GLM-5 checkpoint (issue 33).

One random GLM-5 (``GlmMoeDsaForCausalLM``) checkpoint is written by transformers'
``save_pretrained`` twice: all indexers full, and ``indexer_types`` 1 in 4 full (IndexCache).
llama.cpp's own converter (``convert_hf_to_gguf.py`` from the ``llama-cpp-python`` sdist's vendored
source) turns each into BF16 (and f32) GGUF; llama.cpp is built CPU-only once into the cache
folder. Then, the two engines alternating, every (context, threads, config) is timed ``--repeat``
times: prefill of a ``context``-token prompt and ``--gen`` decode steps after it (``llama-bench
-p -n`` there; ``indexcache.runtime.generate`` here). A correctness line compares greedy tokens
(``llama-completion --temp 0`` against our greedy generate on the same token ids; in f32 both also
against transformers' own ``GlmMoeDsaForCausalLM``) and a memory line the KV + index-K cache bytes
per token of context.

The tokenizer: llama.cpp's converter accepts only BPE tokenizers whose hash it knows, so the
checkpoint ships GPT-2's byte-level BPE rebuilt from llama.cpp's own ``models/ggml-vocab-gpt-2.gguf``
(the converter then recognises it as ``gpt-2``), plus the added tokens its GLM vocab step reads.

    python bench/bench_llamacpp.py --contexts 2048,8192 --repeat 3 --threads 2 --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SDIST = "llama_cpp_python-0.3.36"
GLM_SPECIALS = ["[gMASK]", "<|user|>", "<|observation|>"]
LLAMA_TARGETS = ["llama-bench", "llama-completion", "llama-tokenize"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def llama_source(cache: Path) -> Path:
    """The vendored llama.cpp of the sdist, downloaded and unpacked into ``cache`` once."""
    src = cache / SDIST / "vendor" / "llama.cpp"
    if src.is_dir():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"{SDIST}.tar.gz"
    if not tarball.exists():
        version = SDIST.split("-")[1]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "-d", str(cache), f"llama-cpp-python=={version}"], check=True)
    with tarfile.open(tarball) as tf:
        tf.extractall(cache, filter="data")
    return src


def llama_build(cache: Path, src: Path, jobs: int) -> Path:
    """CPU-only Release build (GGML_NATIVE) of the binaries this bench runs, into ``cache/build``."""
    build = cache / "build"
    bins = build / "bin"
    if all((bins / t).exists() for t in LLAMA_TARGETS):
        return bins
    log(f"building llama.cpp into {build} (several minutes)")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(build), f"-j{jobs}", "--target", *LLAMA_TARGETS],
                   check=True, stdout=subprocess.DEVNULL)
    return bins


def gguf_module(src: Path):
    sys.path.insert(1, str(src / "gguf-py"))
    import gguf
    return gguf


def gpt2_tokenizer(src: Path):
    """GPT-2's byte-level BPE (vocab + merges read from llama.cpp's ``ggml-vocab-gpt-2.gguf``) with
    the GLM added tokens appended, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    reader = gguf_module(src).GGUFReader(str(src / "models" / "ggml-vocab-gpt-2.gguf"))

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    vocab = {tok: i for i, tok in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": GLM_SPECIALS})
    return fast


def glm_config(args, vocab_size: int, indexer_types: list):
    import transformers
    L = args.layers
    return transformers.GlmMoeDsaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=L, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        kv_lora_rank=512, q_lora_rank=args.hidden // 2, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, head_dim=64, index_topk=args.topk, index_head_dim=128, index_n_heads=args.index_heads,
        first_k_dense_replace=1, mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
        layer_types=["indexed_attention"] * L, indexer_types=indexer_types,
        max_position_embeddings=131072, routed_scaling_factor=2.5,
        n_group=1, topk_group=1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        topk_method="noaux_tc", scoring_func="sigmoid")


def ic_types(layers: int) -> list:
    """``indexer_types`` of ``index_topk_freq`` 4 at the default offset 2 (DESIGN §2): F {0, 1, 5, ...}."""
    return ["full" if max(i - 1, 0) % 4 == 0 else "shared" for i in range(layers)]


def write_checkpoints(args, src: Path, work: Path) -> dict:
    """{"all-F": dir, "IndexCache": dir}: the same weights, ``indexer_types`` all full vs 1 in 4
    (the shared layers' indexer weights are not saved: transformers builds none there)."""
    import torch
    import transformers

    from indexcache.tools.random_weights import randomize_
    tok = gpt2_tokenizer(src)
    plans = {"all-F": ["full"] * args.layers, "IndexCache": ic_types(args.layers)}
    shape = f"L{args.layers}-h{args.hidden}-k{args.topk}-s{args.seed}"
    out = {config: work / f"glm5-{shape}-{config}" for config in plans}
    if all((p / "config.json").exists() for p in out.values()):
        return out
    state = None
    for config, types in plans.items():
        model = transformers.GlmMoeDsaForCausalLM(glm_config(args, len(tok), types))
        if state is None:
            randomize_(model, args.seed)
            state = model.state_dict()
        else:
            model.load_state_dict(state, strict=False)
        model.to(torch.bfloat16).save_pretrained(out[config])
        tok.save_pretrained(out[config])
    return out


def convert(src: Path, ckpt: Path, outtype: str) -> Path:
    """``convert_hf_to_gguf.py --outtype`` (llama.cpp's converter, run as shipped) -> GGUF path."""
    out = ckpt.parent / f"{ckpt.name}-{outtype}.gguf"
    if not out.exists():
        env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(ckpt), "--outtype", outtype,
                        "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split())
    return {"cpu": model, "cores": os.cpu_count(), "loadavg": os.getloadavg(),
            "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}}


def llama_bench(bins: Path, gguf: Path, args: list, threads: int) -> float:
    """tokens/s of one ``llama-bench`` test (one repetition: this bench repeats and interleaves)."""
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    return float(rows[-1]["avg_ts"])


def llama_run(bins: Path, gguf: Path, ctx: int, gen: int, threads: int) -> dict:
    """Prefill of a ``ctx``-token prompt (``-p ctx``) and ``gen`` decode steps after ``ctx`` tokens
    of context (``-n gen -d ctx``), random tokens as llama-bench draws them."""
    prefill = llama_bench(bins, gguf, ["-p", str(ctx), "-n", "0"], threads)
    decode = llama_bench(bins, gguf, ["-p", "0", "-n", str(gen), "-d", str(ctx)], threads)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def ours_run(model, ctx: int, gen: int, threads: int, seed: int, decode_step: str = "eager") -> dict:
    """The same measurement through ``indexcache.runtime.generate``: prefill of ``ctx`` random
    tokens, then ``gen`` decode steps (the first token comes from prefill), greedy, no stop token.
    ``decode_step`` "compiled": the first step compiles and is timed apart (``compile_s``, as
    llama-bench's warm-up run is), then ``gen`` steps are timed."""
    import torch

    from indexcache.runtime import generate
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50000, (ctx,), generator=g).tolist()
    with torch.inference_mode():
        res = generate(model, [ids], max_new_tokens=gen + 1 + (decode_step == "compiled"), stop_tokens=[],
                       decode_threads=threads, prefill_threads=threads, decode_step=decode_step)
    return {"prefill_tok_s": res.prefill_tokens_per_s, "decode_tok_s": res.decode_tokens_per_s,
            "decode_step": res.decode_step, "compile_s": res.compile_seconds}


def ours_cache_bytes(model) -> dict:
    """KV and index-K bytes per token of context of our paged cache (bf16 latent, fp8 index keys)."""
    cache = model.allocate_cache(1)
    per = [cache.layer_bytes(i) for i in range(len(cache.kv))]
    tokens = cache.num_blocks * cache.block_size
    return {"kv_bytes_per_token": sum(p[0] for p in per) / tokens,
            "index_k_bytes_per_token": sum(p[1] for p in per) / tokens,
            "index_k_layers": sum(1 for p in per if p[1])}


KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*K \((\w+)\)")


def llama_cache_bytes(log_text: str) -> dict:
    """From llama.cpp's own log: its DSA cache is two llama_kv_cache instances, the MLA latent one
    and the indexer-key one, in that order (src/llama-kv-cache-dsa.cpp)."""
    rows = [(float(mib) * 2 ** 20 / int(cells), int(layers), t) for mib, cells, layers, t in KV_LINE.findall(log_text)]
    rows = rows[-2:]  # a first pass sizes the context (buffers 0.00 MiB); the last two are the real ones
    if len(rows) != 2:
        return {"unparsed": [ln for ln in log_text.splitlines() if "llama_kv_cache" in ln]}
    return {"kv_bytes_per_token": rows[0][0], "kv_type": rows[0][2], "index_k_bytes_per_token": rows[1][0],
            "index_k_layers": rows[1][1], "index_k_type": rows[1][2]}


def byte_level_chars() -> dict:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tok, ids: list) -> bytes:
    """The raw bytes our token ids stand for (llama.cpp prints raw bytes, not always valid UTF-8)."""
    table = byte_level_chars()
    return bytes(table[c] for t in tok.convert_ids_to_tokens(ids) for c in t)


def llama_greedy(bins: Path, gguf: Path, prompt: str, n: int, threads: int) -> tuple:
    """(prompt token ids, generated bytes, log) of ``llama-completion`` at temperature 0."""
    ids = subprocess.run([str(bins / "llama-tokenize"), "-m", str(gguf), "-p", prompt, "--ids", "--log-disable"],
                         check=True, capture_output=True, text=True).stdout
    ids = json.loads(ids.strip().splitlines()[-1])
    run = subprocess.run([str(bins / "llama-completion"), "-m", str(gguf), "-p", prompt, "-n", str(n),
                          "--temp", "0", "--top-k", "1", "--ignore-eos", "--no-display-prompt", "-no-cnv",
                          "-t", str(threads), "-c", str(len(ids) + n + 64), "--seed", "0", "-v"],
                         check=True, capture_output=True, stdin=subprocess.DEVNULL)
    return ids, run.stdout.removesuffix(b"\n\n"), run.stderr.decode("utf-8", "replace")


def transformers_greedy(ckpt: Path, ids: list, n: int) -> list:
    """transformers' own ``GlmMoeDsaForCausalLM`` (fp32, its ``indexer_types`` from the checkpoint)
    greedy ids after ``ids``: the independent reference for both engines' IndexCache."""
    import torch
    import transformers

    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def correctness(bins: Path, gguf: Path, model, tok, n_prompt: int, n: int, threads: int, seed: int,
                hf_ckpt: Path | None = None) -> dict:
    """Greedy tokens over one prompt: llama.cpp's text against our greedy ids on the token ids
    llama.cpp itself tokenized the prompt to (compared as text, and as the longest equal prefix);
    with ``hf_ckpt``, also both against transformers' greedy ids on the same token ids."""
    import torch

    from indexcache.runtime import generate
    g = torch.Generator().manual_seed(seed)
    prompt = tok.decode(torch.randint(0, 50000, (n_prompt,), generator=g).tolist())
    ids, text, log_text = llama_greedy(bins, gguf, prompt, n, threads)
    torch.set_num_threads(threads)
    with torch.inference_mode():
        ours = generate(model, [ids], max_new_tokens=n, stop_tokens=[], decode_threads=threads).tokens[0]
    equal = max(k for k in range(n + 1) if text.startswith(token_bytes(tok, ours[:k])))
    res = {"prompt_tokens": len(ids), "new_tokens": n, "equal_prefix_tokens": equal,
           "bytes_equal": token_bytes(tok, ours) == text, "memory": llama_cache_bytes(log_text)}
    if hf_ckpt is not None:
        ref = transformers_greedy(hf_ckpt, ids, n)
        res["ours_equal_prefix_vs_transformers"] = next((k for k in range(n) if ours[k] != ref[k]), n)
        res["llama_equal_prefix_vs_transformers"] = max(k for k in range(n + 1)
                                                        if text.startswith(token_bytes(tok, ref[:k])))
    return res


def ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=ints, default=[2048], help="prompt lengths (tokens), comma-separated")
    p.add_argument("--threads", type=ints, default=[2], help="thread counts, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gen", type=int, default=32, help="decode steps timed after each prompt")
    p.add_argument("--dtypes", default="bf16", help="bf16 and/or f32, comma-separated")
    p.add_argument("--configs", default="all-F,IndexCache")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "indexcache" / "llamacpp")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="one 1024-token context, 1 repeat, 16 decode steps")
    p.add_argument("--check-prompt", type=int, default=1024, help="prompt tokens of the greedy check (0: skip)")
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--index-heads", type=int, default=32)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-records", type=Path, default=None,
                   help="only summarise a .records.jsonl of an earlier (possibly cut short) run")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the llama.cpp build")
    p.add_argument("--ours-decode-step", default="compiled", choices=["eager", "compiled"],
                   help="how generate runs our decode steps (compiled: torch.compile on the CPU, its compile "
                        "timed apart as compile_s)")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.repeat, args.gen, args.check_prompt = [1024], 1, 16, 512
    return args


OURS_OVERRIDES = {"all-F": None, "IndexCache": {"use_index_cache": True, "index_topk_freq": 4}}
TORCH_DTYPES = {"bf16": "bfloat16", "f32": "float32"}


def prepare(args) -> tuple:
    """(llama.cpp binaries, {dtype: {config: gguf}}, {dtype: {config: our model}}, llama.cpp source,
    {config: checkpoint})."""
    import torch

    from indexcache.models import from_pretrained
    cache = args.cache_dir.expanduser()
    src = llama_source(cache)
    bins = llama_build(cache, src, args.jobs)
    ckpts = write_checkpoints(args, src, cache / "models")
    ggufs, models = {}, {}
    for dt in args.dtypes.split(","):
        ggufs[dt] = {c: convert(src, ckpts[c], dt) for c in args.configs.split(",")}
        models[dt] = {}
        for c in args.configs.split(","):
            m = from_pretrained(ckpts["all-F"], dtype=getattr(torch, TORCH_DTYPES[dt]), hf_overrides=OURS_OVERRIDES[c])
            shipped = json.loads((ckpts[c] / "config.json").read_text())["indexer_types"]
            if m.plan.pattern != "".join("F" if t == "full" else "S" for t in shipped):
                raise RuntimeError(f"our {c} plan {m.plan.pattern} differs from the shipped indexer_types {shipped}")
            models[dt][c] = m.eval()
    return bins, ggufs, models, src, ckpts


def measure(args, bins, ggufs, models) -> list:
    """One record per run; within each round the engines alternate, who goes first flips per round."""
    records = []
    for rnd in range(args.repeat):
        for ctx in args.contexts:
            for threads in args.threads:
                for dt, per in ggufs.items():
                    for config, gguf in per.items():
                        engines = ["llama.cpp", "indexcache"][::1 if rnd % 2 == 0 else -1]
                        for engine in engines:
                            if engine == "llama.cpp":
                                r = llama_run(bins, gguf, ctx, args.gen, threads)
                            else:
                                r = ours_run(models[dt][config], ctx, args.gen, threads, args.seed + rnd,
                                             args.ours_decode_step)
                            rec = dict(engine=engine, context=ctx, config=config, threads=threads, dtype=dt,
                                       round=rnd, gen=args.gen, loadavg=os.getloadavg()[0], **r)
                            log(json.dumps(rec))
                            records.append(rec)
                            if args.json:
                                with open(args.json.with_suffix(".records.jsonl"), "a") as f:
                                    f.write(json.dumps(rec) + "\n")
    return records


def summarize(records: list) -> list:
    """Median, min and max per (engine, context, config, threads, dtype) over the rounds."""
    groups = {}
    for r in records:
        groups.setdefault((r["engine"], r["context"], r["config"], r["threads"], r["dtype"]), []).append(r)
    rows = []
    for (engine, ctx, config, threads, dt), rs in groups.items():
        row = dict(engine=engine, context=ctx, config=config, threads=threads, dtype=dt, n=len(rs))
        for key in ("prefill_tok_s", "decode_tok_s"):
            vals = [r[key] for r in rs]
            row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        rows.append(row)
    return rows


def fmt(stat: dict) -> str:
    return f"{stat['median']:.1f} ({stat['min']:.1f}-{stat['max']:.1f})"


def table(rows: list) -> str:
    """Markdown: ours and llama.cpp side by side per setting, tokens/s median (min-max), ratios."""
    by = {(r["context"], r["config"], r["threads"], r["dtype"], r["engine"]): r for r in rows}
    lines = ["| dtype | context | config | threads | prefill ours | prefill llama.cpp | ratio | "
             "decode ours | decode llama.cpp | ratio |", "|---" * 10 + "|"]
    for (ctx, config, threads, dt, engine), ours in sorted(by.items()):
        other = by.get((ctx, config, threads, dt, "llama.cpp"))
        if engine != "indexcache" or other is None:
            continue
        ratio = {k: ours[k]["median"] / other[k]["median"] for k in ("prefill_tok_s", "decode_tok_s")}
        lines.append(f"| {dt} | {ctx} | {config} | {threads} | {fmt(ours['prefill_tok_s'])} | "
                     f"{fmt(other['prefill_tok_s'])} | {ratio['prefill_tok_s']:.2f}x | {fmt(ours['decode_tok_s'])} | "
                     f"{fmt(other['decode_tok_s'])} | {ratio['decode_tok_s']:.2f}x |")
    return "\n".join(lines)


def memory_table(ours: dict, theirs: dict) -> str:
    lines = ["| engine | config | KV B/token | index-K B/token | index-K layers |", "|---" * 5 + "|"]
    for engine, per in (("indexcache", ours), ("llama.cpp", theirs)):
        for config, m in per.items():
            lines.append(f"| {engine} | {config} | {m.get('kv_bytes_per_token', float('nan')):.0f} | "
                         f"{m.get('index_k_bytes_per_token', float('nan')):.0f} | {m.get('index_k_layers', '?')} |")
    return "\n".join(lines)


def checks(args, bins, src: Path, ckpts: dict, tok) -> dict:
    """Greedy check per config on the f32 GGUF against our f32 model (fp32 indexer: llama.cpp keeps
    f16 index keys and f32 activations), and the same in bf16; both engines' cache bytes per token."""
    import torch

    from indexcache.models import from_pretrained
    out = {"greedy": {}, "memory_ours": {}, "memory_llama": {}}
    for dt in ("f32", "bf16"):
        for config in args.configs.split(","):
            gguf = convert(src, ckpts[config], dt)
            m = from_pretrained(ckpts["all-F"], dtype=getattr(torch, TORCH_DTYPES[dt]),
                                hf_overrides=OURS_OVERRIDES[config], indexer_fp8=False).eval()
            if dt == "bf16":
                fp8 = from_pretrained(ckpts["all-F"], dtype=torch.bfloat16, hf_overrides=OURS_OVERRIDES[config])
                out["memory_ours"][config] = ours_cache_bytes(fp8)
            if args.check_prompt:
                res = correctness(bins, gguf, m, tok, args.check_prompt, args.check_tokens, max(args.threads),
                                  args.seed + 100, ckpts[config] if dt == "f32" else None)
                out["memory_llama"][config] = res.pop("memory")
                out["greedy"][f"{dt} {config}"] = res
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.from_records:
        records = [json.loads(ln) for ln in args.from_records.read_text().splitlines() if ln.strip()]
        print(table(summarize(records)))
        return
    info = dict(cpu_info(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv))
    log(json.dumps(info))
    bins, ggufs, models, src, ckpts = prepare(args)
    for per in models.values():
        for m in per.values():
            ours_run(m, 128, 2, max(args.threads), 0)
    check = checks(args, bins, src, ckpts, gpt2_tokenizer(src))
    log(json.dumps({"checks": check}))
    records = measure(args, bins, ggufs, models)
    rows = summarize(records)
    info["loadavg_after"] = os.getloadavg()
    print(f"{info['cpu']} ({info['cores']} cores, flags {info['flags']}), load {info['loadavg']} -> "
          f"{info['loadavg_after']}, {info['date']}")
    print(table(rows))
    print(memory_table(check["memory_ours"], check["memory_llama"]))
    print("greedy:", json.dumps(check["greedy"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"info": info, "records": records, "summary": rows, "checks": check},
                                        indent=1))


if __name__ == "__main__":
    main()
