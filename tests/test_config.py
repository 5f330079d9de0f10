import json
import warnings

import pytest

from indexcache import IndexCacheConfig

V32 = {"model_type": "deepseek_v32", "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "index_topk": 2048}


def test_default_is_off():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = IndexCacheConfig.from_config(V32)
    plan = cfg.plan()
    assert not cfg.use_index_cache and plan.num_full == 61 and len(plan.skip_topk) == 62


@pytest.mark.parametrize("as_string", [False, True])
def test_overrides_dict_or_json_string(as_string):
    ov = {"use_index_cache": True, "index_topk_freq": 4}
    cfg = IndexCacheConfig.from_config(V32, json.dumps(ov) if as_string else ov)
    plan = cfg.plan()
    assert (plan.num_full, plan.num_shared) == (16, 45)
    assert json.loads(cfg.hf_overrides_json()) == ov


def test_override_without_switch_warns_and_is_ignored():
    with pytest.warns(UserWarning, match="use_index_cache is false"):
        plan = IndexCacheConfig.from_config(V32, {"index_topk_freq": 4}).plan()
    assert plan.num_shared == 0


def test_checkpoint_shipped_settings_are_honoured():
    glm = {"num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3}
    cfg = IndexCacheConfig.from_config(glm)
    assert cfg.use_index_cache and cfg.shipped_by_checkpoint
    assert cfg.plan().num_full == 21
    # An override of those settings needs the switch; without it the shipped ones stay.
    with pytest.warns(UserWarning, match="ships its own IndexCache settings"):
        cfg = IndexCacheConfig.from_config(glm, {"index_topk_freq": 2})
    assert cfg.plan().num_full == 21
    cfg = IndexCacheConfig.from_config(glm, {"use_index_cache": True, "index_topk_freq": 2})
    assert cfg.plan().num_full == 3 + len(range(4, 78, 2)) and not cfg.shipped_by_checkpoint
    # And an explicit false turns them off.
    assert IndexCacheConfig.from_config(glm, {"use_index_cache": False}).plan().num_shared == 0


def test_checkpoint_shipped_indexer_types():
    cfg = IndexCacheConfig.from_config({"num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"]})
    assert cfg.plan().pattern == "FSFS"


def test_pattern_and_freq_warns_pattern_wins():
    with pytest.warns(UserWarning, match="pattern wins"):
        plan = IndexCacheConfig.from_config(
            {"num_hidden_layers": 4}, {"use_index_cache": True, "index_topk_freq": 4, "index_topk_pattern": "FSSF"}
        ).plan()
    assert plan.pattern == "FSSF"


@pytest.mark.parametrize(
    "overrides,message",
    [
        ('{"use_index_cache": true,', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"use_index_cache": "yes"}, "use_index_cache in --hf-overrides must be true or false"),
        ({"use_index_cache": True, "index_topk_freq": "4"}, "index_topk_freq in --hf-overrides must be an integer"),
        ({"use_index_cache": True, "index_topk_freq": 4.0}, "must be an integer"),
        ({"use_index_cache": True, "index_topk_pattern": 5}, "index_topk_pattern in --hf-overrides must be a string"),
        ({"use_index_cache": True, "indexer_types": ["full", 1]}, "indexer_types in --hf-overrides must be a list"),
    ],
)
def test_bad_overrides(overrides, message):
    with pytest.raises(ValueError) as info:
        IndexCacheConfig.from_config(V32, overrides)
    assert message in str(info.value)


def test_bad_value_in_config_json():
    with pytest.raises(ValueError, match="index_topk_freq in config.json"):
        IndexCacheConfig.from_config({**V32, "index_topk_freq": "often"})


def test_plan_errors_surface_through_config():
    cfg = IndexCacheConfig.from_config(V32, {"use_index_cache": True, "index_topk_pattern": "SFF"})
    with pytest.raises(ValueError, match="starts with 'S'"):
        cfg.plan()


def test_unknown_override_keys_warn_by_name():
    with pytest.warns(UserWarning, match="index_topk_frequency"):
        cfg = IndexCacheConfig.from_config(V32, {"use_index_cache": True, "index_topk_frequency": 4})
    assert cfg.plan().num_shared == 0
    # A key the config has is a model override, not unknown.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = IndexCacheConfig.from_config(V32, {"index_topk": 1024})
    assert cfg.model_overrides == {"index_topk": 1024}


def test_plan_needs_layers():
    with pytest.raises(ValueError, match="num_hidden_layers is not in the config"):
        IndexCacheConfig.from_config({}).plan()


GLM52 = {"num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3,
         "indexer_types": ["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(78)]}


@pytest.mark.parametrize("key,value,want_full", [
    ("index_topk_freq", 2, 3 + len(range(4, 78, 2))),   # offset 3 stays the checkpoint's
    ("index_topk_pattern", "F" * 10 + "S" * 68, 10),
    ("indexer_types", ["full"] * 40 + ["shared"] * 38, 40),
])
def test_user_per_layer_override_replaces_checkpoint_forms(key, value, want_full):
    # DESIGN §2: any of freq / pattern / indexer_types from the user drops the checkpoint's per-layer forms
    # (here indexer_types, which alone would keep 21 F), and the plan says what replaced what.
    cfg = IndexCacheConfig.from_config(GLM52, {"use_index_cache": True, key: value})
    assert cfg.plan().num_full == want_full
    assert not cfg.shipped_by_checkpoint
    assert cfg.replaced == [f"config.json's indexer_types replaced by --hf-overrides {key}"]
    assert "config.json's indexer_types replaced by --hf-overrides " + key in cfg.describe(cfg.plan())


def test_transformers_all_full_indexer_types_yield_to_user_freq():
    # transformers writes indexer_types (all "full") into every GLM-5 config it saves
    saved = {"num_hidden_layers": 78, "indexer_types": ["full"] * 78}
    assert IndexCacheConfig.from_config(saved).plan().num_shared == 0
    cfg = IndexCacheConfig.from_config(saved, {"use_index_cache": True, "index_topk_freq": 4, "index_skip_topk_offset": 3})
    assert cfg.plan().num_full == 21 and cfg.replaced


def test_offset_override_alone_keeps_checkpoint_pattern():
    cfg = IndexCacheConfig.from_config(GLM52, {"use_index_cache": True, "index_skip_topk_offset": 5})
    assert cfg.plan().num_full == 21 and cfg.replaced == []


def test_disagreeing_pattern_and_indexer_types_in_one_source():
    with pytest.raises(ValueError, match="disagree|differ"):
        IndexCacheConfig.from_config({"num_hidden_layers": 4, "index_topk_pattern": "FSFS",
                                      "indexer_types": ["full", "full", "full", "shared"]}).plan()
    with pytest.raises(ValueError, match="disagree|differ"):
        IndexCacheConfig.from_config({"num_hidden_layers": 4}, {"use_index_cache": True, "index_topk_pattern": "FSFS",
                                                               "indexer_types": ["full", "full", "full", "shared"]}).plan()
    # across sources the user's replaces the checkpoint's: no error
    cfg = IndexCacheConfig.from_config({"num_hidden_layers": 4, "indexer_types": ["full", "full", "full", "shared"]},
                                       {"use_index_cache": True, "index_topk_pattern": "FSFS"})
    assert cfg.plan().pattern == "FSFS"
