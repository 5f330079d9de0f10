"""Pattern tools (issue: choosing a pattern): overlap, greedy search, eval, training."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from indexcache.cli import main
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.tiny import tiny_config
from indexcache.tools.patterns import (PatternRunner, evaluate, greedy_search, load_all_full, overlap_matrix,
                                      overlap_search, source_overlap, text_windows, uniform_pattern)

CFG = tiny_config(num_hidden_layers=5, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, num_attention_heads=2, index_n_heads=2,
                  index_topk=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                  num_nextn_predict_layers=0, max_position_embeddings=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-dsa")
    DeepseekV32ForCausalLM.from_config(CFG, dtype=torch.float32, seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def windows():
    g = torch.Generator().manual_seed(7)
    text = bytes(torch.randint(32, 127, (3 * 48 + 1,), generator=g).tolist())
    return text_windows(text, 48, 3)


def test_overlap_matrix(ckpt, windows):
    m = overlap_matrix(load_all_full(ckpt), windows)
    assert m.shape == (5, 5)
    assert torch.allclose(m.diagonal(), torch.ones(5, dtype=m.dtype))
    assert (m >= 0).all() and (m <= 1).all()
    src = source_overlap(m, "FSSFS")
    assert src[0] == 1.0 and src[3] == 1.0 and src[1] == float(m[1, 0]) and src[4] == float(m[4, 3])


def test_search_is_greedy_and_matches_eval(ckpt, windows, tmp_path):
    model = load_all_full(ckpt)
    runner = PatternRunner(model, windows)
    log = tmp_path / "search.jsonl"
    steps = greedy_search(runner, log, progress=False)
    assert [s["num_full"] for s in steps] == [5, 4, 3, 2, 1]
    for prev, cur in zip(steps, steps[1:]):
        assert cur["pattern"][0] == "F"  # layer 0 never turns S
        cands = {int(k): v for k, v in cur["candidates"].items()}
        assert 0 not in cands and set(cands) == {l for l in range(1, 5) if prev["pattern"][l] == "F"}
        assert cur["loss"] == min(cands.values()) and cands[cur["layer"]] == cur["loss"]
        # The incremental run (layers below the change reused) equals a full run of the pattern.
        assert runner.pattern_loss(cur["pattern"]) == cur["loss"]
    # The recorded loss equals `eval` of that pattern on the same text (a model built with it).
    pat = steps[2]["pattern"]
    rows = evaluate(ckpt, [None, {"use_index_cache": True, "index_topk_pattern": pat}], windows, timing_repeats=1)
    assert rows[1]["pattern"] == pat and rows[1]["loss_nats"] == steps[2]["loss"]
    assert rows[0]["loss_nats"] == steps[0]["loss"]


def test_search_resumes_from_its_log(ckpt, windows, tmp_path):
    runner = PatternRunner(load_all_full(ckpt), windows)
    full = greedy_search(runner, tmp_path / "a.jsonl", progress=False)
    log = tmp_path / "b.jsonl"
    greedy_search(runner, log, min_full=3, progress=False)
    resumed = greedy_search(runner, log, progress=False)
    assert [s["pattern"] for s in resumed] == [s["pattern"] for s in full]
    assert len(log.read_text().splitlines()) == len(full)


def test_eval_all_full_equals_plain_loss(ckpt, windows):
    rows = evaluate(ckpt, [None], windows, timing_repeats=1)
    model = DeepseekV32ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    logits = model(windows[:, :-1])
    plain = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert rows[0]["loss_nats"] == pytest.approx(float(plain), rel=1e-6)
    assert rows[0]["bits_per_byte"] == pytest.approx(rows[0]["loss_nats"] / math.log(2))
    assert rows[0]["prefill_ratio"] == 1.0


def test_uniform_pattern_matches_plan():
    import indexcache

    for freq in (2, 4, 8):
        plan = indexcache.build_layer_plan(61, use_index_cache=True, index_topk_freq=freq)
        assert uniform_pattern(61, freq) == plan.pattern


def test_bad_input(ckpt, tmp_path, capsys):
    with pytest.raises(ValueError, match="shorter than one window"):
        text_windows(b"short text", 48, 2)
    runner = PatternRunner(load_all_full(ckpt), text_windows(b"x" * 200, 48, 1))
    with pytest.raises(ValueError, match="at least one F layer"):
        greedy_search(runner, None, min_full=0, progress=False)
    text = tmp_path / "t.txt"
    text.write_bytes(b"y" * 1000)
    assert main(["eval", "--model", str(ckpt), "--text", str(text), "--context", "48", "--windows", "1",
                 "--overrides", '{"use_index_cache": true,']) == 2
    assert "overrides entry 0" in capsys.readouterr().err
    assert main(["search", "--model", str(ckpt), "--text", str(text), "--context", "2000", "--windows", "1"]) == 2
    assert "exceeds max_position_embeddings" in capsys.readouterr().err
    not_dsa = tmp_path / "dense"
    not_dsa.mkdir()
    cfg = dict(CFG)
    del cfg["index_topk"]
    (not_dsa / "config.json").write_text(json.dumps(cfg))
    assert main(["overlap", "--model", str(not_dsa), "--text", str(text), "--context", "48", "--windows", "1"]) == 2
    assert "index_topk" in capsys.readouterr().err


def test_cli_search_json(ckpt, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 10)
    assert main(["search", "--model", str(ckpt), "--text", str(text), "--context", "48", "--windows", "2",
                 "--json", "--png", str(tmp_path / "s.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budgets"]["1/2"]["num_full"] == 3
    assert json.loads(out["budgets"]["1/4"]["hf_overrides"])["index_topk_pattern"] == out["budgets"]["1/4"]["pattern"]
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_training_loss_falls(tmp_path):
    from indexcache.tools import train as tr

    cfg = dict(CFG, num_nextn_predict_layers=1, index_topk=8)
    sched = tr.TrainSchedule(dense_steps=12, warmup_steps=3, sparse_steps=3, batch=2, context=32, sparse_batch=1,
                             sparse_context=40, lr=3e-3,
                             eval_every=6, eval_bytes=4096)
    lines = []
    final = tr.train(tmp_path / "run", sched, log=lines.append, config=cfg, max_train_bytes=200_000)
    hist = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [h["phase"] for h in hist] == ["dense"] * 12 + ["warmup"] * 3 + ["sparse"] * 3
    dense = [h["lm_bits"] for h in hist[:12]]
    assert sum(dense[-3:]) / 3 < sum(dense[:3]) / 3  # the loss falls
    assert all(h["kl"] is not None for h in hist[12:])
    model = DeepseekV32ForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert model.args.index_topk == 8


# ---------------------------------------------------------------------------- MiniMax-M3 (indexed sparse layers)

MM_LAYERS = ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse",
             "minimax_m3_sparse"]
MM_CFG = dict(model_type="minimax_m3_vl_text", architectures=["MiniMaxM3VLForCausalLM"], vocab_size=256,
              hidden_size=48, intermediate_size=16, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
              num_local_experts=4, num_experts_per_tok=2, dense_intermediate_size=24, shared_intermediate_size=8,
              index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
              layer_types=MM_LAYERS, mlp_layer_types=["dense", "sparse"] * 3, max_position_embeddings=256,
              indexcache_tokenizer="bytes", bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory):
    from indexcache.models import MiniMaxM3ForCausalLM

    path = tmp_path_factory.mktemp("tiny-minimax")
    MiniMaxM3ForCausalLM.from_config(MM_CFG, dtype=torch.float32, seed=4).save_pretrained(path)
    return path


def test_minimax_overlap_is_block_set_overlap_per_head(mm_ckpt, windows):
    model = load_all_full(mm_ckpt)
    assert model.indexed == [1, 2, 4, 5]
    m = overlap_matrix(model, windows)
    assert m.shape == (4, 4) and torch.allclose(m.diagonal(), torch.ones(4, dtype=m.dtype))
    # by hand: per query row whose window holds more than 2 blocks of 4, per KV head, the share of
    # sparse layer i's blocks that sparse layer j also picked
    state = PatternRunner(model, windows).run("FFFF")
    pos = torch.arange(48).repeat(windows.shape[0])
    for i, j in ((0, 1), (3, 0), (2, 3)):
        shares = []
        for r in range(pos.shape[0]):
            if pos[r] // 4 + 1 <= 2:
                continue
            for h in range(2):
                a = {int(b) for b in state.rows[i][r].view(2, 2)[h] if b >= 0}
                b = {int(b) for b in state.rows[j][r].view(2, 2)[h] if b >= 0}
                assert len(a) == 2 and max(a) <= pos[r] // 4
                shares.append(len(a & b) / len(a))
        assert float(m[i, j]) == pytest.approx(sum(shares) / len(shares), abs=1e-12)
    assert float(m.min()) < 1.0  # the layers do not all pick the same blocks


def test_minimax_search_matches_eval(mm_ckpt, windows, tmp_path):
    runner = PatternRunner(load_all_full(mm_ckpt), windows)
    assert runner.num_layers == 4 and runner.num_main_layers == 6
    steps = greedy_search(runner, tmp_path / "mm.jsonl", progress=False)
    assert [s["num_full"] for s in steps] == [4, 3, 2, 1]
    for cur in steps[1:]:
        assert runner.pattern_loss(cur["pattern"]) == cur["loss"]  # resumed at a sparse layer = a whole run
    assert len({s["loss"] for s in steps}) > 1
    pat = steps[2]["pattern"]
    rows = evaluate(mm_ckpt, [None, {"use_index_cache": True, "index_topk_pattern": pat}], windows, timing_repeats=1)
    assert rows[1]["pattern"] == pat and rows[1]["loss_nats"] == steps[2]["loss"]
    assert rows[0]["loss_nats"] == steps[0]["loss"]


def test_minimax_cli_overlap(mm_ckpt, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 10)
    assert main(["overlap", "--model", str(mm_ckpt), "--text", str(text), "--context", "40", "--windows", "2",
                 "--hf-overrides", '{"use_index_cache": true, "index_topk_pattern": "FSFS"}']) == 0
    out = capsys.readouterr().out
    assert "top-2 block (4 keys, per KV head) overlap" in out and "are layers 1, 2, 4, 5" in out
    assert "pattern FSFS" in out


# ---------------------------------------------------------------------------- DeepSeek-V4 (indexed CSA layers)

V4_CSA, V4_HCA = "compressed_sparse_attention", "heavily_compressed_attention"
V4_CFG = dict(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=256, hidden_size=32,
              moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4, head_dim=64, q_lora_rank=16,
              partial_rotary_factor=16 / 64, num_experts_per_tok=2, n_routed_experts=4,
              layer_types=["sliding_attention", V4_CSA, V4_HCA, V4_CSA, V4_CSA], compress_rates={V4_CSA: 4, V4_HCA: 8},
              hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=16, index_head_dim=32,
              index_topk=3, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], max_position_embeddings=256,
              indexcache_tokenizer="bytes", bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    from indexcache.models import DeepseekV4ForCausalLM

    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    DeepseekV4ForCausalLM.from_config(V4_CFG, dtype=torch.float32, seed=3).save_pretrained(path)
    return path


def test_deepseek_v4_overlap_search_and_eval_over_csa_layers(v4_ckpt, windows, tmp_path):
    """The pattern tools plan DeepSeek-V4 over its CSA layers (1, 3, 4): the overlap matrix is one
    row per CSA layer, a searched pattern's loss is the loss of a model built with it."""
    model = load_all_full(v4_ckpt)
    assert model.indexed == [1, 3, 4]
    m = overlap_matrix(model, windows)
    assert m.shape == (3, 3) and torch.allclose(m.diagonal(), torch.ones(3, dtype=m.dtype))
    assert float(m.min()) >= 0.0 and float(m.max()) <= 1.0
    runner = PatternRunner(model, windows)
    assert runner.num_layers == 3 and runner.num_main_layers == 5
    steps = greedy_search(runner, tmp_path / "v4.jsonl", progress=False)
    assert [s["num_full"] for s in steps] == [3, 2, 1]
    for cur in steps[1:]:
        assert runner.pattern_loss(cur["pattern"]) == cur["loss"]
    assert len({s["loss"] for s in steps}) > 1  # S layers attend over other picks than their own
    pat = steps[1]["pattern"]
    rows = evaluate(v4_ckpt, [None, {"use_index_cache": True, "index_topk_pattern": pat}], windows, timing_repeats=1)
    assert rows[1]["pattern"] == pat and rows[1]["loss_nats"] == steps[1]["loss"]
    assert rows[0]["loss_nats"] == steps[0]["loss"]


def _brute_force(matrix: torch.Tensor, num_full: int) -> float:
    import itertools

    n, best = matrix.shape[0], float("-inf")
    for rest in itertools.combinations(range(1, n), num_full - 1):
        pattern = "".join("F" if i == 0 or i in rest else "S" for i in range(n))
        best = max(best, sum(o for o, c in zip(source_overlap(matrix, pattern), pattern) if c == "S"))
    return best


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_overlap_search_is_the_best_pattern(n):
    g = torch.Generator().manual_seed(n)
    for _ in range(4):
        matrix = torch.rand(n, n, generator=g, dtype=torch.float64)
        for keep in range(1, n + 1):
            pattern, mean = overlap_search(matrix, keep)
            assert len(pattern) == n and pattern[0] == "F" and pattern.count("F") == keep
            got = sum(o for o, c in zip(source_overlap(matrix, pattern), pattern) if c == "S")
            assert got == pytest.approx(_brute_force(matrix, keep), abs=1e-12)
            assert mean == pytest.approx(got / (n - keep) if n > keep else 1.0)


def test_overlap_search_by_hand():
    # layer 2 overlaps layer 0 poorly and layer 1 well; layer 3 overlaps layer 2 best
    m = torch.tensor([[1.0, 0.9, 0.1, 0.1],
                      [0.9, 1.0, 0.8, 0.2],
                      [0.1, 0.8, 1.0, 0.9],
                      [0.1, 0.2, 0.9, 1.0]])
    assert overlap_search(m, 1) == ("FSSS", pytest.approx((0.9 + 0.1 + 0.1) / 3))
    assert overlap_search(m, 2) == ("FSFS", pytest.approx((0.9 + 0.9) / 2))
    assert overlap_search(m, 4) == ("FFFF", 1.0)
    with pytest.raises(ValueError, match="num_full must be in"):
        overlap_search(m, 0)
    with pytest.raises(ValueError, match="must be square"):
        overlap_search(m[:3], 2)


def test_cli_overlap_search_json(ckpt, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 10)
    argv = ["search", "--model", str(ckpt), "--text", str(text), "--context", "48", "--windows", "2", "--json"]
    assert main(argv + ["--method", "overlap"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "overlap" and out["steps"] == [] and out["search_seconds"] > 0
    model = load_all_full(ckpt)
    windows = text_windows(text.read_bytes(), 48, 2)
    matrix = overlap_matrix(model, windows)
    runner = PatternRunner(model, windows)
    for name, c in out["budgets"].items():
        pattern, mean = overlap_search(matrix, c["num_full"])
        assert c["pattern"] == pattern and c["source_overlap"] == pytest.approx(mean)
        assert c["loss"] == pytest.approx(runner.pattern_loss(pattern), rel=1e-6)
        assert json.loads(c["hf_overrides"])["index_topk_pattern"] == pattern
    assert main(argv + ["--method", "overlap", "--min-full", "2"]) == 2
    assert "--method greedy" in capsys.readouterr().err
