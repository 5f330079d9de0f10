"""Qwen3.8-Flash-Next in bf16 against transformers' own bf16 (issue 34; docs/model.md, "Qwen3.8-Flash-Next
in bf16"): over fresh random checkpoints of tests/test_qwen4_exp.py's config, the median over rows of
each row's relative error against transformers' fp32 logits, ours bf16 / transformers' bf16, with each
model left to choose its routed experts and QSA blocks and with fp32's choices replayed (the test's
helpers); the decisions each bf16 model flips; and greedy tokens (8, all-F) of ours bf16 against
transformers' bf16 and fp32 ``generate()``.

    PYTHONPATH=python:tests .venv/bin/python bench/bench_qwen4_exp_bf16.py --seeds 100 120 [--generate]
"""

import argparse
import statistics
import tempfile

import pytest
import torch
import transformers
import test_qwen4_exp as T
from hf_weights import recorded_choices

from indexcache.models import from_pretrained
from indexcache.runtime.generation import generate


def own_choices(model, ids):
    """Our model's routed experts and selection rows from one forward (``[rows, k]`` each)."""
    hooks, got = recorded_choices(model.model.layers, lambda layer: True,
                                  lambda layer: layer.self_attn is not None and layer.self_attn.indexer is not None,
                                  experts=lambda out: out[0], selection=lambda out: out[:ids.numel()].clone())
    with hooks, torch.no_grad():
        model(ids)
    return got


def flips(choices, fp32, r, blocks):
    """Rows whose expert set or block selection differs from fp32's, over every layer."""
    n = 0
    for key, want in fp32.items():
        got = choices[key]
        if key[0] == "experts":
            n += int((got.sort(-1).values != want.sort(-1).values).any(-1).sum())
        else:
            want = T.block_rows(want, r, blocks)
            got = T.block_rows(got, r, blocks) if got.dim() == 4 else got
            n += int((got != want).any(-1).sum())
    return n


def logits_run(path, hf, ids):
    want, fp32 = T.fp32_choices(hf, ids)
    theirs = transformers.Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = from_pretrained(path, dtype=torch.bfloat16)
    r, norm = T.TEXT["indexer_compress_ratio"], hf.config.norm_topk_prob
    blocks = T.TEXT["indexer_budget"] // r
    th_logits, th_choices = T.fp32_choices(theirs, ids)
    with torch.no_grad():
        free = [T.row_errors(ours(ids), want).median(), T.row_errors(th_logits, want).median()]
    with T.forced(theirs.model.layers, fp32, norm, transformers_side=True):
        th = T.row_errors(T.hf_logits(theirs, ids), want).median()
    with T.forced(ours.model.layers, fp32, norm, transformers_side=False), torch.no_grad():
        mine = T.row_errors(ours(ids), want).median()
    return (float(free[0] / free[1]), float(mine / th), float(mine), float(th),
            flips(own_choices(ours, ids), fp32, r, blocks), flips(th_choices, fp32, r, blocks))


def greedy_run(path, hf, seed):
    prompt = torch.randint(3, T.TEXT["vocab_size"], (1, 14), generator=torch.Generator().manual_seed(seed + 2))
    ours = from_pretrained(path, dtype=torch.bfloat16)
    got = generate(ours, [prompt[0].tolist()], 8, stop_tokens=[], prefill_chunk_size=5).tokens[0]
    out = {}
    for name, m in (("fp32", hf), ("bf16", transformers.Qwen4ExpForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16).eval())):
        mp = pytest.MonkeyPatch()
        T.patch(mp, m)
        with torch.no_grad():
            out[name] = m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                   pad_token_id=0)[0, 14:].tolist()
        mp.undo()

    def common(a, b):
        return next((k for k in range(8) if a[k] != b[k]), 8)
    return common(got, out["bf16"]), common(out["bf16"], out["fp32"]), common(got, out["fp32"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs=2, default=(100, 120))
    ap.add_argument("--generate", action="store_true", help="greedy tokens instead of logits errors")
    a = ap.parse_args()
    ids = torch.randint(3, T.TEXT["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(11))
    ids[0, 13] = ids[1, 27] = 2
    rows = []
    for seed in range(*a.seeds):
        path = tempfile.mkdtemp()
        hf = T.hf_text(path, seed=seed)
        if a.generate:
            print(f"seed {seed}: ours-bf16 = hf-bf16 {{}}/8, hf-bf16 = fp32 {{}}/8, ours-bf16 = fp32 {{}}/8"
                  .format(*greedy_run(path, hf, seed)), flush=True)
            continue
        rows.append(logits_run(path, hf, ids))
        print("seed {}: ratio unforced {:.2f} forced {:.2f} (ours {:.4f}, theirs {:.4f}); "
              "flipped rows ours {} theirs {}".format(seed, *rows[-1]), flush=True)
    for name, col in (("unforced", 0), ("forced", 1)):
        if rows:
            v = [r[col] for r in rows]
            print(f"{name} ours/theirs: median {statistics.median(v):.2f} min {min(v):.2f} max {max(v):.2f}")


if __name__ == "__main__":
    main()
