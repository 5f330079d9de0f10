"""Step reuse (``index_reuse_steps``, models/step_reuse.py) on the two hybrid families (issue 34).

GLM-5.3-Flash's pooled indexer picks pools of ``index_kpool`` positions, Qwen3.8-Flash-Next's QSA
indexer blocks of ``indexer_compress_ratio``: a reused row keeps its request's last picked units,
with the units completed since its last computation taking the place of the largest saved ones,
plus the query's own unfinished unit (docs/model.md, "IndexCache across decode steps").

The model under reuse runs in lockstep with a twin (same weights, step reuse off) whose F layers'
rows this file forces, on the rows the schedule reuses, to the row it builds itself (``rule`` and
the family's layout, written here) from the twin's own last computation for that request and
layer: the two must give the same logits bit for bit, and on every other row the twin runs its
plain step. Requests join at different times (different histories, counters out of phase)."""

import dataclasses
import json

import pytest
import torch

from indexcache.models import BatchMeta
from indexcache.models.glm5_next import Glm5NextTextForCausalLM
from indexcache.models.qwen4_exp import Qwen4ExpForCausalLM
from indexcache.models.state import ForwardContext

LIN, IDX = "linear_attention", "indexed_attention"
GLM = dict(model_type="glm5_next_text", vocab_size=260, hidden_size=32, intermediate_size=24, moe_intermediate_size=8,
           num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
           kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8, index_topk=8,
           index_head_dim=16, index_n_heads=4, index_kpool=4, linear_head_dim=8, linear_num_heads=2, hc_mult=2,
           hc_sinkhorn_iters=5, layer_types=[LIN, IDX, IDX, LIN, IDX, IDX, IDX],
           mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "dense", "sparse"], pad_token_id=0,
           bos_token_id=None, eos_token_id=None, max_position_embeddings=512)
QWEN = dict(model_type="qwen4_exp_text", vocab_size=260, hidden_size=32, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts_per_tok=2, num_experts=4, layer_types=[LIN, IDX, LIN, IDX, IDX, LIN, IDX], hc_count=2,
            hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=16, ple_conv_kernel_size=3, ngram_size=3,
            heads_per_ngram=2, ngram_vocab_size_base=200, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2,
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
# family -> (class, config, pattern over its indexed layers)
FAMILIES = {
    "glm": (Glm5NextTextForCausalLM, GLM, "FSFFS"),
    "glm_notail": (Glm5NextTextForCausalLM, dict(GLM, index_kpool_always_select_tail=False), "FFSFS"),
    "qwen": (Qwen4ExpForCausalLM, QWEN, "FSFF"),
}
BS = 8  # cache block size (a multiple of both unit sizes)


def make(family, reuse=None, seed=3, **extra):
    cls, cfg, pattern = FAMILIES[family]
    over = {"use_index_cache": True, "index_topk_pattern": pattern, **extra}
    if reuse is not None:
        over["index_reuse_steps"] = reuse
    return cls.from_config(cfg, over, seed=seed)


class Layout:
    """A family's selection row, written out: its units, how many a row picks, how a row is laid out."""

    def __init__(self, model):
        args = model.args
        if isinstance(model, Glm5NextTextForCausalLM):
            self.unit, self.k, self.tail = args.index_kpool, args.index_topk_tokens // args.index_kpool, \
                args.index_kpool_always_select_tail
            self.glm = True
        else:
            self.unit, self.k, self.tail, self.glm = args.indexer_compress_ratio, args.index_topk - 1, True, False

    def units(self, row: list) -> list:
        """A row -> the unit ids it picked (GLM: the first position of each expanded pool)."""
        if not self.glm:
            return row[:self.k]
        return [row[j * self.unit] // self.unit if row[j * self.unit] >= 0 else -1 for j in range(self.k)]

    def expand(self, units: list, pos: int) -> list:
        """Picked unit ids -> the row a query at ``pos`` attends with them."""
        u = self.unit
        if not self.glm:
            return units + [pos // u if (pos + 1) % u else -1]
        row = [x * u + i if x >= 0 else -1 for x in units for i in range(u)]
        if self.tail and u > 1:
            start = (pos + 1) // u * u
            row += [start + i if start + i <= pos else -1 for i in range(u - 1)]
        return row


def rule(saved: list, saved_pos: int, pos: int, k: int, unit: int) -> list:
    """The reuse rule over unit ids: the units completed since ``saved_pos`` (the newest k at most),
    then the smallest saved ones; ascending, -1-padded to k."""
    hi = (pos + 1) // unit
    new = list(range(max((saved_pos + 1) // unit, hi - k), hi))
    old = sorted(x for x in saved if x >= 0)[:k - len(new)]
    row = sorted(old + new)
    return row + [-1] * (k - len(row))


def recall_of(reused: list, fresh: list) -> float:
    f = [x for x in fresh if x >= 0]
    return 1.0 if not f else sum(x in set(reused) for x in f) / len(f)


def ctx_of(args) -> ForwardContext:
    return next(a for a in args if isinstance(a, ForwardContext))


class Twin:
    """The model without step reuse whose F layers' rows are forced where the schedule reuses
    (forward hooks on its indexers), keeping the schedule's saved selections itself."""

    def __init__(self, model, steps, min_recall=None):
        self.model, self.steps, self.min_recall = model, steps, min_recall
        self.lay = Layout(model)
        self.full = [i for i, f in enumerate(model.full_of(model.plan.skip_topk)) if f]
        self.probe = self.full[0] if min_recall is not None else None
        self.saved, self.rows = {}, {}
        self.counts = dict(reused=0, changed=0, decode_computed=0, checked=0, forced=0, mixed=0)
        self.meta, self.prefill, self.forced = None, False, set()
        for layer_id in self.full:
            model.model.layers[layer_id].self_attn.indexer.register_forward_hook(self._hook(layer_id))

    def begin(self, meta, prefill):
        self.meta, self.prefill, self.forced = meta, prefill, set()

    def _hook(self, layer_id):
        def hook(module, args, out):
            rows = ctx_of(args).topk_rows
            fresh = rows.tolist()
            kinds = {self._request(layer_id, b, rid, rows, fresh) for b, rid in enumerate(self.meta.rids)}
            self.counts["mixed"] += kinds == {"reused", "computed"}
            self.rows[layer_id] = rows.clone()
        return hook

    def _request(self, layer_id, b, rid, rows, fresh):
        meta, lay = self.meta, self.lay
        off, qn, c = meta.row_offsets()[b], meta.q_lens[b], meta.ctx_lens[b]
        saved = self.saved.get((rid, layer_id))
        window = not self.prefill and qn == 1 and saved is not None and 0 < c - saved[0] < self.steps
        if window and layer_id == self.probe:  # computes; its verdict sends the request back to computing
            self.counts["checked"] += 1
            if recall_of(rule(saved[1], saved[0], c, lay.k, lay.unit), lay.units(fresh[off])) < self.min_recall:
                self.forced.add(rid)
                self.counts["forced"] += 1
            if rid not in self.forced:
                return "computed"  # keeps its older saved selection
        elif window and rid not in self.forced:
            row = lay.expand(rule(saved[1], saved[0], c, lay.k, lay.unit), c)
            rows[off] = torch.tensor(row, dtype=rows.dtype)
            self.counts["reused"] += 1
            self.counts["changed"] += row != fresh[off]
            return "reused"
        self.counts["decode_computed"] += not self.prefill and saved is not None
        self.saved[(rid, layer_id)] = (c + qn - 1, lay.units(fresh[off + qn - 1]))
        return "computed"


class Recorder:
    """The F layers' rows of the model under reuse, per forward."""

    def __init__(self, model):
        self.rows = {}
        for i, f in enumerate(model.full_of(model.plan.skip_topk)):
            if f:
                model.model.layers[i].self_attn.indexer.register_forward_hook(self._hook(i))

    def _hook(self, layer_id):
        def hook(module, args, out):
            self.rows[layer_id] = ctx_of(args).topk_rows.clone()
        return hook


class Lockstep:
    """Forwards over one paged cache per model: ``step(work)`` with work = [(rid, n tokens)], the
    same random tokens to both; prefill forwards pass ``reuse=False``."""

    def __init__(self, models, rng, rids, room=80):
        self.models, self.rng = models, rng
        self.caches = [m.allocate_cache(len(rids) * -(-room // BS), "auto", BS) for m in models]
        for cache in self.caches:
            for rid in rids:
                cache.manager.allocate(rid, room)
        self.lens = {rid: 0 for rid in rids}

    def step(self, work, prefill=False, before=None):
        rids = [rid for rid, _ in work]
        tokens = torch.tensor([self.rng.randrange(3, 256) for _ in range(sum(n for _, n in work))])
        out = []
        for model, cache in zip(self.models, self.caches):
            meta = BatchMeta.paged_batch(cache, rids, [self.lens[r] for r in rids], [n for _, n in work])
            if before is not None:
                before(model, meta)
            out.append(model.compute_logits(model.forward_tokens(tokens, meta, cache, reuse=not prefill)))
        for rid, n in work:
            self.lens[rid] += n
        return out


def schedule(rng, steps):
    """Request 0 alone, then some of its decode steps; request 1 joins (chunked prefill), request 2
    with a one-token prompt; then every request decodes in one batch."""
    work = [([(0, rng.randrange(14, 22))], True)]
    work += [([(0, 1)], False)] * rng.randrange(1, steps)
    work += [([(1, 7)], True), ([(1, rng.randrange(6, 12)), (2, 1)], True)]
    return work + [([(0, 1), (1, 1), (2, 1)], False)] * (3 * steps + 2)


def run_lockstep(family, rng, steps, min_recall=None):
    torch.manual_seed(rng.randrange(2 ** 31))
    seed = rng.randrange(100)
    extra = {} if min_recall is None else {"index_reuse_min_recall": min_recall}
    model, twin_model = make(family, steps, seed, **extra), make(family, None, seed)
    twin, rec = Twin(twin_model, steps, min_recall), Recorder(model)
    run = Lockstep([model, twin_model], rng, [0, 1, 2])
    for work, prefill in schedule(rng, steps):
        ours, theirs = run.step(work, prefill, before=lambda m, meta: m is twin_model and twin.begin(meta, prefill))
        for layer_id, rows in twin.rows.items():
            assert torch.equal(rec.rows[layer_id], rows), (layer_id, work)
        assert torch.equal(ours, theirs), work
    store = run.caches[0].selections
    for (rid, layer_id), (pos, units) in twin.saved.items():
        got = store.get(rid, layer_id)
        assert got[0] == pos and sorted(got[1].tolist()) == sorted(units), (rid, layer_id)
    return twin, store


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("steps", [2, 4])
def test_reused_steps_equal_a_forward_forced_to_the_saved_selection(family, rng, steps):
    twin, _ = run_lockstep(family, rng, steps)
    c = twin.counts
    assert c["reused"] > 0 and c["decode_computed"] > 0 and c["mixed"] > 0, c
    assert c["changed"] > 0, c  # reuse changed what some rows attend: the check above can fail


@pytest.mark.parametrize("family", ["glm", "qwen"])
@pytest.mark.parametrize("min_recall", [0.5, 1.0])
def test_adaptive_reuse_follows_the_probe_layer(family, rng, min_recall):
    twin, store = run_lockstep(family, rng, 4, min_recall)
    assert (store.checked, store.recomputed) == (twin.counts["checked"], twin.counts["forced"])
    assert twin.counts["checked"] > 0
    if min_recall == 1.0:
        assert twin.counts["forced"] > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reuse_1_is_todays_decode(family, rng):
    """index_reuse_steps 1 gives the logits and rows of a model without the key, and keeps nothing."""
    a, b = make(family, None), make(family, 1)
    ra, rb = Recorder(a), Recorder(b)
    run = Lockstep([a, b], rng, [0, 1])
    for work, prefill in [([(0, 19), (1, 9)], True)] + [([(0, 1), (1, 1)], False)] * 10:
        la, lb = run.step(work, prefill)
        assert torch.equal(la, lb)
        assert ra.rows.keys() == rb.rows.keys() and all(torch.equal(ra.rows[i], rb.rows[i]) for i in ra.rows)
    assert run.caches[1].selections.requests() == []


@pytest.mark.parametrize("family", ["glm", "qwen"])
def test_saved_selections_are_freed_with_the_request(family, rng):
    model = make(family, 3)
    run = Lockstep([model], rng, [0, 1])
    run.step([(0, 10), (1, 5)], prefill=True)
    run.step([(0, 1), (1, 1)])
    store, first = run.caches[0].selections, model.full_of(model.plan.skip_topk).index(True)
    assert sorted(store.requests()) == [0, 1]
    assert store.get(0, first)[0] == 9  # the prefill's last row: the decode at position 10 reused it
    run.lens[1] = 3  # rolled back: a row at or before the saved one recomputes
    run.step([(1, 1)])
    assert store.get(1, first)[0] == 3
    run.caches[0].manager.free(0)
    assert store.requests() == [1] and store.get(0, first) is None
    run.caches[0].manager.allocate(0, 40)  # a new request under the same id starts from nothing
    run.lens[0] = 0
    run.step([(0, 1)])
    assert store.get(0, first)[0] == 0


@pytest.mark.parametrize("family", ["glm", "qwen"])
@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True])
def test_bad_reuse_steps_are_refused(family, bad):
    with pytest.raises(ValueError, match="index_reuse_steps"):
        make(family, bad)


@pytest.mark.parametrize("family", ["glm", "qwen"])
@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "0.9", True])
def test_bad_min_recall_is_refused(family, bad):
    with pytest.raises(ValueError, match="index_reuse_min_recall"):
        make(family, 4, index_reuse_min_recall=bad)


def checkpoint(family, path):
    """The family's test model (every indexed layer with its indexer) saved as a checkpoint, byte tokens."""
    cls, cfg, _ = FAMILIES[family]
    cls.from_config(cfg, seed=5).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "indexcache_tokenizer": "bytes"}))
    return path


@pytest.mark.parametrize("family", ["glm", "qwen"])
def test_generate_command_runs_it(family, tmp_path, capsys):
    """``indexcache generate --hf-overrides '{"use_index_cache": true, "index_reuse_steps": 4}'`` on the
    family's test checkpoint: a short prompt (its context never holds more complete units than a row
    picks) gives reuse 1's tokens; a long one decodes under the printed plan."""
    from indexcache.cli import main
    path = checkpoint(family, tmp_path)
    pattern = FAMILIES[family][2]
    r4 = json.dumps({"use_index_cache": True, "index_topk_pattern": pattern, "index_reuse_steps": 4})
    common = ["generate", "--model", str(path), "--dtype", "fp32", "--no-warmup"]
    assert main([*common, "--prompt", "ab", "--max-new-tokens", "6", "--json", "--hf-overrides", r4,
                 "--compare", json.dumps({"use_index_cache": True, "index_topk_pattern": pattern})]) == 0
    four, one = json.loads(capsys.readouterr().out)
    assert four["pattern"] == one["pattern"] == pattern
    assert four["tokens"] == one["tokens"] and len(one["tokens"]) >= 1 and four["decode_step"] == "eager"
    assert main([*common, "--prompt", "abcdefgh", "--repeat-prompt", "6", "--max-new-tokens", "12",
                 "--hf-overrides", r4]) == 0
    out = capsys.readouterr().out
    assert "F layers recompute every 4 decode steps" in out and "decode:" in out


@pytest.mark.parametrize("family", ["glm", "qwen"])
@pytest.mark.parametrize("reuse", [None, 4])
def test_paged_batch_without_request_ids_is_refused(family, reuse):
    """The linear-attention state (and step reuse) is kept per request id: a paged batch that
    carries none is refused by name, not a TypeError deep in the slot code."""
    model = make(family, reuse)
    cache = model.allocate_cache(4, "auto", BS)
    cache.manager.allocate(7, 16)
    meta = dataclasses.replace(BatchMeta.paged_batch(cache, [7], [0], [5]), rids=None)
    with pytest.raises(ValueError, match="request id"):
        model.forward_tokens(torch.tensor([5, 6, 7, 8, 9]), meta, cache, reuse=False)
