"""HF-format safetensors checkpoints for DeepSeek-V3.2: read (memory-mapped) and write.

Reading: a directory with ``config.json`` and either one or more ``*.safetensors`` files or a
sharded set indexed by ``model.safetensors.index.json``. Tensor names are the official ones
(DESIGN.md §6). FP8 block-quantized weights (e4m3 ``weight`` + fp32 ``weight_scale_inv``, one
scale per 128x128 block) stay FP8 where the model holds them FP8 (``weights="fp8"``) and are
dequantized as they are read otherwise. Indexer weights of layers the plan marks S are never
read. Each rank of a tensor/pipeline-parallel model reads only its own parameters, and of each
only its slice (``safe_open(...).get_slice``, memory-mapped), copied straight into the parameter:
peak host memory is about the rank's share plus one slice. Names, shapes and files are all
checked against the checkpoint's headers before the first tensor is read.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Optional, Union

import torch

from indexcache.formats import FP32_HEADS, FP32_PARAMS
from indexcache.formats import FP8_WEIGHT_BLOCK as FP8_BLOCK
from indexcache.fp8_blocks import FP8_WEIGHTS, dequantize_fp8_blocks, is_fp8_checkpoint, quantize_fp8_blocks  # noqa: F401
from indexcache.parallel.vocab import head_dtype

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
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


def _should_drop(name: str, model) -> bool:
    """Checkpoint tensors the model knowingly does not build."""
    if model.drops_checkpoint_tensor(name):
        return True
    m = _LAYER.match(name)
    if not m:
        return name.startswith("model.mtp_layers.") and not model.args.num_nextn_predict_layers  # HY-V4's, not run
    layer, rest = int(m.group(1)), m.group(2)
    layers = model.model.layers
    if layer >= len(layers):
        # MTP layers of a model built with fewer (num_nextn_predict_layers overridden to 0)
        return layer >= model.args.num_hidden_layers
    if rest.startswith("self_attn.indexer.") and getattr(layers[layer].self_attn, "indexer", 0) is None:
        return True  # S layer: the plan skipped this indexer
    return rest.startswith("embed_tokens.")  # MTP copy of the embedding; the main one is shared


def _targets(model) -> list:
    """(parameter name, checkpoint name, module, attribute) for each parameter this rank holds once."""
    out, seen = [], set()
    tied_head = model.args.tie_word_embeddings
    rename = getattr(model, "checkpoint_name", lambda n: n)
    for mod_name, mod in model.named_modules():
        for attr, p in mod.named_parameters(recurse=False):
            if id(p) in seen or attr == "weight_scale_inv":  # scales are read with their weight
                continue
            seen.add(id(p))
            name = f"{mod_name}.{attr}" if mod_name else attr
            ckpt = "model.embed_tokens.weight" if tied_head and name == "lm_head.weight" else rename(name)
            out.append((name, ckpt, mod, attr))
    return out


def _slice_of(mod, attr: str):
    """(dim, (start, stop)) of the checkpoint tensor this parameter holds, or (None, None): whole."""
    if hasattr(mod, "param_slice"):  # blocks with sliced parameters of their own (sinks, fused experts)
        return mod.param_slice(attr)
    if attr == "weight" and hasattr(mod, "checkpoint_slice"):
        return mod.checkpoint_slice()
    return None, None


def _full_shape(mod, attr: str, p: torch.Tensor) -> tuple:
    dim, shard = _slice_of(mod, attr)
    if dim is None:
        return tuple(p.shape)
    if hasattr(mod, "param_full_shape"):
        return tuple(mod.param_full_shape(attr))
    shape = list(p.shape)
    shape[dim] = getattr(mod, "full_shape", None)[dim] if hasattr(mod, "full_shape") else getattr(mod, "vocab")
    return tuple(shape)


class _Reader:
    """Slices of the checkpoint's tensors by name, through one open safetensors handle per file."""

    def __init__(self, files: dict, block: tuple):
        from safetensors import safe_open
        self.files, self.block, self._open, self.handles = files, block, safe_open, {}

    def handle(self, name):
        f = self.files[name]
        if f not in self.handles:
            self.handles[f] = self._open(str(f), framework="pt", device="cpu")
        return self.handles[f]

    def shape(self, name) -> tuple:
        return tuple(self.handle(name).get_slice(name).get_shape())

    def read(self, ckpt, dim, lo, hi):
        sl = self.handle(ckpt).get_slice(ckpt)
        if dim is None:
            return sl[:]
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]

    def read_scale(self, ckpt, dim, lo, hi):
        sname = ckpt + "_scale_inv"
        if sname not in self.files:
            raise ValueError(f"{ckpt} is stored in fp8 but {sname} is missing")
        if dim is None:
            return self.read(sname, None, 0, 0), (0, 0)
        b = self.block[dim]
        off = (lo % b, 0) if dim == 0 else (0, lo % b)
        return self.read(sname, dim, lo // b, -(-hi // b)), off


def _check_targets(path: Path, targets: list, reader: _Reader) -> None:
    """Every tensor the model needs is there with its full shape (headers only, before any read)."""
    problems = [f"{ckpt} is missing (expected shape {_full_shape(mod, attr, getattr(mod, attr))})"
                for _, ckpt, mod, attr in targets if ckpt not in reader.files]
    if problems:
        raise ValueError(f"checkpoint {path} lacks weights the model needs: " + "; ".join(problems[:8])
                         + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))
    for name, ckpt, mod, attr in targets:
        have, want = reader.shape(ckpt), _full_shape(mod, attr, getattr(mod, attr))
        if have != want:
            raise ValueError(f"{ckpt} has shape {have} in the checkpoint, the model expects {want}")


def _dense(t: torch.Tensor, ckpt: str) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{ckpt} is stored in fp8: a parameter read as several ranges takes bf16 / fp32 tensors")
    return t


def _copy_param(reader: _Reader, ckpt: str, mod, attr: str, used: set) -> None:
    """This rank's slice of checkpoint tensor ``ckpt`` into ``mod.attr`` (FP8 kept or dequantized)."""
    p = getattr(mod, attr)
    dim, shard = _slice_of(mod, attr)
    if isinstance(shard, list):  # several ranges of one tensor (a fused [q | k | v] projection's heads)
        p.copy_(torch.cat([_dense(reader.read(ckpt, dim, lo, hi), ckpt) for lo, hi in shard], dim=dim))
        used.add(ckpt)
        return
    lo, hi = shard if shard is not None else (0, 0)
    t = reader.read(ckpt, dim, lo, hi)
    used.add(ckpt)
    fp8_param = p.dtype == torch.float8_e4m3fn
    if t.dim() == 3 and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = _dequantize_stacked(reader, ckpt, t, dim, lo, hi, used)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        s, off = reader.read_scale(ckpt, dim, lo, hi)
        used.add(ckpt + "_scale_inv")
        if fp8_param and t.dtype == torch.float8_e4m3fn and reader.block == FP8_BLOCK:
            if tuple(s.shape) != tuple(mod.weight_scale_inv.shape):
                raise ValueError(f"{ckpt}_scale_inv slice has shape {tuple(s.shape)}, expected "
                                 f"{tuple(mod.weight_scale_inv.shape)}")
            p.copy_(t)
            mod.weight_scale_inv.copy_(s)
            return
        t = dequantize_fp8_blocks(t, s, ckpt, reader.block, off)
    if fp8_param:
        mod.set_dense(t)  # a bf16 checkpoint held FP8 (weights="fp8"): quantized in aligned blocks
        return
    if ckpt.endswith(FP32_HEADS) and p.dtype != head_dtype(p.dtype, t.dtype):
        p.data = torch.empty_like(p, dtype=head_dtype(p.dtype, t.dtype))  # a head stored wider than bf16
    p.copy_(t)


def _dequantize_stacked(reader: _Reader, ckpt: str, t: torch.Tensor, dim, lo: int, hi: int, used: set) -> torch.Tensor:
    """A stacked FP8 tensor ``[E, out, in]`` (HY-V4's fused experts, sliced along E) with its
    ``_scale_inv [E, ceil(out/b0), ceil(in/b1)]``: dequantized expert by expert (held in the model dtype)."""
    sname = ckpt + "_scale_inv"
    if sname not in reader.files:
        raise ValueError(f"{ckpt} is stored in fp8 but {sname} is missing")
    s = reader.read(sname, dim, lo, hi)
    used.add(sname)
    if s.dim() != 3 or s.shape[0] != t.shape[0]:
        raise ValueError(f"{sname} has shape {tuple(s.shape)}, expected one block grid per expert of {tuple(t.shape)}")
    return torch.stack([dequantize_fp8_blocks(t[e], s[e], f"{ckpt}[{e}]", reader.block) for e in range(t.shape[0])])


@torch.no_grad()
def load_weights(model, path: Union[str, Path], *, progress: Optional[bool] = None) -> None:
    """Copy every parameter of ``model`` (this rank's) from the checkpoint at ``path`` (see module docstring)."""
    path = Path(path)
    files = _weight_files(path)  # a shard the index names but the directory lacks: error here
    qc = model.config.get("quantization_config") or {}
    reader = _Reader(files, tuple(qc.get("weight_block_size") or FP8_BLOCK))
    targets = _targets(model)
    _check_targets(path, targets, reader)
    rank0 = getattr(model, "par", None) is None or model.par.rank == 0
    total = sum(getattr(m, a).numel() * getattr(m, a).element_size() for _, _, m, a in targets)
    show = (progress if progress is not None else total > _PROGRESS_BYTES) and rank0
    items = targets
    if show:
        from tqdm import tqdm
        items = tqdm(items, desc=f"loading {path.name}", unit="tensor")
    used = set()
    for _, ckpt, mod, attr in items:
        _copy_param(reader, ckpt, mod, attr, used)
    if getattr(model, "par", None) is not None and model.par.distributed:
        return  # each rank reads a subset by design: no "unused tensor" report
    unexpected = [n for n in files if n not in used and not n.endswith("_scale_inv") and not _should_drop(n, model)]
    if unexpected:
        warnings.warn(f"checkpoint tensors not used by the model: {', '.join(unexpected[:8])}"
                      + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""), UserWarning, stacklevel=2)


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def stored_dtypes(path: Union[str, Path]) -> dict:
    """Tensor name -> dtype, for the bf16/fp16/fp32 tensors of a checkpoint directory (headers only)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():
                dt = _ST_DTYPES.get(h.get_slice(name).get_dtype())
                if dt is not None:
                    out[name] = dt
    return out


def storage_dtypes(model, like: Optional[Union[str, Path]] = None, default: torch.dtype = torch.bfloat16) -> dict:
    """Parameter name -> the float dtype to store it in (``save_pretrained``'s ``dtypes``): the
    dtype the checkpoint ``like`` stores it in, else ``default`` (the fp32 indexer head weights and
    routing biases stay fp32). A stored tensor converted straight from an exact fp32 copy of it
    comes out bit for bit as it went in."""
    stored = stored_dtypes(like) if like is not None else {}
    out = {}
    for name, p in model.named_parameters():
        if p.dtype not in _ST_DTYPES.values() or name.endswith("weight_scale_inv"):
            continue
        out[name] = stored.get(name, torch.float32 if name.endswith(FP32_PARAMS) else default)
    return out


def save_pretrained(model, path: Union[str, Path], *, fp8: bool = False, max_shard_bytes: Optional[int] = None,
                    extra_config: Optional[dict] = None, dtypes: Optional[dict] = None,
                    config: Optional[dict] = None) -> None:
    """Write ``config.json`` and safetensors in HF layout; ``fp8`` block-quantizes the linear
    weights as the official checkpoint does; ``max_shard_bytes`` shards with an index file.
    ``dtypes``: parameter name -> the float dtype to store it in (converted straight from the
    parameter, never through another dtype), over the rules below; ``config``: the config.json
    to write instead of ``model.config`` (``extra_config`` is still added)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if getattr(model, "par", None) is not None and model.par.distributed:
        raise ValueError("save_pretrained writes a whole checkpoint from one process; this model is one rank of "
                         f"{model.par.world_size} (the checkpoint each rank read is already on disk)")
    tensors = {}
    seen = set()
    params = dict(model.named_parameters())
    for name, p in params.items():  # named_parameters skips the tied duplicate
        if id(p) in seen or name.endswith("weight_scale_inv"):
            continue
        seen.add(id(p))
        t = p.detach().to("cpu").contiguous()
        if t.dtype == torch.float8_e4m3fn:  # held FP8 (weights="fp8"): written as is, or dequantized
            scale = params[name + "_scale_inv"].detach().to("cpu").contiguous()
            if fp8:
                tensors[name], tensors[name + "_scale_inv"] = t, scale
            else:
                tensors[name] = dequantize_fp8_blocks(t, scale, name).to(model.compute_dtype)
            continue
        if fp8 and FP8_WEIGHTS.search(name):
            q, s = quantize_fp8_blocks(t)
            tensors[name], tensors[name + "_scale_inv"] = q, s
        elif dtypes and name in dtypes:
            tensors[name] = t.to(dtypes[name])
        elif name.endswith(FP32_HEADS):  # held fp32 for fp32 logits; stored in the model dtype as the official ones
            tensors[name] = t.to(model.compute_dtype)
        else:
            tensors[name] = t
    # model.config holds config.json plus model-level overrides; IndexCache overrides never enter
    # it, so settings a checkpoint shipped survive and run-time ones are not baked in.
    config = dict(model.config if config is None else config)
    config.update(extra_config or {})
    config.pop("max_num_batched_tokens", None)
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": list(FP8_BLOCK)}
    else:
        config.pop("quantization_config", None)
    rename = getattr(model, "checkpoint_name", lambda n: n)  # the family's own tensor names
    tensors = {rename(name): t for name, t in tensors.items()}
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

