"""IndexCache settings from a checkpoint's config.json plus ``--hf-overrides`` (DESIGN.md §2)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from .plan import LayerPlan, build_layer_plan

# key -> (accepted Python types, default)
INDEX_CACHE_KEYS: dict[str, tuple[tuple[type, ...], Any]] = {
    "use_index_cache": ((bool,), False),
    "index_topk_freq": ((int,), 1),
    "index_topk_pattern": ((str,), None),
    "index_skip_topk_offset": ((int,), 2),
    "indexer_types": ((list,), None),
    "index_reuse_steps": ((int,), 1),
    "index_reuse_min_recall": ((float, int), None),
}
# Settings (other than the switch) whose presence in config.json means "trained this way".
SHIPPED_KEYS = ("index_topk_freq", "index_topk_pattern", "index_skip_topk_offset", "indexer_types")
# The per-layer forms; a user override of any of REPLACING_KEYS drops the checkpoint's (DESIGN.md §2:
# transformers writes an all-"full" indexer_types into every GLM-5 config it saves).
PER_LAYER_KEYS = ("index_topk_pattern", "indexer_types")
REPLACING_KEYS = ("index_topk_freq", "index_topk_pattern", "indexer_types")


def parse_overrides(hf_overrides: Union[None, str, Mapping[str, Any]]) -> dict[str, Any]:
    """``--hf-overrides`` as vLLM takes it: a JSON object string, a dict, or None."""
    if hf_overrides is None:
        return {}
    if isinstance(hf_overrides, str):
        text = hf_overrides.strip()
        if not text:
            return {}
        try:
            hf_overrides = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--hf-overrides is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {text!r}") from None
    if not isinstance(hf_overrides, Mapping):
        raise ValueError(f"--hf-overrides must be a JSON object, got {type(hf_overrides).__name__}: {hf_overrides!r}")
    return dict(hf_overrides)


def _check_type(key: str, value: Any, where: str) -> None:
    types, _ = INDEX_CACHE_KEYS[key]
    if value is None and key in ("index_topk_pattern", "indexer_types", "index_reuse_min_recall"):
        return
    ok = isinstance(value, types) and not (bool not in types and isinstance(value, bool))
    if not ok:
        expected = {"use_index_cache": "true or false", "index_topk_freq": "an integer >= 1",
                    "index_topk_pattern": "a string of 'F'/'S'", "index_skip_topk_offset": "an integer >= 1",
                    "indexer_types": 'a list of "full"/"shared"', "index_reuse_steps": "an integer >= 1",
                    "index_reuse_min_recall": "a number in (0, 1]"}[key]
        raise ValueError(f"{key} in {where} must be {expected}, got {type(value).__name__} {value!r}")
    if key == "indexer_types" and not all(isinstance(t, str) for t in value):
        raise ValueError(f'indexer_types in {where} must be a list of "full"/"shared" strings, got {value!r}')
    if key == "index_reuse_steps" and value < 1:
        raise ValueError(f"index_reuse_steps in {where} must be an integer >= 1 (1: every decode step computes), "
                         f"got {value!r}")
    if key == "index_reuse_min_recall" and not 0 < value <= 1:
        raise ValueError(f"index_reuse_min_recall in {where} must be a number in (0, 1] (the share of a fresh "
                         f"selection the reused one must hold), got {value!r}")


@dataclass
class IndexCacheConfig:
    use_index_cache: bool = False
    index_topk_freq: int = 1
    index_topk_pattern: Optional[str] = None
    index_skip_topk_offset: int = 2
    indexer_types: Optional[list] = None
    # decode steps an F layer's selection serves (1: off); only with use_index_cache (DESIGN.md §2)
    index_reuse_steps: int = 1
    # adaptive step reuse: a request recomputes early when its reused selection holds less than this
    # share of the probe F layer's fresh one (models/step_reuse.py); None: fixed schedule
    index_reuse_min_recall: Optional[float] = None
    shipped_by_checkpoint: bool = False  # the settings in force came from config.json itself
    num_hidden_layers: Optional[int] = None
    num_nextn_predict_layers: int = 0
    model_overrides: dict = field(default_factory=dict)  # non-IndexCache override keys
    replaced: list = field(default_factory=list)  # "checkpoint key -> override keys" notes, for the printed plan

    @classmethod
    def from_config(
        cls, config: Optional[Mapping[str, Any]], hf_overrides: Union[None, str, Mapping[str, Any]] = None
    ) -> "IndexCacheConfig":
        """Settings in force for ``config`` (a config.json dict) under ``hf_overrides``.

        Overrides take effect only with ``"use_index_cache": true``; a checkpoint whose own
        config.json ships freq/offset/pattern/indexer_types is honoured as is.
        """
        config = dict(config or {})
        overrides = parse_overrides(hf_overrides)
        for key in INDEX_CACHE_KEYS:
            if key in config:
                _check_type(key, config[key], "config.json")
            if key in overrides:
                _check_type(key, overrides[key], "--hf-overrides")
        unknown = sorted(k for k in overrides if k not in INDEX_CACHE_KEYS and k not in config)
        if unknown:
            warnings.warn(
                f"--hf-overrides keys not known to IndexCache and absent from config.json: {', '.join(unknown)}",
                UserWarning, stacklevel=2,
            )
        merged = {**config, **overrides}
        ships = any(config.get(k) is not None for k in SHIPPED_KEYS)
        switch = merged.get("use_index_cache")
        explicit_on = switch is True
        enabled = explicit_on or (ships and switch is None)
        ic_overrides = [k for k in SHIPPED_KEYS if k in overrides]
        source = merged
        replaced = []
        replacing = [k for k in REPLACING_KEYS if overrides.get(k) is not None]
        if explicit_on and replacing:
            for key in PER_LAYER_KEYS:
                if config.get(key) is not None:
                    if key not in overrides:
                        source = {k: v for k, v in source.items() if k != key}
                    replaced.append(f"config.json's {key} replaced by --hf-overrides {', '.join(replacing)}")
        if ships and not explicit_on:
            source = config
            if ic_overrides and switch is None:
                warnings.warn(
                    f"--hf-overrides {', '.join(ic_overrides)} ignored: the checkpoint ships its own IndexCache "
                    'settings; add "use_index_cache": true to override them',
                    UserWarning, stacklevel=2,
                )

        def get(key):
            value = source.get(key)
            return INDEX_CACHE_KEYS[key][1] if value is None else value

        num_layers = merged.get("num_hidden_layers")
        reuse = merged.get("index_reuse_steps")
        if reuse is not None and reuse != 1 and not explicit_on:
            warnings.warn(f"index_reuse_steps {reuse} ignored: it needs \"use_index_cache\": true", UserWarning,
                          stacklevel=2)
        min_recall = merged.get("index_reuse_min_recall")
        if min_recall is not None and (not explicit_on or reuse is None or reuse == 1):
            warnings.warn(f"index_reuse_min_recall {min_recall} ignored: it needs \"use_index_cache\": true and "
                          "index_reuse_steps > 1", UserWarning, stacklevel=2)
            min_recall = None
        return cls(
            use_index_cache=enabled,
            index_topk_freq=get("index_topk_freq"),
            index_topk_pattern=get("index_topk_pattern"),
            index_skip_topk_offset=get("index_skip_topk_offset"),
            indexer_types=get("indexer_types"),
            index_reuse_steps=reuse if explicit_on and reuse is not None else 1,
            index_reuse_min_recall=None if min_recall is None else float(min_recall),
            shipped_by_checkpoint=ships and enabled and (source is config or not ic_overrides),
            num_hidden_layers=num_layers if isinstance(num_layers, int) else None,
            num_nextn_predict_layers=int(merged.get("num_nextn_predict_layers") or 0),
            model_overrides={k: v for k, v in overrides.items() if k not in INDEX_CACHE_KEYS},
            replaced=replaced,
        )

    def plan(self, num_hidden_layers: Optional[int] = None, num_nextn_predict_layers: Optional[int] = None,
             layer_ids: Optional[list] = None) -> LayerPlan:
        """The layer plan; layer counts default to the config's own. ``layer_ids``: the main layer id
        of each plan position when the plan covers some layers only (the hybrids' indexed layers),
        named in an error about a position."""
        if num_hidden_layers is None:
            if self.num_hidden_layers is None:
                raise ValueError("num_hidden_layers is not in the config; pass it to plan()")
            num_hidden_layers = self.num_hidden_layers
        if num_nextn_predict_layers is None:
            num_nextn_predict_layers = self.num_nextn_predict_layers
        try:
            return build_layer_plan(
                num_hidden_layers,
                num_nextn_predict_layers,
                use_index_cache=self.use_index_cache,
                index_topk_freq=self.index_topk_freq,
                index_topk_pattern=self.index_topk_pattern,
                index_skip_topk_offset=self.index_skip_topk_offset,
                indexer_types=self.indexer_types,
            )
        except ValueError as e:
            if layer_ids is None or list(layer_ids) == list(range(len(layer_ids))):
                raise
            raise ValueError(f"{e} (the plan has one entry per indexed layer: its layer 0 is model layer "
                             f"{layer_ids[0]}, the indexed layers are {', '.join(map(str, layer_ids))})") from None

    def require_one_entry_per_layer(self, indexed: list) -> None:
        """For the hybrid families (GLM-5.3-Flash, Qwen3.8-Flash-Next): a pattern or ``indexer_types``
        in force must have exactly one entry per indexed layer (``indexed``: their layer ids), shorter
        too (DESIGN §2 runs a short pattern F past its end; in a hybrid model a per-layer-length list
        is the likely mistake)."""
        n = len(indexed)
        for key, value in (("index_topk_pattern", self.index_topk_pattern), ("indexer_types", self.indexer_types)):
            if self.use_index_cache and value is not None and len(value) != n:
                raise ValueError(f"{key} has {len(value)} entries but the model has {n} indexed layers "
                                 f"({', '.join(map(str, indexed))}): give one per indexed layer")

    def describe(self, plan: LayerPlan) -> str:
        """One line: the plan's F/S counts, the rule that made it, and where its settings came from."""
        s = f"IndexCache plan: {plan.num_full} F / {plan.num_shared} S over {plan.num_hidden_layers} layers"
        if plan.num_nextn_predict_layers:
            s += f" (+{plan.num_nextn_predict_layers} MTP, always F)"
        if plan.rule == "freq":
            s += f"; freq {self.index_topk_freq}, offset {self.index_skip_topk_offset}"
        elif plan.rule == "off":
            s += "; IndexCache off"
        else:
            s += f"; from {plan.rule}"
        if self.index_reuse_steps > 1:
            s += f"; F layers recompute every {self.index_reuse_steps} decode steps (index_reuse_steps)"
            if self.index_reuse_min_recall is not None:
                s += f", earlier when a reused selection holds < {self.index_reuse_min_recall:g} of a fresh one"
        if self.shipped_by_checkpoint:
            s += "; settings shipped in the checkpoint's config.json"
        return "; ".join([s] + self.replaced)

    def hf_overrides_json(self, pattern: Optional[str] = None) -> str:
        """The --hf-overrides JSON (vLLM / SGLang spelling) that reproduces these settings."""
        if pattern is not None:
            return json.dumps({"use_index_cache": True, "index_topk_pattern": pattern})
        out: dict[str, Any] = {"use_index_cache": self.use_index_cache}
        if self.index_topk_pattern:
            out["index_topk_pattern"] = self.index_topk_pattern
        elif self.indexer_types is not None:  # the per-layer list the plan was built from (GLM-5.2, HY-V4)
            out["indexer_types"] = list(self.indexer_types)
        else:
            out["index_topk_freq"] = self.index_topk_freq
            if self.index_skip_topk_offset != 2:
                out["index_skip_topk_offset"] = self.index_skip_topk_offset
        if self.index_reuse_steps > 1:
            out["index_reuse_steps"] = self.index_reuse_steps
            if self.index_reuse_min_recall is not None:
                out["index_reuse_min_recall"] = self.index_reuse_min_recall
        return json.dumps(out)


def shipped_indexer_types(c: dict, n: int) -> tuple[Optional[list], str]:
    """config.json's ``indexer_types`` as transformers' ``Glm5NextTextConfig`` (GLM-5.3-Flash) makes it (the only key
    its model reads) and the key it came from: shipped as is, else derived from a shipped
    ``index_topk_pattern`` (one entry per layer) or ``index_topk_freq`` / ``index_skip_topk_offset``
    over the layer ids, not the indexed layers (full where ``max(i - offset + 1, 0) % freq == 0``,
    offset 2 by default). The derivation inputs are dropped from ``c``: transformers writes them
    beside the list they made."""
    types = c.get("indexer_types")
    pattern, freq, offset = (c.pop(k, None) for k in ("index_topk_pattern", "index_topk_freq",
                                                         "index_skip_topk_offset"))
    if types is not None:
        return types, "indexer_types"
    if pattern is not None:
        if not isinstance(pattern, (str, list)):
            raise ValueError(f"index_topk_pattern in config.json must be a string of F / S, got {pattern!r}")
        return [{"F": "full", "S": "shared"}.get(t, t) for t in pattern], "index_topk_pattern"
    for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} in config.json must be an integer, got {value!r}")
    if freq is None and offset is None:
        return None, ""
    freq, offset = max(1 if freq is None else freq, 1), 2 if offset is None else offset
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)], "index_topk_freq"
