"""The decode step's and prefill's thread counts (runtime/threads.py): the timed choices against a
clock whose step costs are known, and generation under every count giving the tokens of a fixed
count."""

import pytest
import torch

from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.tiny import tiny_config
from indexcache.runtime import generate
from indexcache.runtime import generation
from indexcache.runtime.threads import TRIALS_PER_CANDIDATE, DecodeThreads, candidates, prefill_threads


class StepClock:
    """A clock that a step advances by ``cost[threads]`` seconds (the step's thread count)."""

    def __init__(self, cost: dict):
        self.cost, self.t = cost, 0.0

    def __call__(self) -> float:
        return self.t

    def step(self) -> int:
        n = torch.get_num_threads()
        self.t += self.cost[n]
        return n


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_candidates():
    assert candidates(1) == [1]
    assert candidates(2) == [1, 2]
    assert candidates(6) == [1, 2, 4, 6]
    assert candidates(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("cost,best", [
    ({1: 0.010, 2: 0.006, 4: 0.004}, 4),   # scales: the most threads
    ({1: 0.004, 2: 0.005, 4: 0.006}, 1),   # close: the lowest median, after every trial
    ({1: 0.003, 2: 0.030, 4: 0.090}, 1),   # oversubscribed: the slow counts drop out at once
])
def test_the_fastest_count_is_kept(four_threads, cost, best):
    clock = StepClock(cost)
    tuner = DecodeThreads(None, clock=clock)
    used = []
    while tuner.chosen is None:
        used.append(tuner.run(clock.step))
    assert tuner.chosen == best
    assert len(used) <= TRIALS_PER_CANDIDATE * len(cost)
    close = [c for c in cost if cost[c] <= 2 * min(cost.values())]
    assert all(used.count(c) == 1 for c in cost if c not in close)  # twice as slow: tried once
    if len(close) > 1:  # close ones run all their trials
        assert all(used.count(c) == TRIALS_PER_CANDIDATE for c in close)
    assert [tuner.run(clock.step) for _ in range(5)] == [best] * 5
    tuner.restore()
    assert torch.get_num_threads() == 4


def test_fixed_and_untuned_counts(four_threads):
    clock = StepClock({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    fixed = DecodeThreads(3, clock=clock)
    assert [fixed.run(clock.step) for _ in range(3)] == [3, 3, 3]
    fixed.restore()
    assert torch.get_num_threads() == 4
    untuned = DecodeThreads(None, tune=False, clock=clock)
    assert [untuned.run(clock.step) for _ in range(3)] == [4, 4, 4]
    with pytest.raises(ValueError, match="decode_threads must be >= 1"):
        DecodeThreads(0)


def test_generation_under_any_count_gives_the_same_tokens(four_threads):
    torch.manual_seed(0)
    cfg = tiny_config(num_hidden_layers=3, index_topk=8)
    model = DeepseekV32ForCausalLM.from_config(cfg, {"use_index_cache": True, "index_topk_freq": 2},
                                               dtype=torch.float32, indexer_fp8=True, seed=0)
    prompts = [torch.randint(0, cfg["vocab_size"], (n,)).tolist() for n in (30, 19)]
    fixed = generate(model, prompts, 12, stop_tokens=[], decode_threads=4)
    assert fixed.decode_threads == 4
    for threads in (1, 2, None):
        res = generate(model, prompts, 12, stop_tokens=[], decode_threads=threads)
        assert res.tokens == fixed.tokens
        assert res.decode_threads in (1, 2, 4) if threads is None else res.decode_threads == threads
        assert torch.get_num_threads() == 4
    with pytest.raises(ValueError, match="decode_threads"):
        generate(model, prompts, 2, decode_threads=0)
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("cost,best", [
    ({1: 0.010, 2: 0.006, 4: 0.004}, 4),   # the probe scales: every thread
    ({1: 0.003, 2: 0.030, 4: 0.090}, 1),   # a busy machine: one region at 2+ threads waits a time slice
    ({1: 0.004, 2: 0.003, 4: 0.020}, 2),
])
def test_prefill_count_from_the_probe(four_threads, cost, best):
    clock = StepClock(cost)
    calls = []
    assert prefill_threads(clock=clock, work=lambda: calls.append(clock.step())) == best
    assert len(calls) <= TRIALS_PER_CANDIDATE * len(cost)
    assert torch.get_num_threads() == 4
    # the default probe: a real matmul, any count of torch's candidates
    assert prefill_threads() in candidates(4) and torch.get_num_threads() == 4


def test_prefill_under_any_count_gives_the_same_tokens(four_threads, monkeypatch):
    torch.manual_seed(1)
    cfg = tiny_config(num_hidden_layers=3, index_topk=8)
    model = DeepseekV32ForCausalLM.from_config(cfg, {"use_index_cache": True, "index_topk_freq": 2},
                                               dtype=torch.float32, indexer_fp8=True, seed=0)
    prompts = [torch.randint(0, cfg["vocab_size"], (n,)).tolist() for n in (40, 29)]
    fixed = generate(model, prompts, 6, stop_tokens=[], prefill_threads=4, decode_threads=4)
    assert fixed.prefill_threads == 4
    seen = []
    monkeypatch.setattr(generation, "PREFILL_PROBE_MIN", 64)  # 69 prompt tokens: probed
    monkeypatch.setattr(generation, "prefill_threads", lambda: seen.append(torch.get_num_threads()) or 2)
    for threads, expect in ((1, 1), (2, 2), (None, 2)):
        res = generate(model, prompts, 6, stop_tokens=[], prefill_threads=threads, decode_threads=4)
        assert res.tokens == fixed.tokens and res.prefill_threads == expect
        assert torch.get_num_threads() == 4
    assert seen == [4]  # probed once, for the auto run, from torch's count
    monkeypatch.setattr(generation, "PREFILL_PROBE_MIN", 70)  # below it: torch's count, no probe
    assert generate(model, prompts, 2, stop_tokens=[], decode_threads=4).prefill_threads == 4 and seen == [4]
    with pytest.raises(ValueError, match="prefill_threads must be >= 1"):
        generate(model, prompts, 2, prefill_threads=0)
    assert torch.get_num_threads() == 4
