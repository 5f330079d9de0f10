"""HF-format safetensors checkpoints for DeepSeek-V3.2: read (memory-mapped) and write.

Reading: a directory with ``config.json`` and either one or more ``*.safetensors`` files or a
sharded set indexed by ``model.safetensors.index.json``. Tensor names are the official ones
(DESIGN.md §6). FP8 block-quantized weights (e4m3 ``weight`` + fp32 ``weight_scale_inv``, one
scale per 128x128 block) are dequantized as they are read. Indexer weights of layers the plan
marks S are dropped without a word. Each tensor is read through ``safe_open`` (mmap) and copied
straight into its parameter, so the checkpoint is never held twice in memory.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Optional, Union

import torch

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
FP8_BLOCK = (128, 128)
# Linear weights that the official checkpoint stores in fp8 (and the writer quantizes).
FP8_WEIGHTS = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj"
                         r"|wq_b|wk)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_PROGRESS_BYTES = 256 << 20  # show a progress bar above this checkpoint size


def load_config(path: Union[str, Path]) -> dict:
    p = Path(path)
    f = p / CONFIG_NAME if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"no {CONFIG_NAME} at {f}")
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{f} must hold a JSON object")
    return data


def _weight_files(path: Path) -> dict:
    """Tensor name -> safetensors file."""
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        out = {}
        for name, fname in weight_map.items():
            f = path / fname
            if not f.is_file():
                raise ValueError(f"{index} names shard {fname} which is missing")
            out[name] = f
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    from safetensors import safe_open
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():
                out[name] = f
    return out


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, name: str,
                          block: tuple = FP8_BLOCK) -> torch.Tensor:
    """``weight`` e4m3 ``[out, in]`` times its per-block ``scale_inv`` ``[ceil(out/b0), ceil(in/b1)]``."""
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
                         f"{rows}x{cols} weight in {block[0]}x{block[1]} blocks")
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * s


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv) with one scale (amax / 448) per block; inverse of the above."""
    w = weight.float()
    rows, cols = w.shape
    pr, pc = -(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]
    padded = torch.zeros(pr, pc)
    padded[:rows, :cols] = w
    tiles = padded.view(pr // block[0], block[0], pc // block[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(pr, pc)[:rows, :cols].contiguous()
    return q, scale


def _should_drop(name: str, model) -> bool:
    """Checkpoint tensors the model knowingly does not build."""
    m = _LAYER.match(name)
    if not m:
        return False
    layer, rest = int(m.group(1)), m.group(2)
    layers = model.model.layers
    if layer >= len(layers):
        # MTP layers of a model built with fewer (num_nextn_predict_layers overridden to 0)
        return layer >= model.args.num_hidden_layers
    if rest.startswith("self_attn.indexer.") and layers[layer].self_attn.indexer is None:
        return True  # S layer: the plan skipped this indexer
    return rest.startswith("embed_tokens.")  # MTP copy of the embedding; the main one is shared


@torch.no_grad()
def load_weights(model, path: Union[str, Path], *, progress: Optional[bool] = None) -> None:
    """Copy every parameter of ``model`` from the checkpoint at ``path`` (see module docstring)."""
    from safetensors import safe_open
    path = Path(path)
    files = _weight_files(path)
    qc = model.config.get("quantization_config") or {}
    block = tuple(qc.get("weight_block_size") or FP8_BLOCK)
    params = dict(model.named_parameters())  # tied lm_head appears once, under the embedding
    problems = []
    for name, p in params.items():
        if name not in files:
            problems.append(f"{name} is missing (expected shape {tuple(p.shape)})")
    if problems:
        raise ValueError(f"checkpoint {path} lacks weights the model needs: " + "; ".join(problems[:8])
                         + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))
    handles = {}

    def read(name):
        f = files[name]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return handles[f].get_tensor(name)

    total = sum(p.numel() * p.element_size() for p in params.values())
    show = progress if progress is not None else total > _PROGRESS_BYTES
    items = list(params.items())
    if show:
        from tqdm import tqdm
        items = tqdm(items, desc=f"loading {path.name}", unit="tensor")
    used = set()
    for name, p in items:
        t = read(name)
        used.add(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            sname = name + "_scale_inv"
            if sname not in files:
                raise ValueError(f"{name} is stored in fp8 but {sname} is missing")
            t = dequantize_fp8_blocks(t, read(sname), name, block)
            used.add(sname)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)} in the checkpoint, the model expects {tuple(p.shape)}")
        p.copy_(t)
        del t
    unexpected = [n for n in files if n not in used and not n.endswith("_scale_inv") and not _should_drop(n, model)]
    if unexpected:
        warnings.warn(f"checkpoint tensors not used by the model: {', '.join(unexpected[:8])}"
                      + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""), UserWarning, stacklevel=2)


def save_pretrained(model, path: Union[str, Path], *, fp8: bool = False, max_shard_bytes: Optional[int] = None,
                    extra_config: Optional[dict] = None) -> None:
    """Write ``config.json`` and safetensors in HF layout; ``fp8`` block-quantizes the linear
    weights as the official checkpoint does; ``max_shard_bytes`` shards with an index file."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    seen = set()
    for name, p in model.named_parameters():  # named_parameters skips the tied duplicate
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = p.detach().to("cpu").contiguous()
        if fp8 and FP8_WEIGHTS.search(name):
            q, s = quantize_fp8_blocks(t)
            tensors[name], tensors[name + "_scale_inv"] = q, s
        else:
            tensors[name] = t
    # model.config holds config.json plus model-level overrides; IndexCache overrides never enter
    # it, so settings a checkpoint shipped survive and run-time ones are not baked in.
    config = dict(model.config)
    config.update(extra_config or {})
    config.pop("max_num_batched_tokens", None)
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": list(FP8_BLOCK)}
    else:
        config.pop("quantization_config", None)
    shards = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for old in list(path.glob("*.safetensors")) + [path / INDEX_NAME]:
        if old.exists():
            old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

