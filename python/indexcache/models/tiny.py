"""The embedded default checkpoint: a tiny DeepSeek-V3.2-shaped model, built on demand.

Seeded and deterministic; written in HF format under ``$INDEXCACHE_CACHE_DIR`` (default
``~/.cache/indexcache``) in a directory keyed by a hash of its config, seed and builder
version, so a changed recipe never reuses a stale build. Byte-level vocabulary (256 bytes,
then BOS 256 and EOS 257). Its weights are random: the text it writes is noise, but every code
path (MLA, indexer, MoE, MTP, caches) runs at a size where ``index_topk`` (32) is far below
the context, so sparsity is real after a few hundred tokens.

:func:`embedded_model_path` is what the command line runs on: the trained checkpoint that
ships inside the package (``indexcache/data/dsa-tiny``, made by ``indexcache train``) when it
is there, else this random one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

BUILDER_VERSION = 1
DEFAULT_SEED = 0

TINY_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "indexcache_tokenizer": "bytes",
    "vocab_size": 264,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "hidden_size": 192,
    "intermediate_size": 384,
    "moe_intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "index_n_heads": 8,
    "index_head_dim": 128,
    "index_topk": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def tiny_config(**overrides) -> dict:
    """A copy of the embedded config with keys replaced (tests shrink it further)."""
    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg.update(overrides)
    return cfg


def cache_root() -> Path:
    root = os.environ.get("INDEXCACHE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "indexcache"


def content_key(config: dict, seed: int, fp8: bool) -> str:
    blob = json.dumps({"config": config, "seed": seed, "fp8": fp8, "builder": BUILDER_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_checkpoint(path: Path, config: Optional[dict] = None, seed: int = DEFAULT_SEED, fp8: bool = False) -> Path:
    """Write a seeded random checkpoint (all layers F, MTP included) in HF format to ``path``."""
    from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
    model = DeepseekV32ForCausalLM.from_config(config or TINY_CONFIG, dtype=torch.bfloat16, seed=seed)
    model.save_pretrained(path, fp8=fp8)
    return Path(path)


def default_model_path(*, seed: int = DEFAULT_SEED, fp8: bool = False, root: Optional[Path] = None) -> Path:
    """Directory of the embedded default checkpoint, building it the first time."""
    root = Path(root) if root else cache_root()
    target = root / f"tiny-v32-{content_key(TINY_CONFIG, seed, fp8)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-v32-", dir=root))
    try:
        build_checkpoint(tmp, TINY_CONFIG, seed, fp8)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(target)  # atomic: concurrent builders produce identical contents
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "data" / "dsa-tiny"


def embedded_model_path() -> Path:
    """The checkpoint the CLI uses without --model: the shipped trained model, else the random tiny one."""
    if (SHIPPED_MODEL / "config.json").is_file():
        return SHIPPED_MODEL
    return default_model_path()


def is_shipped(path) -> bool:
    return Path(path).resolve() == SHIPPED_MODEL
