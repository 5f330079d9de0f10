import warnings

import pytest

import indexcache


def full_layers(plan):
    return [layer for layer, skip in enumerate(plan.skip_topk) if not skip]


def test_deepseek_v32_freq4():
    plan = indexcache.build_layer_plan(61, 1, use_index_cache=True, index_topk_freq=4)
    assert full_layers(plan) == [0, 1] + list(range(5, 58, 4)) + [61]
    assert (plan.num_full, plan.num_shared) == (16, 45)
    assert len(plan.pattern) == 61 and len(plan.skip_topk) == 62
    # Every S layer reads the nearest earlier F layer; F layers read themselves.
    for layer, src in enumerate(plan.source_layer):
        expected = layer if not plan.skip_topk[layer] else max(f for f in full_layers(plan) if f < layer)
        assert src == expected


def test_glm5_freq4_offset3():
    plan = indexcache.build_layer_plan(78, use_index_cache=True, index_topk_freq=4, index_skip_topk_offset=3)
    assert full_layers(plan) == [0, 1, 2] + list(range(6, 78, 4))
    assert plan.num_full == 21


@pytest.mark.parametrize("layers,freq,offset", [(61, 4, 2), (78, 4, 3), (10, 3, 1), (5, 8, 2), (12, 1, 2)])
def test_freq_rule_matches_formula(layers, freq, offset):
    plan = indexcache.build_layer_plan(layers, use_index_cache=True, index_topk_freq=freq, index_skip_topk_offset=offset)
    assert plan.skip_topk == [max(l - offset + 1, 0) % freq != 0 for l in range(layers)]


def test_pattern_overrides_freq_with_warning():
    with pytest.warns(UserWarning, match="pattern wins"):
        plan = indexcache.build_layer_plan(6, use_index_cache=True, index_topk_freq=4, index_topk_pattern="FSFSSF")
    assert plan.pattern == "FSFSSF"
    assert plan.source_layer == [0, 0, 2, 2, 2, 5]


def test_pattern_shorter_than_layers_rest_is_full():
    plan = indexcache.build_layer_plan(8, 2, use_index_cache=True, index_topk_pattern="FSS")
    assert plan.pattern == "FSSFFFFF"
    assert plan.skip_topk[8:] == [False, False]


def test_indexer_types():
    plan = indexcache.build_layer_plan(4, use_index_cache=True, indexer_types=["full", "shared", "shared", "full"])
    assert plan.pattern == "FSSF" and plan.rule == "indexer_types"
    same = indexcache.build_layer_plan(
        4, use_index_cache=True, indexer_types=["full", "shared", "shared", "full"], index_topk_pattern="FSSF"
    )
    assert same.pattern == "FSSF"


def test_mtp_layers_always_full():
    plan = indexcache.build_layer_plan(4, 3, use_index_cache=True, index_topk_pattern="FSSS")
    assert plan.skip_topk == [False, True, True, True, False, False, False]
    assert plan.source_layer[4:] == [4, 5, 6]


def test_gate_off_is_all_full_and_warns():
    with pytest.warns(UserWarning, match="use_index_cache is false"):
        plan = indexcache.build_layer_plan(8, use_index_cache=False, index_topk_freq=4)
    assert plan.pattern == "F" * 8 and plan.num_shared == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        indexcache.build_layer_plan(8)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(index_topk_freq=0), "index_topk_freq must be >= 1, got 0"),
        (dict(index_topk_freq=-3), "index_topk_freq must be >= 1, got -3"),
        (dict(index_skip_topk_offset=0), "index_skip_topk_offset must be >= 1, got 0"),
        (dict(index_topk_pattern="FFSx"), "'x' at position 3"),
        (dict(index_topk_pattern="FF S"), "' ' at position 2"),
        (dict(index_topk_pattern="SFFF"), "starts with 'S'"),
        (dict(index_topk_pattern="F" * 9), "9 entries but the model has 8"),
        (dict(index_topk_pattern=""), "is empty"),
        (dict(indexer_types=["shared", "full"]), "starts with 'S'"),
        (dict(indexer_types=["full", "dense"]), 'indexer_types[1] is "dense"'),
        (dict(indexer_types=["full"] * 9), "9 entries but the model has 8"),
        (dict(indexer_types=["full", "shared"], index_topk_pattern="FF"), "disagree at layer 1"),
        (dict(index_topk_freq=True), "index_topk_freq must be an int"),
        (dict(index_topk_pattern=["F"]), "index_topk_pattern must be a string"),
        (dict(indexer_types="full"), "indexer_types must be a list"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        indexcache.build_layer_plan(8, use_index_cache=True, **kwargs)
    assert message in str(info.value)


def test_validation_runs_with_switch_off():
    with pytest.raises(ValueError, match="starts with 'S'"):
        indexcache.build_layer_plan(8, use_index_cache=False, index_topk_pattern="SF")


def test_bad_layer_counts():
    with pytest.raises(ValueError, match="num_hidden_layers must be >= 1"):
        indexcache.build_layer_plan(0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be >= 0"):
        indexcache.build_layer_plan(4, -1)


def test_costs_scale_with_shared_layers():
    from indexcache.plan import indexer_costs

    plan = indexcache.build_layer_plan(61, use_index_cache=True, index_topk_freq=4)
    c = indexer_costs(plan, 1000)
    # Hand-computed per-layer figures for V3.2's indexer (64 heads x 128, hidden 7168, q_lora 1536).
    proj = 2 * 1536 * 64 * 128 + 2 * 7168 * 128 + 2 * 7168 * 64
    per_key = 2 * 64 * 128 + 2 * 64
    assert c["decode_flops_per_token"]["all_f"] == 61 * (proj + 1000 * per_key)
    assert c["prefill_flops"]["removed"] == 45 * (1000 * proj + 1000 * 1001 // 2 * per_key)
    assert c["index_k_cache_bytes_per_sequence"]["plan"] == 16 * 1000 * 132
    with pytest.raises(ValueError, match="context must be >= 1"):
        indexer_costs(plan, 0)
