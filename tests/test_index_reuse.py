"""IndexCache across decode steps (``index_reuse_steps``, models/step_reuse.py, docs/model.md):
the rows each layer attends over against a reference written here from the F layer's own
recomputations and the reuse rule, in batches of requests at different steps; the saved state's
lifetime; the key's validation; generation."""

import dataclasses

import pytest
import torch

from indexcache.config import IndexCacheConfig
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.state import BatchMeta
from indexcache.models.step_reuse import reused_row
from indexcache.models.tiny import tiny_config
from indexcache.runtime import generate

TOPK = 8
CFG = tiny_config(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_nextn_predict_layers=0, num_attention_heads=2, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
    kv_lora_rank=512, qk_rope_head_dim=64,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, index_n_heads=4, index_topk=TOPK, max_position_embeddings=512,
    bos_token_id=None, eos_token_id=None,
)
BS = 16


def make(reuse=None, freq=2, **kw):
    over = {"use_index_cache": True, "index_topk_freq": freq}
    if reuse is not None:
        over["index_reuse_steps"] = reuse
    return DeepseekV32ForCausalLM.from_config(CFG, over, seed=3, **kw)


class Recorder:
    """Per forward: each layer's attended rows; each F layer's rows recomputed afresh (its
    indexer run again on the same inputs with step reuse off)."""

    def __init__(self, model):
        self.model, self.used, self.fresh, self.busy = model, {}, {}, False
        self.hooks = []
        for layer in model.model.layers:
            attn = layer.self_attn
            self.hooks.append(attn.sparse_attn.register_forward_hook(self._rows(layer.layer_id)))
            if attn.indexer is not None:
                self.hooks.append(attn.indexer.register_forward_hook(self._fresh(layer.layer_id)))

    def _rows(self, layer_id):
        def hook(module, args, out):
            self.used[layer_id] = args[1].clone()
        return hook

    def _fresh(self, layer_id):
        def hook(module, args, out):
            if self.busy:
                return
            x, qr, ctx = args
            self.busy = True
            saved = self.model.topk_buffer.clone()
            self.fresh[layer_id] = module(x, qr, dataclasses.replace(ctx, reuse_steps=1)).clone()
            self.model.topk_buffer.copy_(saved)
            self.busy = False
        return hook

    def take(self):
        used, fresh = self.used, self.fresh
        self.used, self.fresh = {}, {}
        return used, fresh


def rule(saved: list, saved_pos: int, pos: int, k: int) -> list:
    """The reuse rule, written out: every new position (the last k at most), then the smallest
    k - m saved ones; ascending, -1-padded."""
    new = list(range(max(saved_pos + 1, pos + 1 - k), pos + 1))
    old = sorted(p for p in saved if p >= 0)[:k - len(new)]
    row = sorted(old + new)
    return row + [-1] * (k - len(row))


class Driver:
    """Forwards over one paged cache: ``step(work)`` with work = [(rid, n tokens)], each request's
    tokens random; prefill forwards pass ``reuse=False``."""

    def __init__(self, model, rng, rids, room=120):
        self.model, self.rng = model, rng
        self.cache = model.allocate_cache(len(rids) * -(-room // BS), "auto", BS)
        for rid in rids:
            self.cache.manager.allocate(rid, room)
        self.lens = {rid: 0 for rid in rids}

    def step(self, work, prefill=False, tokens=None):
        rids = [rid for rid, _ in work]
        meta = BatchMeta.paged_batch(self.cache, rids, [self.lens[r] for r in rids], [n for _, n in work])
        if tokens is None:
            tokens = [self.rng.randrange(CFG["vocab_size"]) for _ in range(meta.num_tokens)]
        h = self.model.forward_tokens(torch.tensor(tokens), meta, self.cache, reuse=not prefill)
        for rid, n in work:
            self.lens[rid] += n
        return meta, h, tokens


class Reference:
    """The rows each F layer must use, from its own recomputations and ``rule``."""

    def __init__(self, model, steps):
        self.steps, self.k = steps, model.args.index_topk
        self.full = model.full_of(model.plan.skip_topk)[:model.args.num_hidden_layers]
        self.saved: dict = {}  # (rid, layer) -> (pos, row as a list)
        self.counts = {"reused": 0, "decode_recomputed": 0, "mixed": 0}

    def check(self, meta, prefill, used, fresh):
        offs = meta.row_offsets()
        source = None
        for layer_id, full in enumerate(self.full):
            if not full:  # an S layer attends over its source F layer's rows of this forward
                assert torch.equal(used[layer_id], used[source])
                continue
            source = layer_id
            kinds = {self._check_request(layer_id, rid, meta.ctx_lens[b], meta.q_lens[b], offs[b], prefill,
                                         used[layer_id], fresh[layer_id]) for b, rid in enumerate(meta.rids)}
            self.counts["mixed"] += kinds == {"reused", "computed"}  # some rows recompute, some reuse

    def _check_request(self, layer_id, rid, ctx_len, q_len, off, prefill, used, fresh):
        saved = self.saved.get((rid, layer_id))
        if not prefill and q_len == 1 and saved is not None and ctx_len - saved[0] < self.steps:
            expect = rule(saved[1], saved[0], ctx_len, self.k)
            assert used[off].tolist() == expect, (layer_id, rid, ctx_len)
            self.counts["reused"] += 1
            return "reused"
        for r in range(off, off + q_len):
            assert sorted(used[r].tolist()) == sorted(fresh[r].tolist()), (layer_id, rid, ctx_len + r - off)
        self.counts["decode_recomputed"] += not prefill and saved is not None
        self.saved[(rid, layer_id)] = (ctx_len + q_len - 1, used[off + q_len - 1].tolist())
        return "computed"


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_rows_follow_the_rule_in_a_mixed_batch(rng, steps):
    """Request 0 starts alone; request 1 joins later (chunked prefill) and a third with a one-row
    prompt; every decode forward holds requests at different steps of their counters."""
    torch.manual_seed(rng.randrange(2 ** 31))
    model = make(steps)
    rec, drv, ref = Recorder(model), Driver(model, rng, [0, 1, 2]), Reference(model, steps)

    def run(work, prefill=False):
        meta, _, _ = drv.step(work, prefill)
        ref.check(meta, prefill, *rec.take())

    run([(0, rng.randrange(12, 20))], prefill=True)
    for _ in range(rng.randrange(1, steps)):  # request 0's counter out of phase with the others'
        run([(0, 1)])
    run([(1, 7)], prefill=True)
    run([(1, rng.randrange(6, 12)), (2, 1)], prefill=True)
    for _ in range(3 * steps + 2):
        run([(0, 1), (1, 1), (2, 1)])
    assert ref.counts["reused"] > 0 and ref.counts["decode_recomputed"] > 0 and ref.counts["mixed"] > 0


def test_reuse_1_is_todays_decode(rng):
    """index_reuse_steps 1 attends over the rows of a model without the key and gives its hidden states."""
    a, b = make(None), make(1)
    da, db = Driver(a, rng, [0, 1]), Driver(b, rng, [0, 1])
    ra, rb = Recorder(a), Recorder(b)
    work = [([(0, 15), (1, 9)], True)] + [([(0, 1), (1, 1)], False)] * 12
    for w, prefill in work:
        _, ha, toks = da.step(w, prefill)
        _, hb, _ = db.step(w, prefill, tokens=toks)
        assert torch.equal(ha, hb)
        ua, ub = ra.take()[0], rb.take()[0]
        assert ua.keys() == ub.keys() and all(torch.equal(ua[i], ub[i]) for i in ua)
    assert db.cache.selections.requests() == []  # reuse off: nothing kept


def test_reuse_changes_rows_once_contexts_exceed_k(rng):
    """The test above can fail: with reuse 4 and contexts past index_topk the attended rows differ."""
    a, b = make(None), make(4)
    da, db = Driver(a, rng, [0]), Driver(b, rng, [0])
    ra, rb = Recorder(a), Recorder(b)
    differ = False
    for w, prefill in [([(0, 30)], True)] + [([(0, 1)], False)] * 6:
        _, _, toks = da.step(w, prefill)
        db.step(w, prefill, tokens=toks)
        ua, ub = ra.take()[0], rb.take()[0]
        differ |= any(not torch.equal(ua[i], ub[i]) for i in ua)
    assert differ


def test_saved_selections_are_freed_with_the_request(rng):
    model = make(3)
    drv = Driver(model, rng, [0, 1])
    drv.step([(0, 10), (1, 5)], prefill=True)
    drv.step([(0, 1), (1, 1)])
    store = drv.cache.selections
    full = [i for i, f in enumerate(model.full_of(model.plan.skip_topk)) if f]
    assert sorted(store.requests()) == [0, 1]
    assert all(store.get(0, l) is not None for l in full)
    assert store.get(0, full[0])[0] == 9  # the prefill's last row: the decode at position 10 reused it
    drv.lens[1] = 3  # rolled back (rejected positions): a row at or before the saved one recomputes
    drv.step([(1, 1)])
    assert store.get(1, full[0])[0] == 3
    drv.cache.manager.free(0)
    assert store.requests() == [1] and store.get(0, full[0]) is None and store.get(1, full[0]) is not None
    drv.cache.manager.allocate(0, 40)  # a new request under the same id starts from nothing
    drv.lens[0] = 0
    drv.step([(0, 1)])
    assert store.get(0, full[0])[0] == 0


def test_reused_row_unit():
    k = 4
    saved = torch.tensor([9, 2, 5, 0], dtype=torch.int32)
    assert reused_row(saved, 10, 11, k).tolist() == [0, 2, 5, 11]
    assert reused_row(saved, 10, 12, k).tolist() == [0, 2, 11, 12]
    assert reused_row(saved, 10, 16, k).tolist() == [13, 14, 15, 16]  # more new positions than k
    short = torch.tensor([1, 0, -1, -1], dtype=torch.int32)
    assert reused_row(short, 1, 2, k).tolist() == [0, 1, 2, -1]
    for case in [(saved, 10, 13), (short, 1, 4), (short, 1, 3)]:
        assert reused_row(*case, k).tolist() == rule(case[0].tolist(), case[1], case[2], k)


@pytest.mark.parametrize("bad", [0, -1, "2", 2.0, True])
def test_validation(bad):
    with pytest.raises(ValueError, match="index_reuse_steps"):
        IndexCacheConfig.from_config({"num_hidden_layers": 4}, {"use_index_cache": True, "index_reuse_steps": bad})
    with pytest.raises(ValueError, match="index_reuse_steps"):
        make(bad)


def test_needs_the_switch_and_is_printed():
    with pytest.warns(UserWarning, match="index_reuse_steps 4 ignored"):
        off = IndexCacheConfig.from_config({"num_hidden_layers": 4}, {"index_reuse_steps": 4})
    assert off.index_reuse_steps == 1
    on = IndexCacheConfig.from_config({"num_hidden_layers": 4}, {"use_index_cache": True, "index_reuse_steps": 4})
    assert on.index_reuse_steps == 4
    assert "every 4 decode steps" in on.describe(on.plan())
    assert "decode steps" not in off.describe(off.plan())
    assert '"index_reuse_steps": 4' in on.hf_overrides_json()


def test_generate_short_prompts_match_reuse_1(rng):
    """Prompts whose whole context stays within index_topk select every key either way."""
    over = {"use_index_cache": True, "index_topk_freq": 2}
    cfg = dict(CFG, index_topk=16)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (3, 5, 8)]
    one = DeepseekV32ForCausalLM.from_config(cfg, over, seed=1)
    four = DeepseekV32ForCausalLM.from_config(cfg, {**over, "index_reuse_steps": 4}, seed=1)
    a = generate(one, prompts, max_new_tokens=8, decode_step="eager")
    b = generate(four, prompts, max_new_tokens=8)
    assert b.tokens == a.tokens and b.decode_step == "eager"
    long = [[rng.randrange(96) for _ in range(40)], prompts[0]]
    assert all(len(t) == 12 for t in generate(four, long, max_new_tokens=12).tokens)
    with pytest.raises(ValueError, match="index_reuse_steps 4"):
        generate(four, prompts, max_new_tokens=2, decode_step="static")


def test_the_vllm_plugin_writes_it_into_the_config(tmp_path):
    """The vLLM plugin's plan for vLLM's own DSA model: step reuse resolved as DESIGN §2 says (in force
    with use_index_cache only) and written into the config beside the pattern; a family whose indexer
    does not reuse across steps is refused with the package's line."""
    from types import SimpleNamespace
    import indexcache.integrations.vllm_models as plugin  # (a from-import asks the module for __path__,
    # which its lazy __getattr__ answers by importing vllm)
    apply_index_cache_plan = plugin.apply_index_cache_plan
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v32", "num_hidden_layers": 4}')
    hf = SimpleNamespace(num_hidden_layers=4, num_nextn_predict_layers=0)
    mc = SimpleNamespace(model=str(tmp_path), hf_text_config=hf,
                         hf_overrides={"use_index_cache": True, "index_topk_freq": 2, "index_reuse_steps": 2,
                                       "index_reuse_min_recall": 0.5})
    assert apply_index_cache_plan(SimpleNamespace(model_config=mc)).pattern == "FFSF"
    assert (hf.index_topk_pattern, hf.index_reuse_steps, hf.index_reuse_min_recall) == ("FFSF", 2, 0.5)
    mc.hf_overrides = {"index_topk_freq": 2, "index_reuse_steps": 2}  # without the switch: not in force
    with pytest.warns(UserWarning, match="index_reuse_steps 2 ignored"):
        apply_index_cache_plan(SimpleNamespace(model_config=mc))
    assert (hf.index_reuse_steps, hf.index_reuse_min_recall) == (1, None)
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", "num_hidden_layers": 4}')
    mc.hf_overrides = {"use_index_cache": True, "index_topk_freq": 2, "index_reuse_steps": 2}
    with pytest.raises(ValueError, match="index_reuse_steps 2: DeepseekV4ForCausalLM .* across layers only"):
        apply_index_cache_plan(SimpleNamespace(model_config=mc))


def test_mtp_rounds_run_and_match_reuse_1_on_short_prompts(rng):
    """MTP rounds (verify rows always compute) run under reuse 4 and, on contexts within
    index_topk, give the tokens of reuse 1."""
    over = {"use_index_cache": True, "index_topk_freq": 2}
    cfg = dict(CFG, index_topk=16, num_nextn_predict_layers=1)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (4, 6)]
    one = DeepseekV32ForCausalLM.from_config(cfg, over, seed=2)
    four = DeepseekV32ForCausalLM.from_config(cfg, {**over, "index_reuse_steps": 4}, seed=2)
    a = generate(one, prompts, max_new_tokens=6, num_speculative_tokens=2)
    b = generate(four, prompts, max_new_tokens=6, num_speculative_tokens=2)
    assert b.tokens == a.tokens and b.rounds > 0


def test_a_batch_without_request_ids_is_refused(rng):
    model = make(2)
    drv = Driver(model, rng, [0])
    meta = BatchMeta.paged_batch(drv.cache, [0], [0], [1])
    with pytest.raises(ValueError, match="request ids"):
        model.forward_tokens(torch.tensor([1]), dataclasses.replace(meta, rids=None), drv.cache)


# ----------------------------------------------------------------------------- adaptive reuse

def recall_of(reused: list, fresh: list) -> float:
    f = [p for p in fresh if p >= 0]
    return 1.0 if not f else sum(p in set(reused) for p in f) / len(f)


class AdaptiveReference(Reference):
    """``Reference`` under index_reuse_min_recall r: the first F layer computes every row; where a
    request would reuse, its rule row's recall of that fresh row decides: below r every F layer
    computes and saves, else the others reuse and the first keeps its older saved row."""

    def __init__(self, model, steps, min_recall):
        super().__init__(model, steps)
        self.min_recall = min_recall
        self.counts.update(checked=0, forced=0)

    def check(self, meta, prefill, used, fresh):
        offs = meta.row_offsets()
        probe = self.full.index(True)
        forced = set()
        for b, rid in enumerate(meta.rids):
            saved = self.saved.get((rid, probe))
            if prefill or meta.q_lens[b] != 1 or saved is None or meta.ctx_lens[b] - saved[0] >= self.steps:
                continue
            self.counts["checked"] += 1
            r = recall_of(rule(saved[1], saved[0], meta.ctx_lens[b], self.k), fresh[probe][offs[b]].tolist())
            if r < self.min_recall:
                forced.add(rid)
        self.counts["forced"] += len(forced)
        source = None
        for layer_id, full in enumerate(self.full):
            if not full:
                assert torch.equal(used[layer_id], used[source])
                continue
            source = layer_id
            for b, rid in enumerate(meta.rids):
                off, q_len, ctx_len = offs[b], meta.q_lens[b], meta.ctx_lens[b]
                saved = self.saved.get((rid, layer_id))
                window = not prefill and q_len == 1 and saved is not None and ctx_len - saved[0] < self.steps
                if window and rid not in forced:
                    if layer_id == probe:  # computes, keeps its older saved row
                        assert sorted(used[layer_id][off].tolist()) == sorted(fresh[layer_id][off].tolist())
                    else:
                        assert used[layer_id][off].tolist() == rule(saved[1], saved[0], ctx_len, self.k)
                        self.counts["reused"] += 1
                    continue
                for r in range(off, off + q_len):
                    assert sorted(used[layer_id][r].tolist()) == sorted(fresh[layer_id][r].tolist())
                self.saved[(rid, layer_id)] = (ctx_len + q_len - 1, used[layer_id][off + q_len - 1].tolist())


@pytest.mark.parametrize("min_recall", [0.25, 0.75, 1.0])
def test_adaptive_reuse_follows_the_probe_layer(rng, min_recall):
    """Two requests at different points of their schedules, contexts past index_topk: every F
    layer's rows are the rule's or fresh exactly as the probe layer's recall decides, and the
    store's counters agree with the reference's."""
    torch.manual_seed(rng.randrange(2 ** 31))
    steps = 4
    model = DeepseekV32ForCausalLM.from_config(
        CFG, {"use_index_cache": True, "index_topk_freq": 1, "index_reuse_steps": steps,
              "index_reuse_min_recall": min_recall}, seed=rng.randrange(100))
    rec, drv = Recorder(model), Driver(model, rng, [0, 1])
    ref = AdaptiveReference(model, steps, min_recall)
    for work, prefill in [([(0, 30)], True), ([(0, 1)], False), ([(1, 25)], True)] + [([(0, 1), (1, 1)], False)] * 14:
        meta, _, _ = drv.step(work, prefill)
        ref.check(meta, prefill, *rec.take())
    store = drv.cache.selections
    assert (store.checked, store.recomputed) == (ref.counts["checked"], ref.counts["forced"])
    assert ref.counts["checked"] > 0
    if min_recall == 1.0:
        assert ref.counts["forced"] > 0


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, "0.9", True])
def test_min_recall_validation(bad):
    with pytest.raises(ValueError, match="index_reuse_min_recall"):
        IndexCacheConfig.from_config({"num_hidden_layers": 4}, {"use_index_cache": True, "index_reuse_steps": 4,
                                                                "index_reuse_min_recall": bad})


def test_min_recall_needs_reuse_and_is_printed():
    with pytest.warns(UserWarning, match="index_reuse_min_recall 0.9 ignored"):
        off = IndexCacheConfig.from_config({"num_hidden_layers": 4}, {"use_index_cache": True,
                                                                      "index_reuse_min_recall": 0.9})
    assert off.index_reuse_min_recall is None
    on = IndexCacheConfig.from_config({"num_hidden_layers": 4}, {"use_index_cache": True, "index_reuse_steps": 4,
                                                                 "index_reuse_min_recall": 0.9})
    assert on.index_reuse_min_recall == 0.9
    assert "earlier when a reused selection holds < 0.9" in on.describe(on.plan())
    assert '"index_reuse_min_recall": 0.9' in on.hf_overrides_json()
