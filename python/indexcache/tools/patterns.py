"""Choosing an F/S pattern for a checkpoint: top-k overlap, greedy search, evaluation.

All three run the inference model (the ops, fp8 scoring by default) on byte windows of a
text. A pattern is applied to a model that has every indexer (all-F checkpoint load) as data:
the forward's context says which layers are F (``DSAForCausalLM.forward_context(full=...)``),
and the model's own layers run, so a searched loss and an :func:`evaluate` of the same pattern
(a model built with that pattern, S layers holding no indexer) run the same arithmetic and
agree exactly.

Patterns name a family's **indexed layers** in order (``model.indexed``, DESIGN.md §2): every
layer of the DSA families, the sparse layers of MiniMax-M3. Positions below are pattern
positions; ``model.indexed[p]`` is the main layer at position p. A MiniMax-M3 layer selects key
blocks per KV head, so its overlap is block-set overlap per head.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from indexcache.models import BatchMeta, DSAForCausalLM, from_pretrained
from indexcache.config import IndexCacheConfig
from indexcache.plan import build_layer_plan


# ---------------------------------------------------------------------------- text windows

def text_windows(text: bytes, context: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows of ``context + 1`` bytes: ``LongTensor [n, context + 1]``."""
    return _windows(list(text), context, max_windows, "bytes")


def _windows(ids: Sequence[int], context: int, max_windows: int, unit: str) -> torch.Tensor:
    if context < 2:
        raise ValueError(f"context must be >= 2 tokens, got {context}")
    n = min(max_windows, (len(ids) - 1) // context)
    if n < 1:
        raise ValueError(f"the text has {len(ids)} {unit}, shorter than one window of {context + 1} "
                         f"(the context plus the next token); give a longer text or a smaller --context")
    data = torch.tensor(ids[: n * context + 1], dtype=torch.long)
    return torch.stack([data[i * context: i * context + context + 1] for i in range(n)])


def token_windows(text: bytes, tokenizer, context: int, max_windows: int) -> tuple[torch.Tensor, float]:
    """Windows of ``context + 1`` tokens of ``text`` under the checkpoint's tokenizer, and the text
    bytes per predicted token (so that a loss per token converts to bits per byte of the text).

    A byte-level tokenizer (the small models this project ships) reads the bytes as they are; an
    ``HFTokenizer`` encodes the UTF-8 text (undecodable bytes replaced) and counts, per window, the
    bytes of the span its predicted tokens cover, from the tokenizer's character offsets.
    """
    from indexcache.runtime import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return text_windows(text, context, max_windows), 1.0
    s = text.decode("utf-8", errors="replace")
    enc = tokenizer.tok.encode(s, add_special_tokens=False)
    windows = _windows(enc.ids, context, max_windows, "tokens")
    covered = 0
    for i in range(windows.shape[0]):
        first, last = i * context + 1, i * context + context  # the predicted tokens of window i
        covered += len(s[enc.offsets[first][0]:enc.offsets[last][1]].encode("utf-8"))
    return windows, max(covered, 1) / (windows.shape[0] * context)


def check_dsa(model: DSAForCausalLM) -> None:
    if model.args.index_topk <= 0:
        raise ValueError("this checkpoint is not a DSA model (index_topk is 0)")


def load_all_full(path, *, dtype=torch.float32, device="cpu", indexer_fp8=None) -> DSAForCausalLM:
    """The checkpoint with every main layer F (IndexCache off), for search and overlap."""
    from indexcache.loader import load_config
    try:
        model = from_pretrained(path, hf_overrides={"use_index_cache": False}, dtype=dtype, device=device,
                                indexer_fp8=indexer_fp8)
    except ValueError as e:
        if ("self_attn.indexer." in str(e) or "self_attn.index_" in str(e)) and "is missing" in str(e):
            raise ValueError(f"overlap and search need every layer's indexer, and {path} has none for some layers: "
                             f"it ships a plan ({IndexCacheConfig.from_config(load_config(path)).plan().pattern}) "
                             "whose S layers were saved without one; eval takes such a checkpoint") from None
        raise
    check_dsa(model)
    return model


def pattern_full(model: DSAForCausalLM, pattern: str) -> list:
    """The per-layer F flags (main layers, then MTP as the plan has them) of ``pattern``, which
    names the indexed layers in order (every layer of a DSA family; DESIGN.md §2)."""
    layers = [model.model.layers[i] for i in model.indexed]
    if len(pattern) != len(layers) or set(pattern) - {"F", "S"} or pattern[0] != "F":
        raise ValueError(f"pattern {pattern!r} must be {len(layers)} of 'F'/'S' starting with 'F'")
    for layer, c in zip(layers, pattern):
        if c == "F" and layer.self_attn.indexer is None:
            raise ValueError(f"layer {layer.layer_id} has no indexer in this model, so it cannot be F")
    return model.full_of([c == "S" for c in pattern] + list(model.plan.skip_topk[len(pattern):]))


# ---------------------------------------------------------------------------- layer-wise runs

@dataclass
class RunState:
    """What a forward under one pattern leaves behind, for resuming from any layer."""
    inputs: list          # hidden state entering each main layer [N, hidden]
    rows: dict            # F pattern position -> its layer's top-k rows int32 [N, k]
    final: torch.Tensor   # hidden state after the last main layer


class PatternRunner:
    """Runs the main layers of an all-F model under patterns over fixed windows."""

    def __init__(self, model: DSAForCausalLM, windows: torch.Tensor):
        check_dsa(model)
        self.model = model
        self.windows = windows.to(model.device)
        b, t1 = windows.shape
        self.meta = BatchMeta.dense(b, t1 - 1, model.device)
        self.inputs = self.windows[:, :-1].reshape(-1)
        self.targets = self.windows[:, 1:].reshape(-1)
        self.num_main_layers = model.args.num_hidden_layers
        self.num_layers = len(model.indexed)  # pattern positions
        self.position = {layer_id: p for p, layer_id in enumerate(model.indexed)}
        if not self.num_layers:
            raise ValueError("this model has no indexed layers: there is no pattern to choose")

    @torch.no_grad()
    def run(self, pattern: str, start: int = 0, state: Optional[RunState] = None) -> RunState:
        """Forward under ``pattern`` from pattern position ``start`` (its main layer), reusing
        ``state`` (a run whose pattern agrees with this one below ``start``) for the hidden input
        and the reused rows."""
        ctx = self.model.forward_context(self.meta, full=pattern_full(self.model, pattern))
        ctx.input_ids = self.inputs  # layers that read token ids (Qwen3.8-Flash-Next's PLE)
        first = 0 if start == 0 else self.model.indexed[start]  # the layers below see the same pattern
        if first == 0:
            x = self.model.model.embed(self.inputs)
            inputs, rows = [], {}
        else:
            x = state.inputs[first]
            inputs = list(state.inputs[:first])
            rows = {f: r for f, r in state.rows.items() if f < start}
            src = max(f for f in rows)  # the nearest F position below start under this pattern
            ctx.reuse_rows(rows[src])
        for layer in self.model.model.layers[first: self.num_main_layers]:
            inputs.append(x)
            x = layer(x, ctx)
            p = self.position.get(layer.layer_id)
            if p is not None and pattern[p] == "F":
                rows[p] = ctx.topk_rows.clone()
        return RunState(inputs, rows, x)

    @torch.no_grad()
    def loss(self, state: RunState) -> float:
        """Mean next-byte cross-entropy (nats) of a run."""
        return cross_entropy(self.model, self.model.model.final_norm(state.final), self.targets)

    def pattern_loss(self, pattern: str) -> float:
        return self.loss(self.run(pattern))


@torch.no_grad()
def cross_entropy(model: DSAForCausalLM, normed_hidden: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(model.compute_logits(normed_hidden), targets))


# ---------------------------------------------------------------------------- overlap

def _selections(model: DSAForCausalLM, rows: torch.Tensor, pos: torch.Tensor, t: int) -> torch.Tensor:
    """One indexed layer's choices as bool masks over what it selects from, one mask per query row
    whose window offers a real choice: tokens ``[R, t]`` (DSA; with pooled keys, GLM-5.3-Flash, the
    rows whose query sees more complete pools than it keeps, whether or not the tail is selected too),
    or with a block indexer (MiniMax-M3) key blocks per KV head ``[R * kv_heads, ceil(t / block)]``."""
    a = model.args
    if getattr(a, "indexer_compress_ratio", 0):  # QSA (Qwen3.8-Flash-Next): block ids, the query's own block last
        bs = a.indexer_compress_ratio
        units, real = -(-t // bs), (pos + 1) // bs > a.indexer_budget // bs
        r = rows[real].long()
    elif a.index_block_size:
        h, kb, bs = a.num_kv_heads, a.index_topk_blocks, a.index_block_size
        units, real = -(-t // bs), (pos // bs + 1) > kb
        r = rows[real].long().view(-1, h, kb).reshape(-1, kb)
    elif getattr(a, "index_kpool", 1) > 1:  # GLM-5.3-Flash: a choice once more pools are complete than it keeps
        units, real = t, (pos + 1) // a.index_kpool > a.index_topk_tokens // a.index_kpool
        r = rows[real].long()
    else:
        units, real = t, (pos + 1) > a.index_topk
        r = rows[real].long()
    m = torch.zeros(r.shape[0], units + 1, dtype=torch.bool, device=r.device)
    m.scatter_(1, torch.where(r >= 0, r, units), True)
    return m[:, :units]


@torch.no_grad()
def overlap_matrix(model: DSAForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """``M[i, j]``: the fraction of indexed layer i's selection that indexed layer j also selects,
    averaged over query tokens whose window offers more than the layer keeps (shorter windows
    select everything). DSA layers select tokens (index_topk); MiniMax-M3 layers select key blocks
    per KV head (index_topk_blocks), compared head by head."""
    runner = PatternRunner(model, windows)
    state = runner.run("F" * runner.num_layers)
    a = model.args
    t = runner.meta.block_size
    pos = runner.meta.positions
    keeps = (f"index_topk_blocks {a.index_topk_blocks} blocks of {a.index_block_size}" if a.index_block_size
             else f"index_topk {a.index_topk}")
    if getattr(a, "indexer_compress_ratio", 0):
        keeps = f"indexer_budget {a.indexer_budget} tokens in blocks of {a.indexer_compress_ratio}"
    sel = [_selections(model, state.rows[p], pos, t) for p in range(runner.num_layers)]
    if not sel[0].shape[0]:
        raise ValueError(f"windows of {t} tokens never exceed {keeps}: no row makes a choice")
    n = runner.num_layers
    out = torch.empty(n, n, dtype=torch.float64)
    for i in range(n):
        size = sel[i].sum(1).clamp(min=1)
        for j in range(n):
            out[i, j] = ((sel[i] & sel[j]).sum(1) / size).double().mean()
    return out


def source_overlap(matrix: torch.Tensor, pattern: str) -> list:
    """Per layer, overlap with the F layer whose indices it would use (1.0 for F layers)."""
    out, src = [], 0
    for layer, c in enumerate(pattern):
        if c == "F":
            src = layer
        out.append(float(matrix[layer, src]))
    return out


# ---------------------------------------------------------------------------- greedy search

def uniform_pattern(num_layers: int, freq: int, offset: int = 2) -> str:
    """The pattern the engines' freq/offset rule gives (the C++ plan builder's, DESIGN.md §2)."""
    return build_layer_plan(num_layers, use_index_cache=True, index_topk_freq=freq,
                            index_skip_topk_offset=offset).pattern


def budgets(num_layers: int) -> dict:
    """Number of F layers kept for the 1/2, 1/4 and 1/8 budgets (at least 1)."""
    return {name: max(1, math.ceil(num_layers * frac)) for name, frac in (("1/2", 0.5), ("1/4", 0.25), ("1/8", 0.125))}


def greedy_search(runner: PatternRunner, log_path: Optional[Path] = None, *, min_full: int = 1,
                  progress: bool = True, on_step: Optional[Callable] = None) -> list:
    """Training-free greedy search (IndexCache): from all-F, turn to S the layer whose change
    raises the calibration loss least, until ``min_full`` F layers remain. Layer 0 stays F.

    Returns the steps ``{"step", "layer", "pattern", "num_full", "loss", "candidates"}``
    (step 0 is all-F). With ``log_path`` every step is appended as a JSON line, and a rerun
    resumes from the steps already logged.
    """
    if min_full < 1:
        raise ValueError(f"a budget needs at least one F layer (layer 0), got {min_full}")
    n = runner.num_layers
    steps = []
    if log_path is not None and Path(log_path).is_file():
        steps = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
        for prev, cur in zip(steps, steps[1:]):
            if cur["pattern"][cur["layer"]] != "S" or prev["pattern"][cur["layer"]] != "F":
                raise ValueError(f"{log_path}: step {cur['step']} does not follow from step {prev['step']}")
    pattern = steps[-1]["pattern"] if steps else "F" * n
    state = runner.run(pattern)
    if not steps:
        steps.append({"step": 0, "layer": None, "pattern": pattern, "num_full": n, "loss": runner.loss(state),
                      "candidates": {}})
        _append(log_path, steps[-1])
    todo = max(0, pattern.count("F") - min_full)
    bar = None
    if progress and todo:
        from tqdm import tqdm
        bar = tqdm(total=todo, desc="greedy search", unit="step")
    while pattern.count("F") > min_full:
        best = None
        candidates = {}
        for layer in range(1, n):
            if pattern[layer] != "F":
                continue
            trial = pattern[:layer] + "S" + pattern[layer + 1:]
            run = runner.run(trial, start=layer, state=state)  # layers below are unchanged
            loss = runner.loss(run)
            candidates[layer] = loss
            if best is None or loss < best[0]:
                best = (loss, layer, trial, run)
        loss, layer, pattern, state = best
        steps.append({"step": len(steps), "layer": layer, "pattern": pattern, "num_full": pattern.count("F"),
                      "loss": loss, "candidates": {str(k): v for k, v in candidates.items()}})
        _append(log_path, steps[-1])
        if on_step is not None:
            on_step(steps[-1])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return steps


def overlap_search(matrix: torch.Tensor, num_full: int) -> tuple:
    """The pattern with ``num_full`` F layers, layer 0 among them, that maximises the summed
    overlap of every S layer with the F layer it reads (``matrix[s, source]``, as
    :func:`source_overlap`), chosen from the overlap matrix alone: no loss pass (the selection
    the IndexCache paper and Kascade make from layer similarity). A dynamic programme over the
    last F layer: ``best[c][j]``, the most overlap of layers ``< j`` with ``c`` F layers the last
    of which is ``j``; O(n^2 · num_full). Returns (pattern, mean source overlap of the S layers,
    1.0 when there are none). Ties go to the earlier F layer.
    """
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] < 1:
        raise ValueError(f"the overlap matrix must be square [n, n] with n >= 1, got {tuple(matrix.shape)}")
    n = matrix.shape[0]
    if not 1 <= num_full <= n:
        raise ValueError(f"num_full must be in [1, {n}] (layer 0 is always F), got {num_full}")
    m = matrix.double().cpu()
    # run[i][j]: overlap of the S layers i+1 .. j-1 with F layer i
    col = torch.cat([torch.zeros(1, n, dtype=torch.float64), m.cumsum(0)])  # col[r, i] = sum_{l < r} m[l, i]
    run = [[float(col[j, i] - col[i + 1, i]) if j > i else 0.0 for j in range(n + 1)] for i in range(n)]
    neg = float("-inf")
    best = [[neg] * n for _ in range(num_full + 1)]
    back = [[-1] * n for _ in range(num_full + 1)]
    best[1][0] = 0.0
    for c in range(2, num_full + 1):
        for j in range(c - 1, n):
            for i in range(c - 2, j):
                v = best[c - 1][i] + run[i][j]
                if v > best[c][j]:
                    best[c][j], back[c][j] = v, i
    last = max(range(n), key=lambda i: (best[num_full][i] + run[i][n], -i))
    total = best[num_full][last] + run[last][n]
    full, c = [], num_full
    while last >= 0:
        full.append(last)
        last, c = back[c][last], c - 1
    pattern = "".join("F" if i in full else "S" for i in range(n))
    shared = n - num_full
    return pattern, (total / shared if shared else 1.0)


def _append(path, record) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def hf_overrides_for(pattern: str) -> str:
    """The --hf-overrides JSON that vLLM and SGLang accept for a pattern."""
    return json.dumps({"use_index_cache": True, "index_topk_pattern": pattern})


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(path, overrides_list: Sequence, windows: torch.Tensor, *, dtype=torch.float32, device="cpu",
             indexer_fp8=None, timing_repeats: int = 3, bytes_per_token: float = 1.0) -> list:
    """Held-out loss of each ``--hf-overrides`` (dict or JSON string; None = the checkpoint as is),
    with the prefill time of one full-context window relative to the first entry. Perplexity is
    per token; bits per byte divide by ``bytes_per_token`` (see :func:`token_windows`)."""
    rows = []
    for ov in overrides_list:
        model = from_pretrained(path, hf_overrides=ov, dtype=dtype, device=device, indexer_fp8=indexer_fp8)
        check_dsa(model)
        runner = PatternRunner(model, windows)
        nats = cross_entropy(model, model.forward_tokens(runner.inputs, runner.meta), runner.targets)
        one = windows[:1, :-1].to(model.device)
        model(one)  # warm-up
        times = []
        for _ in range(timing_repeats):
            t0 = time.perf_counter()
            model(one)
            times.append(time.perf_counter() - t0)
        rows.append({"hf_overrides": ov if isinstance(ov, (str, type(None))) else json.dumps(ov),
                     "pattern": model.plan.pattern, "num_full": model.plan.num_full,
                     "indexers_kept": model.plan.num_full / model.plan.num_hidden_layers,
                     "loss_nats": nats, "perplexity": math.exp(nats), "bits_per_byte": nats / math.log(2) / bytes_per_token,
                     "prefill_s": min(times), "context": int(one.shape[1])})
    base = rows[0]["prefill_s"] if rows else 1.0
    for r in rows:
        r["prefill_ratio"] = r["prefill_s"] / base
    return rows
