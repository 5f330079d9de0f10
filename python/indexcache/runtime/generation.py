"""Batched generation over the paged caches, with optional MTP speculative decoding, in short
steps: :func:`prefill`, one plain :func:`decode_step`, one speculative :func:`mtp_round`.

Requests of different lengths share each forward as one flattened batch: prompts are prefilled
in chunks of at most ``prefill_chunk_size`` tokens (default: the top-k buffer's rows), then every
live request decodes one token per step. With ``num_speculative_tokens = k > 0`` each round is

1. MTP draft step 0 over the (hidden, next token) pairs verified since the last round; the MTP
   layer runs its own indexer. Each request's last-row indices are kept (the rows compacted to
   one per request);
2. draft steps 1..k-1, one row per request, attend over those rows (``forward_mtp(reuse_topk=)``;
   DESIGN.md §6);
3. the main model verifies ``[last token, d1..dk]`` as k+1 decode rows per request; greedy
   acceptance (or speculative rejection sampling when temperature > 0) keeps a prefix plus
   one token of its own. Rejected positions are simply overwritten next round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from indexcache.formats import BLOCK_SIZE
from indexcache.models.state import BatchMeta, StageTimer

from .cuda_graph import DecodeStep, unsupported_reason
from .sampling import accept, sample
from .stack_room import call_with_room
from .threads import DecodeThreads, prefill_threads

DECODE_STEPS = ("auto", "eager", "static", "graph", "compiled")


@dataclass
class GenerationSettings:
    """How :func:`generate` samples and runs (every field a keyword of ``generate``).

    stop_tokens: ids that end a request (None: the config's ``eos_token_id``; ``[]`` for none).
    num_speculative_tokens: MTP drafts per round (needs an MTP layer; 0 = plain decoding).
    decode_step: how plain decoding runs each step. "eager": a forward per step; "static": the
    sync-free step on static buffers (runtime/cuda_graph.py), run eagerly; "graph": that step
    captured as a CUDA graph once per batch size and replayed; "compiled": that step compiled by
    ``torch.compile`` once per batch size (CPU only; the first step, which compiles, is timed apart:
    ``GenerationResult.compile_seconds``); "auto": "graph" on a CUDA device when the model
    supports it (no stage timer, no MTP drafts), else "eager".
    decode_threads: torch's intra-op threads during decode on the CPU (None: the count whose
    steps time fastest over the first steps, runtime/threads.py).
    prefill_threads: the same for prefill (None: on the CPU, for prompts of at least
    ``PREFILL_PROBE_MIN`` tokens in all, the count a short matmul probe times fastest,
    ``threads.prefill_threads``; shorter prompts, CUDA and distributed runs keep torch's count).
    """
    temperature: float = 0.0
    top_p: float = 1.0
    stop_tokens: Optional[Sequence[int]] = None
    num_speculative_tokens: int = 0
    kv_cache_dtype: str = "auto"
    prefill_chunk_size: Optional[int] = None
    seed: int = 0
    timer: Optional[StageTimer] = None
    decode_step: str = "auto"
    decode_threads: Optional[int] = None
    prefill_threads: Optional[int] = None


# Prefill's thread choice (GenerationSettings.prefill_threads) runs for prompts of at least this
# many tokens in all (a shorter prefill costs little more than the probe).
PREFILL_PROBE_MIN = 256


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
    compile_seconds: float = 0.0      # decode_step "compiled": the first decode step (it compiles),
                                      # outside decode_seconds and decode_tokens
    decode_threads: int = 0           # intra-op threads the decode steps settled on
    prefill_threads: int = 0          # intra-op threads prefill ran on
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


class Request:
    """One prompt's progress through the caches."""

    def __init__(self, i: int, prompt: list):
        self.i, self.prompt = i, prompt
        self.out: list = []
        self.done, self.reason = False, None
        self.seq_len = 0          # tokens in the main model's cache
        self.next_token = None    # last emitted token, not yet in the main cache
        self.mtp_len = 0          # MTP cache positions holding verified pairs
        self.pend_h: list = []    # MTP pairs still to run: main hidden rows and the tokens after them
        self.pend_t: list = []


def token_chunks(work: list, budget: int):
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


def as_prompts(prompts) -> list:
    """Token-id prompts as a list of lists of ints (a tensor, one list of ints, or lists)."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    return [[int(t) for t in p] for p in prompts]


def check_request(model, prompts: list, max_new_tokens: int, s: GenerationSettings) -> None:
    """Every bad input as a ValueError before any cache is allocated."""
    args, k = model.args, int(s.num_speculative_tokens)
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
    if s.temperature < 0 or not 0 < s.top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {s.temperature}, {s.top_p}")
    if k < 0 or (k > 0 and not model.mtp_layers):
        raise ValueError(f"num_speculative_tokens {k} needs an MTP layer (the model has "
                         f"{len(model.mtp_layers)})")
    rows = model.topk_buffer.shape[0]
    if len(prompts) * (k + 1) > rows:
        raise ValueError(f"{len(prompts)} requests x {k + 1} rows per decode step exceed the top-k buffer's "
                         f"{rows} rows (max_num_batched_tokens)")


def resolve_decode_step(mode: str, model, cache, k: int, timer) -> str:
    """The decode-step mode that runs ("eager", "static" or "graph"), or a ValueError saying why not."""
    if mode not in DECODE_STEPS:
        raise ValueError(f"decode_step {mode!r}: choose auto, eager, static, graph or compiled")
    if mode == "eager":
        return mode
    reason = unsupported_reason(model, cache, graph=mode in ("auto", "graph"), compiled=mode == "compiled")
    if reason is None and model.index_reuse_steps > 1:
        reason = f"index_reuse_steps {model.index_reuse_steps} decides per request on the host (use 'eager')"
    if mode == "auto":
        return "graph" if reason is None and k == 0 and timer is None else "eager"
    if k:
        raise ValueError(f"decode_step {mode!r} is for plain decoding; with num_speculative_tokens {k} use 'eager'")
    if reason is not None:
        raise ValueError(f"decode_step {mode!r}: {reason}")
    if mode == "graph" and timer is not None:
        raise ValueError("decode_step 'graph' cannot time stages (the timer synchronises inside the step)")
    if mode == "compiled" and timer is not None:
        raise ValueError("decode_step 'compiled' cannot time stages (the compiled step is one function)")
    return mode


class Run:
    """The state of one :func:`generate` call: requests, caches, sampler, counters."""

    def __init__(self, model, prompts: list, max_new_tokens: int, s: GenerationSettings):
        self.model, self.s, self.max_new_tokens = model, s, max_new_tokens
        self.k = int(s.num_speculative_tokens)
        rows = model.topk_buffer.shape[0]
        self.budget = min(s.prefill_chunk_size or rows, rows)
        stop = s.stop_tokens
        if stop is None:
            eos = model.args.eos_token_id
            stop = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.stop = set(int(t) for t in stop)
        self.device = model.device
        self.gen = torch.Generator(device=self.device).manual_seed(s.seed)
        # Before the cache is allocated: a bad count is a ValueError. Ranks of one model choose
        # together or not at all: every rank must select the same rows.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        tune = self.device.type == "cpu" and not distributed
        self.threads = DecodeThreads(s.decode_threads, tune=tune)
        if s.prefill_threads is not None and s.prefill_threads < 1:
            raise ValueError(f"prefill_threads must be >= 1 (or None for auto), got {s.prefill_threads}")
        self.prefill_count = s.prefill_threads
        if self.prefill_count is None and tune and sum(len(p) for p in prompts) >= PREFILL_PROBE_MIN:
            self.prefill_count = prefill_threads()
        self.reqs = [Request(i, p) for i, p in enumerate(prompts)]
        room = [len(p) + max_new_tokens + self.k + 2 for p in prompts]  # tokens each request may hold
        per_req = [-(-n // BLOCK_SIZE) for n in room]
        self.cache = model.allocate_cache(sum(per_req), s.kv_cache_dtype, BLOCK_SIZE)
        self.step_mode = resolve_decode_step(s.decode_step, model, self.cache, self.k, s.timer)
        # batch size -> DecodeStep (its graph captured on first use). The graphs share one memory
        # pool, which is safe because the batch only shrinks: a graph is never replayed after a
        # later one was captured (that capture may reuse the earlier graph's freed temporaries).
        self.steps: dict = {}
        self.step_rids: dict = {}  # batch size -> the requests its block table holds now
        self.max_blocks = max(per_req)
        for r, n in zip(self.reqs, room):
            self.cache.manager.allocate(r.i, n)
        self.res = GenerationResult(tokens=[r.out for r in self.reqs], finish_reasons=[None] * len(self.reqs),
                                    prompt_tokens=sum(len(p) for p in prompts))

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def sample(self, logits: torch.Tensor):
        return sample(logits, self.s.temperature, self.s.top_p, self.gen)

    def emit(self, r: Request, toks) -> None:
        for t in toks:
            if r.done:
                return
            r.out.append(t)
            if t in self.stop:
                r.done, r.reason = True, "stop"
            elif len(r.out) >= self.max_new_tokens:
                r.done, r.reason = True, "length"

    def live(self) -> list:
        """Retire the requests that are done (or would pass max_position_embeddings); the rest."""
        limit = self.model.args.max_position_embeddings
        for r in self.reqs:
            if not r.done and r.seq_len + self.k + 1 > limit:
                r.done, r.reason = True, "length"
            if r.done and r.reason and self.res.finish_reasons[r.i] is None:
                self.res.finish_reasons[r.i] = r.reason
                self.cache.manager.free(r.i)
        return [r for r in self.reqs if not r.done]

    def meta(self, rids, starts, lens) -> BatchMeta:
        return BatchMeta.paged_batch(self.cache, list(rids), list(starts), list(lens))

    def ids(self, toks) -> torch.Tensor:
        return torch.tensor(list(toks), device=self.device)


def prefill(run: Run) -> None:
    """Every prompt through the main model in chunks of at most ``run.budget`` tokens, at the
    prefill thread count; each request's first token sampled from its last prompt row (and, with
    MTP, the pairs queued)."""
    t0, before = run.now(), torch.get_num_threads()
    count = run.prefill_count or before
    run.res.prefill_threads = count
    try:
        torch.set_num_threads(count)
        for batch in token_chunks([(r, len(r.prompt)) for r in run.reqs], run.budget):
            _prefill_chunk(run, batch)
    finally:
        torch.set_num_threads(before)
    run.res.prefill_seconds = run.now() - t0


def _prefill_chunk(run: Run, batch: list) -> None:
    model = run.model
    ids = run.ids(t for r, s, n in batch for t in r.prompt[s:s + n])
    meta = run.meta([r.i for r, _, _ in batch], [s for _, s, _ in batch], [n for _, _, n in batch])
    h = model.forward_tokens(ids, meta, run.cache, run.s.timer, reuse=False)  # prefill always computes
    offs = meta.row_offsets()
    ending = [(r, offs[j] + n - 1) for j, (r, s, n) in enumerate(batch) if s + n == len(r.prompt)]
    if ending:
        toks, _ = run.sample(model.compute_logits(h[[row for _, row in ending]]))
        for (r, _), t in zip(ending, toks):
            r.seq_len, r.next_token = len(r.prompt), t
            run.emit(r, [t])
    if run.k:
        for j, (r, s, n) in enumerate(batch):
            r.pend_h.append(h[offs[j]:offs[j] + n])
            r.pend_t += r.prompt[s + 1:s + n + 1]
            if s + n == len(r.prompt):
                r.pend_t.append(r.next_token)


def _static_step(run: Run, live: list) -> DecodeStep:
    """The sync-free step for this batch size, its inputs written (the block tables only when the
    batch's requests changed)."""
    n, rids = len(live), [r.i for r in live]
    if n not in run.steps:
        pool = next((st.pool for st in run.steps.values() if st.pool is not None), None)
        run.steps[n] = DecodeStep(run.model, run.cache, n, run.max_blocks, graph=run.step_mode == "graph", pool=pool,
                                  compiled=run.step_mode == "compiled")
    step = run.steps[n]
    fresh = run.step_rids.get(n) != rids
    step.prepare([r.next_token for r in live], [r.seq_len for r in live], rids if fresh else None)
    run.step_rids[n] = rids
    return step


def decode_step(run: Run, live: list) -> None:
    """One plain decode step: one new token for every live request."""
    model = run.model
    if run.step_mode == "eager":
        ids = run.ids(r.next_token for r in live)
        meta = run.meta([r.i for r in live], [r.seq_len for r in live], [1] * len(live))
        logits = model.compute_logits(model.forward_tokens(ids, meta, run.cache, run.s.timer))
    else:
        logits = _static_step(run, live)()
    toks, _ = run.sample(logits)
    for r, t in zip(live, toks):
        r.seq_len += 1
        r.next_token = t
        run.emit(r, [t])


@dataclass
class Drafts:
    """One round's MTP drafts per request: tokens, the distributions they came from, the
    step-0 top-k row each request's later draft steps reuse, and the last draft hidden state."""
    tokens: dict
    probs: dict
    topk_row: dict = field(default_factory=dict)
    hidden: dict = field(default_factory=dict)


def draft_step0(run: Run, live: list) -> Drafts:
    """MTP draft step 0: the MTP layer catches up on the pairs verified since the last round
    (running its own indexer); each request's last row gives its first draft."""
    model, d = run.model, Drafts({r.i: [] for r in live}, {r.i: [] for r in live})
    for r in live:
        r.pend_h = [torch.cat(r.pend_h)] if len(r.pend_h) > 1 else r.pend_h
    for batch in token_chunks([(r, len(r.pend_t)) for r in live], run.budget):
        ids = run.ids(t for r, s, n in batch for t in r.pend_t[s:s + n])
        prev = torch.cat([r.pend_h[0][s:s + n] for r, s, n in batch])
        meta = run.meta([r.i for r, _, _ in batch], [r.mtp_len + s for r, s, _ in batch], [n for _, _, n in batch])
        hid, logits = model.forward_mtp(ids, prev, meta, run.cache, timer=run.s.timer)
        run.res.mtp_step0_forwards += 1
        offs = meta.row_offsets()
        ending = [(r, offs[j] + n - 1) for j, (r, s, n) in enumerate(batch) if s + n == len(r.pend_t)]
        if ending:
            toks, p = run.sample(logits[[row for _, row in ending]])
            for idx, ((r, row), t) in enumerate(zip(ending, toks)):
                d.topk_row[r.i] = model.topk_buffer[row].clone()  # compact: one row per request
                d.hidden[r.i] = hid[row]
                d.tokens[r.i].append(t)
                d.probs[r.i].append(None if p is None else p[idx])
    for r in live:
        r.mtp_len += len(r.pend_t)
        r.pend_h, r.pend_t = [], []
    return d


def draft_reuse(run: Run, live: list, d: Drafts, j: int) -> None:
    """MTP draft step ``j`` >= 1: one row per request over step 0's top-k rows (no indexer)."""
    ids = run.ids(d.tokens[r.i][-1] for r in live)
    prev = torch.stack([d.hidden[r.i] for r in live])
    meta = run.meta([r.i for r in live], [r.mtp_len + j - 1 for r in live], [1] * len(live))
    reuse = torch.stack([d.topk_row[r.i] for r in live])
    hid, logits = run.model.forward_mtp(ids, prev, meta, run.cache, reuse_topk=reuse, timer=run.s.timer)
    run.res.mtp_reuse_forwards += 1
    toks, p = run.sample(logits)
    for idx, (r, t) in enumerate(zip(live, toks)):
        d.hidden[r.i] = hid[idx]
        d.tokens[r.i].append(t)
        d.probs[r.i].append(None if p is None else p[idx])


def verify(run: Run, live: list, d: Drafts) -> None:
    """The main model over ``[last token, d1..dk]`` per request: the accepted prefix and one token
    of its own are emitted; their hidden rows queue for the next round's step 0."""
    model, k, s = run.model, run.k, run.s
    ids = run.ids(t for r in live for t in [r.next_token] + d.tokens[r.i])
    meta = run.meta([r.i for r in live], [r.seq_len for r in live], [k + 1] * len(live))
    h = model.forward_tokens(ids, meta, run.cache, s.timer)
    logits = model.compute_logits(h).view(len(live), k + 1, -1)
    run.res.rounds += 1
    for b, r in enumerate(live):
        drafts = d.tokens[r.i]
        a, extra = accept(logits[b], drafts, d.probs[r.i], s.temperature, s.top_p, run.gen)
        run.res.draft_tokens += k
        run.res.accepted_tokens += a
        r.seq_len += a + 1
        r.next_token = extra
        r.pend_h = [h[b * (k + 1):b * (k + 1) + a + 1]]
        r.pend_t = drafts[:a] + [extra]
        run.emit(r, drafts[:a] + [extra])


def mtp_round(run: Run, live: list, timed: bool = False) -> float:
    """One speculative round (draft step 0, draft steps 1..k-1, verify); returns step 0's seconds
    when ``timed`` (else 0.0: no extra device synchronisation)."""
    t0 = run.now() if timed else 0.0
    d = draft_step0(run, live)
    step0 = run.now() - t0 if timed else 0.0
    for j in range(1, run.k):
        draft_reuse(run, live, d, j)
    verify(run, live, d)
    return step0


def _compile_steps(run: Run) -> int:
    """Decode steps that compile the step, timed apart (``compile_seconds``): one at each thread
    count the decode steps may take (torch guards a compiled graph on the count, so each compiles
    its own). Returns the tokens they emitted."""
    t0, before, emitted = run.now(), torch.get_num_threads(), 0
    try:
        for n in run.threads.cands:
            live = run.live()
            if not live:
                break
            torch.set_num_threads(n)
            decode_step(run, live)
            emitted += len(live)
    finally:
        torch.set_num_threads(before)
    run.res.compile_seconds = run.now() - t0
    return emitted


def decode(run: Run) -> None:
    """Decode until every request is done. The first speculative round's step 0 finishes the
    prompt's MTP pass, so its time counts as prefill."""
    first_round, compiled = True, 0
    if run.step_mode == "compiled":
        compiled = _compile_steps(run)
    t0 = run.now()
    while True:
        live = run.live()
        if not live:
            break
        if run.k == 0:
            run.threads.run(lambda: decode_step(run, live))
            continue
        step0 = run.threads.run(lambda: mtp_round(run, live, timed=first_round))
        if first_round:
            run.res.prefill_seconds += step0
            t0 += step0
            first_round = False
    res = run.res
    res.decode_seconds = run.now() - t0
    res.decode_tokens = sum(max(len(r.out) - 1, 0) for r in run.reqs) - compiled
    res.decode_step = run.step_mode
    res.decode_threads = run.threads.current()
    res.graph_captures = sum(1 for st in run.steps.values() if st.graph is not None)
    if run.s.timer is not None:
        res.stage_seconds = dict(run.s.timer.times)


@torch.no_grad()
def generate(model, prompts, max_new_tokens: int = 32, settings: Optional[GenerationSettings] = None,
             **overrides) -> GenerationResult:
    """Generate for a batch of token-id prompts of any lengths. ``settings`` (or its fields as
    keywords: temperature, top_p, stop_tokens, num_speculative_tokens, kv_cache_dtype,
    prefill_chunk_size, seed, timer, decode_step, decode_threads) as :class:`GenerationSettings`."""
    s = replace(settings or GenerationSettings(), **overrides)
    prompts = as_prompts(prompts)
    check_request(model, prompts, max_new_tokens, s)
    run = Run(model, prompts, max_new_tokens, s)
    try:
        prefill(run)
        # A decode step's Python calls go deep and come back many times a step: from a frame of
        # its own so that they never map and unmap CPython's frame-stack chunks (stack_room.py).
        call_with_room(decode, run)
    finally:
        run.threads.restore()
    return run.res
