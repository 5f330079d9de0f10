"""Batched generation over the paged caches, with optional MTP speculative decoding.

Requests of different lengths share each forward as one flattened batch: prompts are prefilled
in chunks of at most ``prefill_chunk_size`` tokens (default: the top-k buffer's rows), then every
live request decodes one token per step. With ``num_speculative_tokens = k > 0`` each round is

1. MTP draft step 0 over the (hidden, next token) pairs verified since the last round; the MTP
   layer runs its own indexer. Each request's last-row indices are kept (the rows compacted to
   one per request);
2. draft steps 1..k-1, one row per request, reuse those rows (``set_skip_topk``; DESIGN.md §6);
3. the main model verifies ``[last token, d1..dk]`` as k+1 decode rows per request; greedy
   acceptance (or speculative rejection sampling when temperature > 0) keeps a prefix plus
   one token of its own. Rejected positions are simply overwritten next round.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from indexcache.models.cuda_graph import DecodeStep, unsupported_reason
from indexcache.models.runtime import BatchMeta, StageTimer


@dataclass
class GenerationResult:
    tokens: list                      # generated ids per request (stop token included)
    finish_reasons: list              # "stop" | "length" per request
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0            # generated after each request's first token
    decode_seconds: float = 0.0
    draft_tokens: int = 0             # MTP drafts proposed / accepted
    accepted_tokens: int = 0
    rounds: int = 0                   # speculative rounds
    mtp_step0_forwards: int = 0       # MTP forwards that ran the MTP indexer
    mtp_reuse_forwards: int = 0       # MTP forwards that reused step 0's indices
    decode_step: str = "eager"        # how plain decode steps ran (generate's decode_step, resolved)
    graph_captures: int = 0           # CUDA graphs captured (one per decode batch size met)
    stage_seconds: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class _Req:
    def __init__(self, i: int, prompt: list):
        self.i, self.prompt = i, prompt
        self.out: list = []
        self.done, self.reason = False, None
        self.seq_len = 0          # tokens in the main model's cache
        self.next_token = None    # last emitted token, not yet in the main cache
        self.mtp_len = 0          # MTP cache positions holding verified pairs
        self.pend_h: list = []    # MTP pairs still to run: main hidden rows and the tokens after them
        self.pend_t: list = []


def _probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = p.sort(dim=-1, descending=True)
        drop = (sp.cumsum(dim=-1) - sp) > top_p  # keep the smallest prefix reaching top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, si, sp)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen) -> tuple[list, Optional[torch.Tensor]]:
    """Token per row (greedy at temperature 0) and the distribution it was drawn from."""
    if temperature == 0:
        return logits.argmax(dim=-1).tolist(), None
    p = _probs(logits, temperature, top_p)
    return torch.multinomial(p, 1, generator=gen).view(-1).tolist(), p


def _chunks(work: list, budget: int):
    """Pack (req, total) work into batches of <= budget tokens: yields [(req, start, n)]."""
    done = {id(r): 0 for r, _ in work}
    while any(done[id(r)] < total for r, total in work):
        batch, left = [], budget
        for r, total in work:
            s = done[id(r)]
            if s < total and left > 0:
                n = min(total - s, left)
                batch.append((r, s, n))
                done[id(r)] = s + n
                left -= n
        yield batch


def _prompts(prompts) -> list:
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    return [[int(t) for t in p] for p in prompts]


@torch.no_grad()
def generate(model, prompts, max_new_tokens: int = 32, *, temperature: float = 0.0, top_p: float = 1.0,
             stop_tokens: Optional[Sequence[int]] = None, num_speculative_tokens: int = 0,
             kv_cache_dtype: str = "auto", prefill_chunk_size: Optional[int] = None, seed: int = 0,
             timer: Optional[StageTimer] = None, decode_step: str = "auto") -> GenerationResult:
    """Generate for a batch of token-id prompts of any lengths.

    stop_tokens: ids that end a request (default: the config's ``eos_token_id``; ``[]`` for none).
    num_speculative_tokens: MTP drafts per round (needs an MTP layer; 0 = plain decoding).
    decode_step: how plain decoding runs each step. "eager": a forward per step; "static": the
    sync-free step on static buffers (models/cuda_graph.py), run eagerly; "graph": that step
    captured as a CUDA graph once per batch size and replayed; "auto": "graph" on a CUDA device
    when the model supports it (no stage timer, no MTP drafts), else "eager".
    """
    args = model.args
    prompts = _prompts(prompts)
    k = int(num_speculative_tokens)
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"empty prompt (request {i}): give at least one token")
        if len(p) > args.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_position_embeddings "
                             f"{args.max_position_embeddings}")
        if min(p) < 0 or max(p) >= args.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {args.vocab_size})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if k < 0 or (k > 0 and not model.mtp_layers):
        raise ValueError(f"num_speculative_tokens {k} needs an MTP layer (the model has "
                         f"{len(model.mtp_layers)})")
    rows = model.topk_buffer.shape[0]
    if len(prompts) * (k + 1) > rows:
        raise ValueError(f"{len(prompts)} requests x {k + 1} rows per decode step exceed the top-k buffer's "
                         f"{rows} rows (max_num_batched_tokens)")
    budget = min(prefill_chunk_size or rows, rows)
    if stop_tokens is None:
        eos = args.eos_token_id
        stop_tokens = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    stop = set(int(t) for t in stop_tokens)
    device = model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    cuda = device.type == "cuda"

    def now():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    reqs = [_Req(i, p) for i, p in enumerate(prompts)]
    bs = 64
    room = [len(p) + max_new_tokens + k + 2 for p in prompts]  # tokens each request may hold
    per_req = [-(-n // bs) for n in room]
    cache = model.allocate_cache(sum(per_req), kv_cache_dtype, bs)
    step_mode = _decode_mode(decode_step, model, cache, k, timer)
    # batch size -> DecodeStep (its graph captured on first use). The graphs share one memory
    # pool, which is safe because the batch only shrinks: a graph is never replayed after a
    # later one was captured (that capture may reuse the earlier graph's freed temporaries).
    steps: dict = {}
    step_rids: dict = {}  # batch size -> the requests its block table holds now
    max_blocks = max(per_req)
    for r, n in zip(reqs, room):
        cache.manager.allocate(r.i, n)
    res = GenerationResult(tokens=[r.out for r in reqs], finish_reasons=[None] * len(reqs),
                           prompt_tokens=sum(len(p) for p in prompts))
    limit = args.max_position_embeddings

    def emit(r: _Req, toks) -> None:
        for t in toks:
            if r.done:
                return
            r.out.append(t)
            if t in stop:
                r.done, r.reason = True, "stop"
            elif len(r.out) >= max_new_tokens:
                r.done, r.reason = True, "length"

    def finish_at_limit(r: _Req, need: int) -> None:
        if not r.done and r.seq_len + need > limit:
            r.done, r.reason = True, "length"

    # ------------------------------------------------------------------ prefill
    t0 = now()
    for batch in _chunks([(r, len(r.prompt)) for r in reqs], budget):
        ids = torch.tensor([t for r, s, n in batch for t in r.prompt[s:s + n]], device=device)
        meta = BatchMeta.paged_batch(cache, [r.i for r, _, _ in batch], [s for _, s, _ in batch], [n for _, _, n in batch])
        h = model.forward_tokens(ids, meta, cache, timer)
        offs = meta.row_offsets()
        ending = [(r, offs[j] + n - 1) for j, (r, s, n) in enumerate(batch) if s + n == len(r.prompt)]
        if ending:
            toks, _ = _sample(model.compute_logits(h[[row for _, row in ending]]), temperature, top_p, gen)
            for (r, _), t in zip(ending, toks):
                r.seq_len, r.next_token = len(r.prompt), t
                emit(r, [t])
        if k:
            for j, (r, s, n) in enumerate(batch):
                r.pend_h.append(h[offs[j]:offs[j] + n])
                r.pend_t += r.prompt[s + 1:s + n + 1]
                if s + n == len(r.prompt):
                    r.pend_t.append(r.next_token)
    res.prefill_seconds = now() - t0
    first_round = True

    # ------------------------------------------------------------------ decode
    t0 = now()
    while True:
        for r in reqs:
            finish_at_limit(r, k + 1)
            if r.done and r.reason and res.finish_reasons[r.i] is None:
                res.finish_reasons[r.i] = r.reason
                cache.manager.free(r.i)
        live = [r for r in reqs if not r.done]
        if not live:
            break
        if k == 0:
            if step_mode == "eager":
                ids = torch.tensor([r.next_token for r in live], device=device)
                meta = BatchMeta.paged_batch(cache, [r.i for r in live], [r.seq_len for r in live], [1] * len(live))
                logits = model.compute_logits(model.forward_tokens(ids, meta, cache, timer))
            else:
                n, rids = len(live), [r.i for r in live]
                if n not in steps:
                    pool = next((st.pool for st in steps.values() if st.pool is not None), None)
                    steps[n] = DecodeStep(model, cache, n, max_blocks, graph=step_mode == "graph", pool=pool)
                step = steps[n]
                fresh = step_rids.get(n) != rids
                step.prepare([r.next_token for r in live], [r.seq_len for r in live], rids if fresh else None)
                step_rids[n] = rids
                logits = step()
            toks, _ = _sample(logits, temperature, top_p, gen)
            for r, t in zip(live, toks):
                r.seq_len += 1
                r.next_token = t
                emit(r, [t])
            continue
        # draft step 0: catch the MTP layer up on the pairs verified since last round
        t_step0 = now()
        drafts = {r.i: [] for r in live}
        dprobs = {r.i: [] for r in live}
        saved, h_last = {}, {}
        for r in live:
            r.pend_h = [torch.cat(r.pend_h)] if len(r.pend_h) > 1 else r.pend_h
        for batch in _chunks([(r, len(r.pend_t)) for r in live], budget):
            ids = torch.tensor([t for r, s, n in batch for t in r.pend_t[s:s + n]], device=device)
            prev = torch.cat([r.pend_h[0][s:s + n] for r, s, n in batch])
            meta = BatchMeta.paged_batch(cache, [r.i for r, _, _ in batch], [r.mtp_len + s for r, s, _ in batch],
                                         [n for _, _, n in batch])
            hid, logits = model.forward_mtp(ids, prev, meta, cache, timer=timer)
            res.mtp_step0_forwards += 1
            offs = meta.row_offsets()
            ending = [(r, offs[j] + n - 1) for j, (r, s, n) in enumerate(batch) if s + n == len(r.pend_t)]
            if ending:
                rows_ = [row for _, row in ending]
                toks, p = _sample(logits[rows_], temperature, top_p, gen)
                for idx, ((r, row), t) in enumerate(zip(ending, toks)):
                    saved[r.i] = model.topk_buffer[row].clone()  # compact: one row per request
                    h_last[r.i] = hid[row]
                    drafts[r.i].append(t)
                    dprobs[r.i].append(None if p is None else p[idx])
        for r in live:
            r.mtp_len += len(r.pend_t)
            r.pend_h, r.pend_t = [], []
        if first_round:
            step0 = now() - t_step0
            res.prefill_seconds += step0
            t0 += step0
            first_round = False
        # draft steps 1..k-1 reuse step 0's indices
        for j in range(1, k):
            ids = torch.tensor([drafts[r.i][-1] for r in live], device=device)
            prev = torch.stack([h_last[r.i] for r in live])
            meta = BatchMeta.paged_batch(cache, [r.i for r in live], [r.mtp_len + j - 1 for r in live], [1] * len(live))
            hid, logits = model.forward_mtp(ids, prev, meta, cache, reuse_topk=torch.stack([saved[r.i] for r in live]),
                                            timer=timer)
            res.mtp_reuse_forwards += 1
            toks, p = _sample(logits, temperature, top_p, gen)
            for idx, (r, t) in enumerate(zip(live, toks)):
                h_last[r.i] = hid[idx]
                drafts[r.i].append(t)
                dprobs[r.i].append(None if p is None else p[idx])
        # verify k+1 rows per request
        ids = torch.tensor([t for r in live for t in [r.next_token] + drafts[r.i]], device=device)
        meta = BatchMeta.paged_batch(cache, [r.i for r in live], [r.seq_len for r in live], [k + 1] * len(live))
        h = model.forward_tokens(ids, meta, cache, timer)
        logits = model.compute_logits(h).view(len(live), k + 1, -1)
        res.rounds += 1
        for b, r in enumerate(live):
            d = drafts[r.i]
            a, extra = _accept(logits[b], d, dprobs[r.i], temperature, top_p, gen)
            res.draft_tokens += k
            res.accepted_tokens += a
            r.seq_len += a + 1
            r.next_token = extra
            r.pend_h = [h[b * (k + 1):b * (k + 1) + a + 1]]
            r.pend_t = d[:a] + [extra]
            emit(r, d[:a] + [extra])
    res.decode_seconds = now() - t0
    res.decode_tokens = sum(max(len(r.out) - 1, 0) for r in reqs)
    res.decode_step = step_mode
    res.graph_captures = sum(1 for st in steps.values() if st.graph is not None)
    if timer is not None:
        res.stage_seconds = dict(timer.times)
    return res


def _decode_mode(mode: str, model, cache, k: int, timer) -> str:
    if mode not in ("auto", "eager", "static", "graph"):
        raise ValueError(f"decode_step {mode!r}: choose auto, eager, static or graph")
    if mode == "eager":
        return mode
    reason = unsupported_reason(model, cache, graph=mode != "static")
    if mode == "auto":
        return "graph" if reason is None and k == 0 and timer is None else "eager"
    if k:
        raise ValueError(f"decode_step {mode!r} is for plain decoding; with num_speculative_tokens {k} use 'eager'")
    if reason is not None:
        raise ValueError(f"decode_step {mode!r}: {reason}")
    if mode == "graph" and timer is not None:
        raise ValueError("decode_step 'graph' cannot time stages (the timer synchronises inside the step)")
    return mode


def _accept(logits: torch.Tensor, drafts: list, dprobs: list, temperature: float, top_p: float, gen) -> tuple[int, int]:
    """(accepted drafts, the token that follows them) for one request's k+1 verify rows."""
    if temperature == 0:
        target = logits.argmax(dim=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return a, target[a]
    p = _probs(logits, temperature, top_p)
    for j, (d, q) in enumerate(zip(drafts, dprobs)):
        u = float(torch.rand(1, generator=gen, device=p.device))
        if u * float(q[d]) < float(p[j, d]):
            continue
        resid = (p[j] - q).clamp(min=0)
        resid = resid if float(resid.sum()) > 0 else p[j]
        return j, int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


# ============================================================================ tokenizers

class ByteTokenizer:
    """Byte-level: ids 0..255 are bytes; the small shipped models add BOS/EOS after them."""

    def __init__(self, bos_token_id: Optional[int] = 256, eos_token_id: Optional[int] = 257):
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's own tokenizer.json through the ``tokenizers`` library."""

    def __init__(self, path: Path, bos_token_id: Optional[int]):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"{path} needs the 'tokenizers' package (pip install tokenizers)") from None
        self.tok, self.bos_token_id = Tokenizer.from_file(str(path)), bos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: Union[str, Path], config: Optional[dict] = None):
    path = Path(path)
    config = config if config is not None else json.loads((path / "config.json").read_text())
    if (path / "tokenizer.json").is_file():
        tok = HFTokenizer(path / "tokenizer.json", config.get("bos_token_id"))
        size, vocab = tok.tok.get_vocab_size(with_added_tokens=True), config.get("vocab_size")
        if isinstance(vocab, int) and size > vocab:
            raise ValueError(f"{path / 'tokenizer.json'} has {size} tokens but the model's vocab_size is {vocab}: "
                             "the tokenizer does not belong to this checkpoint")
        return tok
    if config.get("indexcache_tokenizer") == "bytes":
        return ByteTokenizer(config.get("bos_token_id"), config.get("eos_token_id"))
    raise ValueError(f"{path} has no tokenizer.json (and is not marked byte-level)")
