"""HY-V4 and MiniMax-M3 on vLLM's CPU engine (issue 30 item 3): vLLM 0.32 has no CPU model for either,
so the plugin registers each with vLLM's ModelRegistry on this package's model, over vLLM's paged caches
and batch metadata (``indexcache.integrations.vllm_native``).

Tiny checkpoints written by transformers with fresh random weights, prompts several times longer than
what one query may attend (HY-V4: ``index_topk`` 8; MiniMax-M3: 2 blocks of 4 plus the local block per
KV head), run through ``vllm.LLM`` greedily with fp32 prompt log-probs, and compared with this package's
model on the same checkpoint and overrides (every log-prob within 2e-3, identical greedy tokens) and, for
the prompt positions where every key is selected whatever the indexer scores, with transformers' own
class. A dense control shows the selection matters at these lengths; an IndexCache run is compared with
the all-F answer to show the plan took effect.
"""

import json

import pytest
import torch
from indexcache.tools.random_weights import randomize_
from references import greedy_gap, load_ours, ours_logprobs, transformers_logprobs

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from test_vllm_plugin import LOGPROB_TOL, NEW_TOKENS, REUSE_TOKENS, check_against_generate, run_vllm  # noqa: E402

HY_V4 = dict(vocab_size=80, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=5,
             num_attention_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
             kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, q_lora_rank=24,
             index_topk=8, index_head_dim=128, index_n_heads=4, max_position_embeddings=256,
             pad_token_id=None, bos_token_id=1, eos_token_id=2)
HY_DENSE_PREFIX = 8  # query positions < index_topk see every key

SPARSE = "minimax_m3_sparse"
MINIMAX_M3 = dict(vocab_size=96, hidden_size=48, intermediate_size=16, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rotary_dim=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  num_local_experts=4, num_experts_per_tok=2, dense_intermediate_size=24, shared_intermediate_size=8,
                  index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
                  layer_types=["full_attention", SPARSE, SPARSE, "full_attention", SPARSE],
                  mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
MM_DENSE_PREFIX = 8  # (index_topk_blocks + local) blocks of 4 cover every key of the first 8 positions


def save(model, path, seed):
    randomize_(model, seed)
    model.float().save_pretrained(path)
    return path


def write_hy_v4(path, seed=0, **extra):
    return save(transformers.HYV4ForCausalLM(transformers.HYV4Config(**HY_V4, **extra)), path, seed)


def write_minimax_m3(path, seed=0, vl=False):
    if not vl:
        return save(transformers.MiniMaxM3VLForCausalLM(transformers.MiniMaxM3VLTextConfig(**MINIMAX_M3)), path, seed)
    # the VL layout (language_model.* beside a vision tower the plugin passes over); every MLP routed, the
    # layout this package reads for VL checkpoints
    text = dict(MINIMAX_M3, mlp_layer_types=["sparse"] * 5)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = transformers.MiniMaxM3SparseForConditionalGeneration(
        transformers.MiniMaxM3VLConfig(text_config=text, vision_config=vision))
    return save(model, path, seed)


def prompts(vocab, n_list, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_list]


def check(path, token_prompts, results, overrides, dense_prefix, hf=True, hf_cls=None):
    """Every prompt and generated log-prob within LOGPROB_TOL of this package's model, greedy tokens
    equal; the first ``dense_prefix`` prompt log-probs also against transformers' class."""
    worst = worst_hf = 0.0
    model = load_ours(path, overrides)
    for p, (plp, gen, glp) in zip(token_prompts, results):
        ref, greedy = ours_logprobs(path, p + gen, model=model)
        got = torch.tensor(plp[1:] + glp)
        assert torch.isfinite(got).all()
        worst = max(worst, float((got - ref).abs().max()))
        assert greedy_gap(p, gen, greedy) is None, greedy_gap(p, gen, greedy)
        if hf:
            theirs = transformers_logprobs(path, p[:dense_prefix + 1], hf_cls)
            worst_hf = max(worst_hf, float((got[:dense_prefix] - theirs).abs().max()))
    assert worst < LOGPROB_TOL, f"max |log-prob difference| {worst:.3g}"
    assert worst_hf < LOGPROB_TOL, f"max |log-prob difference| against transformers {worst_hf:.3g}"
    return worst


def far_from(path, seq, got, overrides):
    ref, _ = ours_logprobs(path, seq, overrides)
    return float((torch.tensor(got) - ref).abs().max()) > 10 * LOGPROB_TOL


# ------------------------------------------------------------------------------------------ HY-V4


@pytest.fixture(scope="module")
def hy_shipped(tmp_path_factory):
    """transformers' default indexer_types: full at 0 and every (l - 1) % 4 == 0, shared elsewhere (no
    indexer tensors on disk for the shared layers)."""
    return write_hy_v4(tmp_path_factory.mktemp("hy_v4"))


@pytest.fixture(scope="module")
def hy_full(tmp_path_factory):
    """Every layer with its indexer, so any plan can be asked for with --hf-overrides."""
    return write_hy_v4(tmp_path_factory.mktemp("hy_v4_full"), seed=1, indexer_types=["full"] * 5)


@pytest.fixture(scope="module")
def hy_prompts():
    return prompts(HY_V4["vocab_size"], [45, 29])


def test_hy_v4_shipped_indexer_types(hy_shipped, hy_prompts):
    shipped = json.loads((hy_shipped / "config.json").read_text())["indexer_types"]
    assert shipped == ["full", "full", "shared", "shared", "shared"]
    results = run_vllm(hy_shipped, hy_prompts)
    check(hy_shipped, hy_prompts, results, None, HY_DENSE_PREFIX)
    # the selection matters at these lengths: dense attention is far away
    seq, got = hy_prompts[0] + results[0][1], results[0][0][1:] + results[0][2]
    assert far_from(hy_shipped, seq, got, {"index_topk": 4096})


@pytest.mark.parametrize("overrides", [
    {"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1},
    {"use_index_cache": True, "index_topk_pattern": "FSSFS"},
], ids=["freq2", "pattern"])
def test_hy_v4_index_cache_overrides(hy_full, hy_prompts, overrides):
    results = run_vllm(hy_full, hy_prompts, overrides)
    check(hy_full, hy_prompts, results, overrides, HY_DENSE_PREFIX)
    seq, got = hy_prompts[0] + results[0][1], results[0][0][1:] + results[0][2]
    assert far_from(hy_full, seq, got, None)  # not the all-F answer: the S layers reused


def test_hy_v4_chunked_prefill_and_prefix_cache(hy_full, hy_prompts):
    """16-token prefill chunks (later chunks read earlier ones from vLLM's caches); then, in the same
    engine, a request sharing a 32-token prefix with the first: a prefix-cache hit (vLLM reports its
    cached tokens), whose first blocks are read, not recomputed."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    overrides = {"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1}
    toks = [hy_prompts[0], hy_prompts[0][:32] + hy_prompts[1][:9]]
    llm = LLM(model=str(hy_full), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0, max_num_seqs=2, hf_overrides=overrides,
              enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True,
              block_size=16)  # vLLM's CPU default is 16 for MLA without AMX, 128 with: a 32-token prefix is 2 blocks
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, detokenize=False, ignore_eos=True)
        outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0] for p in toks]
    finally:
        del llm
        gc.collect()
    assert outs[1].num_cached_tokens >= 16, outs[1].num_cached_tokens  # whole blocks of the shared prefix
    model = load_ours(hy_full, overrides)
    worst = 0.0
    for p, out in zip(toks, outs):
        gen = list(out.outputs[0].token_ids)
        ref, greedy = ours_logprobs(hy_full, p + gen, model=model)
        assert greedy_gap(p, gen, greedy) is None, greedy_gap(p, gen, greedy)
        got = torch.tensor([out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(gen)])
        worst = max(worst, float((got - ref[len(p) - 1:]).abs().max()))
    assert worst < LOGPROB_TOL, worst


def test_hy_v4_fp8_kv_cache(hy_shipped, hy_prompts):
    """The 656-byte fp8_ds_mla latent cache through vLLM: greedy tokens equal this package's generation
    over the same cache format; prompt log-probs within the fp8 bars of the fp32 cache's (as GLM-5's)."""
    from indexcache.runtime import generate

    ref = run_vllm(hy_shipped, hy_prompts)
    fp8 = run_vllm(hy_shipped, hy_prompts, kv_cache_dtype="fp8_ds_mla")
    ours = generate(load_ours(hy_shipped), hy_prompts, NEW_TOKENS, kv_cache_dtype="fp8_ds_mla", stop_tokens=[]).tokens
    for (a, _, _), (b, gb, lb), og in zip(ref, fp8, ours):
        assert gb == og
        d = (torch.tensor(a[1:]) - torch.tensor(b[1:])).abs()
        assert torch.isfinite(torch.tensor(lb)).all()
        assert float(d.mean()) < 0.2 and float(d.max()) < 3.0 and float(d.max()) > 0


@pytest.mark.parametrize("engine_kw", [{}, dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=2)],
                         ids=["one-step-prefill", "chunked"])
def test_hy_v4_step_reuse_matches_generate(hy_full, hy_prompts, engine_kw):
    """``index_reuse_steps`` 3 on this package's model over vLLM's batches (keyed by vLLM's request ids):
    tokens and per-step log-probs as this package's ``generate`` with R 3; chunked, the two requests
    decode at different points of their schedules, beside the other's prompt chunks."""
    overrides = {"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1, "index_reuse_steps": 3}
    results = run_vllm(hy_full, hy_prompts, overrides, new_tokens=REUSE_TOKENS, **engine_kw)
    check_against_generate(hy_full, hy_prompts, results, overrides)


# ------------------------------------------------------------------------------------- MiniMax-M3


@pytest.fixture(scope="module")
def mm_path(tmp_path_factory):
    return write_minimax_m3(tmp_path_factory.mktemp("minimax_m3"))


@pytest.fixture(scope="module")
def mm_prompts():
    return prompts(MINIMAX_M3["vocab_size"], [41, 26])


@pytest.mark.parametrize("overrides", [
    None,
    {"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1},
], ids=["all-F", "freq2"])
def test_minimax_m3_matches_our_model(mm_path, mm_prompts, overrides):
    results = run_vllm(mm_path, mm_prompts, overrides)
    check(mm_path, mm_prompts, results, overrides, MM_DENSE_PREFIX)
    seq, got = mm_prompts[0] + results[0][1], results[0][0][1:] + results[0][2]
    if overrides is None:  # dense control: every block selected
        assert far_from(mm_path, seq, got, {"index_topk_blocks": 64})
    else:
        assert far_from(mm_path, seq, got, None)


def test_minimax_m3_shipped_indexer_types(tmp_path, mm_prompts):
    """``indexer_types`` shipped in config.json, one entry per sparse layer (vLLM alone has no such key)."""
    path = write_minimax_m3(tmp_path, seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["indexer_types"] = ["full", "shared", "shared"]
    (path / "config.json").write_text(json.dumps(cfg))
    results = run_vllm(path, mm_prompts)
    check(path, mm_prompts, results, None, MM_DENSE_PREFIX)
    seq, got = mm_prompts[0] + results[0][1], results[0][0][1:] + results[0][2]
    assert far_from(path, seq, got, {"use_index_cache": True, "index_topk_pattern": "FFF"})


def test_minimax_m3_vl_checkpoint_chunked(tmp_path, mm_prompts):
    """The VL checkpoint class (its text tower served, the vision tower passed over), a pattern, 16-token
    prefill chunks."""
    path = write_minimax_m3(tmp_path, seed=3, vl=True)
    overrides = {"use_index_cache": True, "index_topk_pattern": "FSS"}
    results = run_vllm(path, mm_prompts, overrides, enable_chunked_prefill=True, max_num_batched_tokens=16,
                       max_num_seqs=2)
    check(path, mm_prompts, results, overrides, MM_DENSE_PREFIX, hf=False)


# --------------------------------------------------------------------------------- refused in one line


@pytest.mark.parametrize("family", ["minimax_m3", "deepseek_v4"])
def test_step_reuse_refused_for_families_without_it(family, request):
    """MiniMax-M3's block indexer and DeepSeek-V4's CSA indexer reuse across layers only: asking for
    ``index_reuse_steps`` 2 stops the engine at model construction with the package's line."""
    path = request.getfixturevalue({"minimax_m3": "mm_path", "deepseek_v4": "v4_path"}[family])
    overrides = {"use_index_cache": True, "index_topk_freq": 2, "index_reuse_steps": 2}
    with pytest.raises(ValueError, match="index_reuse_steps 2: .* reuses selections across layers only"):
        run_vllm(path, [[3, 4, 5]], overrides)



def test_pipeline_parallel_refused_in_one_line():
    from types import SimpleNamespace

    from indexcache.integrations.vllm_hy_v4 import IndexCacheHYV4ForCausalLM

    cfg = SimpleNamespace(model_config=None, parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                                             pipeline_parallel_size=2))
    with pytest.raises(ValueError) as err:
        IndexCacheHYV4ForCausalLM(vllm_config=cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("indexcache: HYV4ForCausalLM serves on vLLM's CPU platform without "
                                              "pipeline parallelism; drop --pipeline-parallel-size 2")


# ------------------------------------------------------------------------ across processes, TP 2


def two_workers(monkeypatch):
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.fail(f"TP 2 needs two CPU cores, this process may use {cores}")
    # vLLM binds each CPU worker to a NUMA node by default and refuses two workers on one node
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    # an earlier in-process engine core froze vLLM's environment reading (envs.enable_envs_cache)
    vllm.envs.disable_envs_cache()


@pytest.mark.parametrize("family", ["hy_v4", "minimax_m3"])
def test_tensor_parallel_2(family, hy_full, hy_prompts, mm_path, mm_prompts, monkeypatch):
    """``tensor_parallel_size=2`` through vLLM's CPU executor (two worker processes, each building its rank's
    shard of this package's model over vLLM's tensor-parallel group: MLA heads / GQA query and KV heads and
    the experts split, the caches of its shard), IndexCache on: the same greedy tokens as TP 1 and every
    log-prob within the bars against this package's single-process model."""
    path, token_prompts, dense = (hy_full, hy_prompts, HY_DENSE_PREFIX) if family == "hy_v4" else \
        (mm_path, mm_prompts, MM_DENSE_PREFIX)
    overrides = {"use_index_cache": True, "index_topk_pattern": "FSFSS"} if family == "hy_v4" else \
        {"use_index_cache": True, "index_topk_pattern": "FSS"}
    one = run_vllm(path, token_prompts, overrides)
    two_workers(monkeypatch)
    two = run_vllm(path, token_prompts, overrides, tensor_parallel_size=2)
    for (plp1, gen1, _), (plp2, gen2, _) in zip(one, two):
        assert gen2 == gen1
        assert float((torch.tensor(plp2[1:]) - torch.tensor(plp1[1:])).abs().max()) < LOGPROB_TOL
    check(path, token_prompts, two, overrides, dense, hf=False)


# ------------------------------------------------------------------------------------ DeepSeek-V4

V4_SLIDING, V4_CSA, V4_HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
DEEPSEEK_V4 = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4,
                   head_dim=64, q_lora_rank=16, partial_rotary_factor=16 / 64, num_experts_per_tok=2,
                   n_routed_experts=4, layer_types=[V4_SLIDING, V4_CSA, V4_HCA, V4_CSA, V4_CSA],
                   compress_rates={V4_CSA: 4, V4_HCA: 8}, hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=8,
                   index_n_heads=16, index_head_dim=32, index_topk=3,
                   mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], max_position_embeddings=256)
V4_DENSE_PREFIX = 8  # inside the sliding window, with fewer CSA entries than index_topk


def write_deepseek_v4(path, seed=0):
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV4ForCausalLM")
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**DEEPSEEK_V4))
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("tid2eid"):  # token -> experts: distinct experts per token
                t.copy_(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t.shape[0])]))
    model.float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    path = write_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4"))
    # as transformers writes it: the kinds the pinned transformers' generic check refuses
    assert json.loads((path / "config.json").read_text())["mlp_layer_types"][0] == "hash_moe"
    return path


@pytest.fixture(scope="module")
def v4_prompts():
    return prompts(DEEPSEEK_V4["vocab_size"], [43, 27])


@pytest.mark.parametrize("overrides,engine", [
    (None, {}),
    ({"use_index_cache": True, "index_topk_freq": 2, "index_skip_topk_offset": 1}, {}),
    ({"use_index_cache": True, "index_topk_pattern": "FSS"},
     {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "max_num_seqs": 2}),
], ids=["all-F", "freq2", "pattern-chunked"])
def test_deepseek_v4_matches_our_model(v4_path, v4_prompts, overrides, engine):
    results = run_vllm(v4_path, v4_prompts, overrides, **engine)
    check(v4_path, v4_prompts, results, overrides, V4_DENSE_PREFIX, hf=not engine,
          hf_cls=transformers.DeepseekV4ForCausalLM)
    seq, got = v4_prompts[0] + results[0][1], results[0][0][1:] + results[0][2]
    if overrides is None:  # dense control: every compressed entry selected
        assert far_from(v4_path, seq, got, {"index_topk": 64})
    else:  # not the all-F answer: the S CSA layers reused the F layer's entries
        assert far_from(v4_path, seq, got, None)


def test_deepseek_v4_shipped_indexer_types(tmp_path, v4_prompts):
    path = write_deepseek_v4(tmp_path, seed=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["indexer_types"] = ["full", "shared", "full"]  # one entry per CSA layer
    (path / "config.json").write_text(json.dumps(cfg))
    results = run_vllm(path, v4_prompts)
    check(path, v4_prompts, results, None, V4_DENSE_PREFIX, hf=False)
    seq, got = v4_prompts[0] + results[0][1], results[0][0][1:] + results[0][2]
    assert far_from(path, seq, got, {"use_index_cache": True, "index_topk_pattern": "FFF"})


# ------------------------------------------------------------------------- behind `vllm serve`


def test_deepseek_v4_behind_vllm_serve(v4_path, v4_prompts, tmp_path):
    """`vllm serve` as users start it (API server + spawned engine core, the plugin and its V4 config class
    in both), IndexCache on, 16-token prefill chunks, two concurrent token-id completions: greedy tokens
    and their log-probs as this package's model's."""
    import concurrent.futures

    from test_vllm_serve import START_TIMEOUT_S, VLLM_BIN

    from indexcache.integrations.vllm_server import free_port, http, start, stop, wait_ready

    overrides = {"use_index_cache": True, "index_topk_pattern": "FSS"}
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [str(VLLM_BIN), "serve", str(v4_path), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "v4", "--dtype", "float32", "--skip-tokenizer-init", "--max-model-len", "256",
           "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--enable-chunked-prefill",
           "--kv-cache-memory-bytes", str(32 << 20), "--enforce-eager", "--seed", "0",
           "--hf-overrides", json.dumps(overrides)]
    proc = start(cmd, log)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, base, log, START_TIMEOUT_S)
        body = lambda p: {"model": "v4", "prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,  # noqa: E731
                          "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            resps = list(pool.map(lambda p: http(base + "/v1/completions", body(p)), v4_prompts))
    finally:
        stop(proc)
    assert "IndexCache plan: 1 F / 2 S over 3 layers" in log.read_text()
    model = load_ours(v4_path, overrides)
    for p, resp in zip(v4_prompts, resps):
        choice = resp["choices"][0]
        gen = list(choice["token_ids"])
        ref, greedy = ours_logprobs(v4_path, p + gen, model=model)
        assert greedy_gap(p, gen, greedy) is None, greedy_gap(p, gen, greedy)
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert float((got - ref[len(p) - 1:]).abs().max()) < LOGPROB_TOL
