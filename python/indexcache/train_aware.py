"""Training-aware IndexCache: retrain the kept (F) indexers to serve every layer that reuses them.

Training-free IndexCache (``indexcache search``) chooses which layers keep an indexer; the
indexers themselves were trained for their own layer only. Here each F layer's indexer is
trained with a **multi-layer distillation loss**: its target is the mean, over the layers it
serves (itself and the S layers whose ``plan.source_layer`` it is), of their head-summed
attention distributions,

    target[t] = 1/|L_f| * sum_{l in L_f} 1/H * sum_h softmax(scores_l,h[t] over the allowed keys)
    loss_f    = mean_t KL(target[t] || softmax(indexer_f logits[t] over the allowed keys))

with the allowed keys being the causal window in the **warm-up** stage (dense attention) and
the top-k that the F indexer selected in the **sparse** stage (every layer it serves attends
over exactly that selection, as at inference). With one layer per group this is the DSA
recipe's own indexer loss (``train.py``).

Memory stays bounded on long contexts: the forward keeps O(T) tensors per layer (queries,
keys, the selected positions) for one group of layers at a time (a group's KL is taken as soon
as its last layer has run), and attention rows, targets and indexer logits are computed in
query chunks of at most ``chunk_elems`` scores (``[B, H, rows, keys]``), never a whole
``[T, T]`` per layer; the indexer's KL is back-propagated chunk by chunk.

Modes: ``indexers`` (default) trains the kept indexers only; every other weight is frozen
and comes out bit-identical. ``model`` also trains the main layers on the language-model
loss in the sparse stage (the MTP layers stay as they are).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import IndexCacheConfig, parse_overrides
from .resume import load_resume_state, save_resume_state

# Scores per attention/indexer chunk ([B, H, rows, keys] fp32): 64 MB.
CHUNK_ELEMS = 1 << 24
MODES = ("indexers", "model")
# Keys that describe a pattern; the saved config carries the pattern as indexer_types only.
PATTERN_KEYS = ("index_topk_freq", "index_topk_pattern", "index_skip_topk_offset", "indexer_types")


# ---------------------------------------------------------------------------- the loss

def serving_groups(source_layer: Sequence[int], num_layers: int) -> dict:
    """F layer -> the main layers that read its indices (itself first), from ``plan.source_layer``."""
    groups: dict = {}
    for layer in range(num_layers):
        groups.setdefault(int(source_layer[layer]), []).append(layer)
    for f, served in groups.items():
        if served[0] != f:
            raise ValueError(f"layer {served[0]} reads layer {f}, which is not an F layer below it")
    return groups


def served_target(layer_probs) -> torch.Tensor:
    """The multi-layer target ``[B, rows, keys]``: the mean over layers of each layer's head-mean
    attention distribution (``layer_probs``: per served layer ``[B, H, rows, keys]``, rows summing
    to 1; any iterable, consumed one layer at a time)."""
    target, count = None, 0
    for p in layer_probs:
        t = p.float().mean(1)
        target = t if target is None else target + t
        count += 1
    if count == 0:
        raise ValueError("an indexer must serve at least one layer")
    target = target / count
    return target / target.sum(-1, keepdim=True).clamp_min(1e-30)


def kl_rows(index_logits: torch.Tensor, target: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Per row ``KL(target || softmax(index_logits over allowed))``: ``[B, rows]`` (nats)."""
    logp = torch.log_softmax(index_logits.float().masked_fill(~allowed, -math.inf), dim=-1)
    terms = target * (torch.log(target.clamp_min(1e-12)) - logp.clamp_min(-1e4))
    return terms.masked_fill(~allowed, 0).sum(-1)


def multi_layer_kl(index_logits: torch.Tensor, layer_probs: Sequence[torch.Tensor], allowed: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the multi-layer loss of one indexer (the module docstring's ``loss_f``)."""
    return kl_rows(index_logits, served_target(layer_probs), allowed).mean()


# ---------------------------------------------------------------------------- chunked pieces

def _row_chunks(b: int, heads: int, t: int, chunk_elems: int):
    rows = max(1, min(t, chunk_elems // max(1, b * heads * t)))
    return [(r0, min(t, r0 + rows)) for r0 in range(0, t, rows)]


def _allowed_rows(sel: Optional[torch.Tensor], r0: int, r1: int, b: int, device) -> torch.Tensor:
    """Bool ``[B, r1 - r0, r1]``: the causal window, or the selected positions (``sel`` int64
    ``[B, T, k]``, -1 = none) within it."""
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    causal = torch.arange(r1, device=device).unsqueeze(0) <= rows
    if sel is None:
        return causal.expand(b, -1, -1)
    s = sel[:, r0:r1]
    m = torch.zeros(b, r1 - r0, r1 + 1, dtype=torch.bool, device=device)
    m.scatter_(-1, torch.where((s >= 0) & (s < r1), s, r1), True)
    return m[..., :r1] & causal


def _attn_probs(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention rows ``[B, H, rows, keys]`` over the allowed keys."""
    s = (q @ k.transpose(-1, -2)).float() * scale
    return torch.softmax(s.masked_fill(~allowed.unsqueeze(1), -math.inf), dim=-1)


def _attn_chunk(q, k, v, scale, allowed):
    return _attn_probs(q, k, scale, allowed).to(v.dtype) @ v


def _rope_rows(rope, b: int, t: int, r0: int, r1: int):
    m = rope.cos.shape[-1]
    return SimpleNamespace(cos=rope.cos.view(b, t, m)[:, r0:r1].reshape(-1, m),
                           sin=rope.sin.view(b, t, m)[:, r0:r1].reshape(-1, m))


def _indexer_qw(indexer, x: torch.Tensor, qr: torch.Tensor, rope):
    """Indexer queries ``[B, T, H, D]`` and head weights ``[B, T, H]`` (fp32, scales folded;
    unquantized, so the orthonormal Hadamard rotation of the fp8 path changes nothing here)."""
    b, t, _ = x.shape
    q = indexer.wq_b(qr.reshape(b * t, -1)).view(b * t, indexer.n_heads, indexer.head_dim)
    q = indexer._rope(q, rope).float().view(b, t, indexer.n_heads, -1)
    w = indexer.weights_proj(x.reshape(b * t, -1).float()).view(b, t, -1)
    return q, w * (indexer.n_heads ** -0.5) * (indexer.head_dim ** -0.5)


def _indexer_k(indexer, x: torch.Tensor, rope) -> torch.Tensor:
    """Indexer keys ``[B, T, D]`` (fp32)."""
    b, t, _ = x.shape
    k = indexer.k_norm(indexer.wk(x.reshape(b * t, -1)))
    return indexer._rope(k, rope).float().view(b, t, -1)


def _indexer_qkw(indexer, x: torch.Tensor, qr: torch.Tensor, rope):
    q, w = _indexer_qw(indexer, x, qr, rope)
    return q, _indexer_k(indexer, x, rope), w


def _indexer_logits_rows(q_rows: torch.Tensor, k: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """``[B, rows, keys]``: sum_h w[t, h] * ReLU(q[t, h] . k[s]) (DESIGN.md §4)."""
    out = None
    for h in range(q_rows.shape[2]):  # one [B, rows, keys] at a time
        term = (q_rows[:, :, h] @ k.transpose(1, 2)).relu() * w_rows[:, :, h:h + 1]
        out = term if out is None else out + term
    return out


@torch.no_grad()
def _select(q, k, w, topk: int, chunks) -> torch.Tensor:
    """Top-k positions per query ``[B, T, k]`` (int64, -1 where the window is shorter)."""
    b, t = q.shape[:2]
    kk = min(topk, t)
    sel = torch.full((b, t, kk), -1, dtype=torch.long, device=q.device)
    for r0, r1 in chunks:
        logits = _indexer_logits_rows(q[:, r0:r1], k[:, :r1], w[:, r0:r1])
        logits = logits.masked_fill(~_allowed_rows(None, r0, r1, b, q.device), -math.inf)
        n = min(kk, r1)
        # a stable sort breaks ties (ReLU leaves exact zeros) by position, whatever the chunking
        vals, idx = logits.sort(dim=-1, descending=True, stable=True)
        vals, idx = vals[..., :n], idx[..., :n]
        sel[:, r0:r1, :n] = torch.where(torch.isfinite(vals), idx, -1)
    return sel


# ---------------------------------------------------------------------------- the forward

@dataclass
class _LayerRecord:
    q: torch.Tensor       # [B, H, T, d] detached
    k: torch.Tensor       # [B, H, T, d] detached
    scale: float
    x: Optional[torch.Tensor] = None    # F layers: indexer inputs, detached
    qr: Optional[torch.Tensor] = None
    sel: Optional[torch.Tensor] = None  # F layers, sparse stage: the selection it wrote


def _rope_for(model, b: int, t: int, device):
    pos = torch.arange(t, device=device).repeat(b).float()
    angles = pos.unsqueeze(1) * model.rope_inv_freq.to(device).unsqueeze(0)
    return SimpleNamespace(cos=angles.cos() * model.rope_attn_factor, sin=angles.sin() * model.rope_attn_factor)


def _mla(attn, x, rope, sel, chunks, grad: bool):
    """MLA over the allowed keys (unabsorbed form), chunked over query rows; returns the output
    and the detached per-head queries and keys for the targets."""
    from .train import unabsorbed_qkv

    b, t, _ = x.shape
    h, vdim = attn.n_heads, attn.v_dim
    qr, qf, kf, vf = unabsorbed_qkv(attn, x, rope)
    scale = attn.sparse_attn.softmax_scale
    outs = []
    for r0, r1 in chunks:
        allowed = _allowed_rows(sel, r0, r1, b, x.device)
        args = (qf[:, :, r0:r1], kf[:, :, :r1], vf[:, :, :r1], scale, allowed)
        outs.append(checkpoint(_attn_chunk, *args, use_reentrant=False) if grad else _attn_chunk(*args))
    out = torch.cat(outs, dim=2).transpose(1, 2).reshape(b * t, h * vdim)
    return attn.o_proj(out).view(b, t, -1), qr.view(b, t, -1), qf.detach(), kf.detach(), scale


def aware_forward(model, ids: torch.Tensor, stage: str, groups: dict, *, grad: bool = False,
                  chunk_elems: int = CHUNK_ELEMS, kl_backward: bool = False, keep: bool = False,
                  with_kl: bool = True):
    """Forward over ``ids [B, T+1]`` under the model's plan: returns (LM loss, {F layer: multi-layer
    KL}, records). Each group's KL is taken as soon as its last layer has run, and (unless
    ``keep``) that group's per-layer tensors are dropped, so at most one group's are alive.

    stage ``warmup``: dense causal attention everywhere; ``sparse``: each layer attends over the
    top-k its source F layer's indexer selected (fp32 scores). ``grad``: keep the main model's
    graph. ``kl_backward``: back-propagate each group's ``KL / len(groups)`` into its indexer.
    ``with_kl`` False: the LM loss only.
    """
    if stage not in ("warmup", "sparse"):
        raise ValueError(f"stage must be warmup or sparse, got {stage!r}")
    inp, tgt = ids[:, :-1], ids[:, 1:]
    b, t = inp.shape
    n = model.args.num_hidden_layers
    rope = _rope_for(model, b, t, ids.device)
    heads = max(model.args.num_attention_heads, model.args.index_n_heads)
    chunks = _row_chunks(b, heads, t, chunk_elems)
    src = {l: f for f, served in groups.items() for l in served}
    last_of = {served[-1]: f for f, served in groups.items()}
    records, sels, kls = {}, {}, {}
    with torch.set_grad_enabled(grad):
        x = model.model.embed_tokens(inp)
        for layer in model.model.layers[:n]:
            lid = layer.layer_id
            attn = layer.self_attn
            hin = layer.input_layernorm(x)
            sel = None
            if stage == "sparse":
                if lid == src[lid]:
                    with torch.no_grad():
                        qr = attn.q_a_layernorm(attn.q_a_proj(hin.reshape(b * t, -1))).view(b, t, -1)
                        iq, ik, iw = _indexer_qkw(attn.indexer, hin, qr, rope)
                        sels[lid] = _select(iq, ik, iw, model.args.index_topk, chunks)
                        del iq, ik, iw
                sel = sels[src[lid]]
            out, qr, qf, kf, scale = _mla(attn, hin, rope, sel, chunks, grad)
            rec = _LayerRecord(q=qf, k=kf, scale=scale, sel=sel)
            if lid == src[lid]:
                rec.x, rec.qr = hin.detach(), qr.detach()
            if with_kl:
                records[lid] = rec
            if with_kl and lid in last_of:
                f = last_of[lid]
                kls[f] = group_kl(model, records, f, groups[f], rope, chunks, backward=kl_backward,
                                  weight=1.0 / len(groups))
                if not keep:
                    for l in groups[f]:
                        del records[l]
            x = x + out
            y = layer.post_attention_layernorm(x)
            x = x + layer.mlp(y.reshape(-1, y.shape[-1])).view_as(x)
        hidden = model.model.norm(x)
        lm = F.cross_entropy(model.lm_head(hidden).float().reshape(-1, model.args.vocab_size), tgt.reshape(-1))
    return lm, kls, records


def group_kl(model, records: dict, f: int, served: Sequence[int], rope, chunks, *, backward: bool = False,
             weight: float = 1.0) -> float:
    """Multi-layer KL of F layer ``f``'s indexer over the layers it serves (nats, mean over query
    rows), chunked over query rows. With ``backward`` each chunk's share of ``weight * loss`` is
    back-propagated into the indexer right away (its queries and keys recomputed from the layer
    input), so no chunk's ``[rows, keys]`` tensors outlive it."""
    rec = records[f]
    indexer = model.model.layers[f].self_attn.indexer
    b, t = rec.x.shape[:2]
    total = 0.0
    for r0, r1 in chunks:
        allowed = _allowed_rows(rec.sel, r0, r1, b, rec.x.device)
        with torch.no_grad():
            target = served_target(_attn_probs(records[l].q[:, :, r0:r1], records[l].k[:, :, :r1],
                                               records[l].scale, allowed) for l in served)
        with torch.set_grad_enabled(backward):
            q, w = _indexer_qw(indexer, rec.x[:, r0:r1], rec.qr[:, r0:r1], _rope_rows(rope, b, t, r0, r1))
            k = _indexer_k(indexer, rec.x[:, :r1], _rope_rows(rope, b, t, 0, r1))
            part = kl_rows(_indexer_logits_rows(q, k, w), target, allowed).sum() / (b * t)
            if backward:
                (part * weight).backward()
        total += float(part.detach())
        del target, allowed, part
    return total


# ---------------------------------------------------------------------------- model, plan, saving

def load_for_pattern(init, hf_overrides, *, dtype=torch.float32, device="cpu"):
    """The checkpoint at ``init`` built for the pattern in ``hf_overrides`` (S layers hold no
    indexer), fp32 and unquantized indexer scoring. Clear errors for a pattern of another
    layer count and for a checkpoint without indexers."""
    from .loader import load_config

    config = load_config(init)
    ov = parse_overrides(hf_overrides)
    n = config.get("num_hidden_layers")
    if not isinstance(n, int):
        raise ValueError(f"{init}: config.json has no num_hidden_layers")
    if int(config.get("index_topk") or 0) <= 0:
        raise ValueError(f"{init} is not a DSA checkpoint (index_topk is {config.get('index_topk')!r}): "
                         "it has no indexer to train")
    pat = ov.get("index_topk_pattern")
    if isinstance(pat, str) and len(pat) != n:
        raise ValueError(f"index_topk_pattern {pat!r} has {len(pat)} layers, the checkpoint {init} has {n}")
    types = ov.get("indexer_types")
    if isinstance(types, list) and len(types) != n:
        raise ValueError(f"indexer_types has {len(types)} entries, the checkpoint {init} has {n} layers")
    if any(k in ov for k in PATTERN_KEYS) and ov.get("use_index_cache") is not True:
        raise ValueError('--hf-overrides for training-aware IndexCache need "use_index_cache": true')
    try:
        from .models import from_pretrained as load  # any DSA layout the loader reads (V3.2, GLM-5)
    except ImportError:
        from .models.deepseek_v32 import DeepseekV32ForCausalLM
        load = DeepseekV32ForCausalLM.from_pretrained
    import inspect

    from .models.deepseek_v32 import DeepseekV32ForCausalLM
    extra = {}
    if "weights" in inspect.signature(DeepseekV32ForCausalLM.from_pretrained).parameters:
        extra["weights"] = "bf16"  # an FP8 checkpoint's linears dequantized into trainable ``dtype``
    model = load(init, hf_overrides=ov or None, dtype=dtype, device=device, indexer_fp8=False, **extra)
    kept = [l.self_attn.indexer for l in model.model.layers[:n] if l.self_attn.indexer is not None]
    if not kept:
        raise ValueError(f"{init}: the model has no indexer under this plan")
    return model


def indexer_types_of(plan) -> list:
    n = plan.num_hidden_layers
    return ["shared" if s else "full" for s in list(plan.skip_topk)[:n]]


def save_for_pattern(model, path, like=None) -> Path:
    """Checkpoint whose config.json carries the pattern (``use_index_cache`` and
    ``indexer_types``, as GLM-5.2 ships them); S layers have no indexer tensors to save. Each
    tensor is stored in the float dtype ``like`` (the checkpoint trained from) stores it in,
    converted straight from the parameter (a frozen weight comes out bit for bit as it went in,
    fp32 or bf16); a tensor ``like`` lacks is stored bf16. The model is left as it was."""
    from .loader import save_pretrained, storage_dtypes

    path = Path(path)
    config = {k: v for k, v in model.config.items() if k not in PATTERN_KEYS}
    save_pretrained(model, path, dtypes=storage_dtypes(model, like), config=config,
                    extra_config={"use_index_cache": True, "indexer_types": indexer_types_of(model.plan)})
    # a reload with no overrides must give exactly this plan
    from .loader import load_config
    reloaded = IndexCacheConfig.from_config(load_config(path)).plan()
    if reloaded.pattern != model.plan.pattern:
        raise RuntimeError(f"{path} reloads with pattern {reloaded.pattern}, trained for {model.plan.pattern}")
    return path


# ---------------------------------------------------------------------------- the loop

@dataclass
class AwareSchedule:
    """Defaults: a few minutes on two CPU cores for the shipped 8-layer model."""
    warmup_steps: int = 60
    sparse_steps: int = 10
    batch: int = 2
    context: int = 512
    lr: float = 3e-3
    main_lr: float = 3e-4
    mode: str = "indexers"
    seed: int = 0
    eval_every: int = 10
    eval_windows: int = 2
    chunk_elems: int = CHUNK_ELEMS

    @property
    def total(self) -> int:
        return self.warmup_steps + self.sparse_steps

    def stage(self, step: int) -> str:
        return "warmup" if step < self.warmup_steps else "sparse"


def _lr(step: int, base: float, start: int, length: int) -> float:
    frac = (step - start) / max(1, length)
    warm = min(1.0, (step - start + 1) / 10)
    return base * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_aware(out_dir, init, hf_overrides, schedule: AwareSchedule = AwareSchedule(), *,
                train_text: Optional[bytes] = None, heldout_text: Optional[bytes] = None,
                log: Callable = print, progress: bool = True, threads: Optional[int] = None) -> Path:
    """Train the F indexers of ``init`` for the pattern in ``hf_overrides`` (resumable in
    ``out_dir``); returns ``out_dir/checkpoint``. Text defaults to the standard library's
    train / held-out splits."""
    from .train import load_text, text_tensor

    if schedule.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {schedule.mode!r}")
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    model = load_for_pattern(init, hf_overrides)
    n = model.args.num_hidden_layers
    groups = serving_groups(list(model.plan.source_layer), n)
    kept = {f: model.model.layers[f].self_attn.indexer for f in groups}
    idx_params = [p for ix in kept.values() for p in ix.parameters()]
    idx_ids = {id(p) for p in idx_params}
    main_params = []
    if schedule.mode == "model":
        mtp = {id(p) for layer in model.mtp_layers for p in layer.parameters()}
        main_params = [p for name, p in model.named_parameters() if id(p) not in idx_ids and id(p) not in mtp
                       and ".indexer." not in name and "e_score_correction_bias" not in name]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in idx_params + main_params:
        p.requires_grad_(True)
    opt_idx = torch.optim.AdamW(idx_params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.0)
    opt_main = torch.optim.AdamW(main_params, lr=schedule.main_lr, betas=(0.9, 0.95), weight_decay=0.1) if main_params else None
    train_data = text_tensor(train_text if train_text is not None else load_text("train"))
    held = text_tensor(heldout_text if heldout_text is not None else
                       load_text("heldout", schedule.eval_windows * schedule.context + 1))
    if train_data.numel() <= schedule.context + 1:
        raise ValueError(f"the training text ({train_data.numel()} bytes) is shorter than one window of {schedule.context + 1}")
    meta = {"schedule": asdict(schedule), "init": str(init), "pattern": model.plan.pattern}
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path, log_path = out_dir / "aware_state.pt", out_dir / "aware_log.jsonl"
    step, history = 0, []
    if state_path.is_file():
        state = load_resume_state(state_path, {"meta": meta}, model, keys=("model", "opt_idx", "opt_main", "step", "history"))
        model.load_state_dict(state["model"])
        opt_idx.load_state_dict(state["opt_idx"])
        if opt_main is not None:
            opt_main.load_state_dict(state["opt_main"])
        step, history = state["step"], state["history"]
        log(f"resuming at step {step}")
    log(f"training-aware IndexCache: pattern {model.plan.pattern}, groups "
        + ", ".join(f"{f}<-{served}" for f, served in groups.items()) + f", mode {schedule.mode}")
    bar = None
    if progress and step < schedule.total:
        from tqdm import tqdm
        bar = tqdm(total=schedule.total, initial=step, desc="training-aware indexers", unit="step")
    t0 = time.time() - (history[-1]["elapsed_s"] if history else 0.0)
    while step < schedule.total:
        stage = schedule.stage(step)
        g = torch.Generator().manual_seed(schedule.seed * 1_000_003 + step)
        starts = torch.randint(0, train_data.numel() - schedule.context - 1, (schedule.batch,), generator=g)
        ids = torch.stack([train_data[s:s + schedule.context + 1] for s in starts.tolist()])
        start, length = (0, schedule.warmup_steps) if stage == "warmup" else (schedule.warmup_steps, schedule.sparse_steps)
        scale = 1.0 if stage == "warmup" else 0.3
        for grp in opt_idx.param_groups:
            grp["lr"] = _lr(step, schedule.lr * scale, start, length)
        opt_idx.zero_grad(set_to_none=True)
        train_main = opt_main is not None and stage == "sparse"
        if opt_main is not None:
            opt_main.zero_grad(set_to_none=True)
        model.train()
        lm, kls, _ = aware_forward(model, ids, stage, groups, grad=train_main, chunk_elems=schedule.chunk_elems,
                                   kl_backward=True)  # the indexers' gradients, group by group
        if train_main:
            lm.backward()
            torch.nn.utils.clip_grad_norm_(main_params, 1.0)
            for grp in opt_main.param_groups:
                grp["lr"] = _lr(step, schedule.main_lr, start, length)
            opt_main.step()
        torch.nn.utils.clip_grad_norm_(idx_params, 1.0)
        opt_idx.step()
        rec = {"step": step, "stage": stage, "lm_bits": float(lm.detach()) / math.log(2),
               "kl": sum(kls.values()) / len(kls), "kl_per_f": {str(k): v for k, v in kls.items()},
               "elapsed_s": round(time.time() - t0, 1)}
        step += 1
        if step % schedule.eval_every == 0 or step == schedule.total:
            rec["heldout_bits"] = eval_sparse_bits(model, held, schedule.context, groups, schedule.eval_windows,
                                                   schedule.chunk_elems)
            log(json.dumps({k: v for k, v in rec.items() if k != "kl_per_f"}))
        history.append(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(kl=f"{rec['kl']:.3f}", lm=f"{rec['lm_bits']:.3f}")
        if "heldout_bits" in rec:  # a resumable point
            save_resume_state(state_path, {"meta": meta, "model": model.state_dict(), "opt_idx": opt_idx.state_dict(),
                                           "opt_main": opt_main.state_dict() if opt_main is not None else None,
                                           "step": step, "history": history})
            log_path.write_text("".join(json.dumps(r) + "\n" for r in history))
    if bar is not None:
        bar.close()
    model.eval()
    return save_for_pattern(model, out_dir / "checkpoint", like=init)


@torch.no_grad()
def eval_sparse_bits(model, data: torch.Tensor, context: int, groups: dict, windows: int = 2,
                     chunk_elems: int = CHUNK_ELEMS) -> float:
    """Held-out bits per byte of the training forward (sparse, fp32 indexer) over the pattern."""
    n = min(windows, (data.numel() - 1) // context)
    if n < 1:
        raise ValueError(f"held-out text of {data.numel()} bytes is shorter than the context {context} + 1")
    ids = torch.stack([data[i * context:(i + 1) * context + 1] for i in range(n)])
    lm = aware_forward(model, ids, "sparse", groups, chunk_elems=chunk_elems, with_kl=False)[0]
    return float(lm) / math.log(2)


# ---------------------------------------------------------------------------- overlap of a trained pattern

@torch.no_grad()
def trained_source_overlap(base, trained, windows: torch.Tensor) -> list:
    """Per main layer of the trained checkpoint's pattern: the share of that layer's own
    (``base``, all-F) indexer selection that its source F layer's **trained** indexer also
    selects (the ``overlap`` rule, all-F run of the base model with one F indexer swapped for
    its trained version at a time). F layers: 1.0."""
    from .loader import load_config
    from .patterns import load_all_full, overlap_matrix

    model = load_all_full(base, dtype=torch.float32)
    plan = IndexCacheConfig.from_config(load_config(trained)).plan()
    src = list(plan.source_layer)[:model.args.num_hidden_layers]
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(Path(trained).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    fs = sorted({f for layer, f in enumerate(src) if layer != f})  # F layers that serve an S layer
    out = [1.0] * len(src)
    base_state = {f: {k: v.clone() for k, v in model.model.layers[f].self_attn.indexer.state_dict().items()} for f in fs}
    for f in fs:
        ix = model.model.layers[f].self_attn.indexer
        ix.load_state_dict({name: tensors[f"model.layers.{f}.self_attn.indexer.{name}"].float()
                            for name in base_state[f]})
        m = overlap_matrix(model, windows)
        for layer, s in enumerate(src):
            if s == f and layer != f:
                out[layer] = float(m[layer, f])
        ix.load_state_dict(base_state[f])
    return out


# ---------------------------------------------------------------------------- the held-out table

def heldout_table(base, entries: Sequence[dict], *, windows: int = 8, context: int = 1024, overlap_windows: int = 2,
                  log: Callable = print) -> list:
    """Held-out rows for docs/patterns.md, in one run: per entry ``{"label", "model", "overrides"}``
    (``model`` None = ``base``; ``overrides`` None = the checkpoint as it ships) the pattern,
    perplexity, bits per byte and prefill time (``patterns.evaluate``: the inference ops, fp8
    scoring), and each S layer's top-k overlap with its source F layer over the first
    ``overlap_windows`` windows: from the base all-F model for a training-free pattern, against
    the trained source indexer (:func:`trained_source_overlap`) for a trained checkpoint."""
    from .patterns import evaluate, load_all_full, overlap_matrix, source_overlap, text_windows
    from .train import load_text

    win = text_windows(load_text("heldout", windows * context + 1), context, windows)
    matrix = overlap_matrix(load_all_full(base), win[:overlap_windows])
    rows = []
    for e in entries:
        path = Path(e.get("model") or base)
        t0 = time.time()
        r = evaluate(path, [e.get("overrides")], win)[0]
        if Path(path).resolve() == Path(base).resolve():
            src = source_overlap(matrix, r["pattern"])
        else:
            src = trained_source_overlap(base, path, win[:overlap_windows])
        r.update(label=e.get("label", ""), model=str(e.get("model") or base),
                 source_overlap=[None if c == "F" else round(v, 3) for c, v in zip(r["pattern"], src)],
                 eval_s=round(time.time() - t0, 1))
        rows.append(r)
        log(f"{r['label']:<34} {r['pattern']} ppl {r['perplexity']:.3f} bits/byte {r['bits_per_byte']:.4f}")
    base_s = rows[0]["prefill_s"] if rows else 1.0
    for r in rows:
        r["prefill_ratio"] = r["prefill_s"] / base_s
    return rows


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m indexcache.train_aware",
                                description="held-out table of training-free and training-aware patterns")
    p.add_argument("--entries", required=True, help='JSON list of {"label", "model", "overrides"}')
    p.add_argument("--base", default=None, help="the all-F checkpoint (default: the embedded model)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .models.tiny import embedded_model_path

    entries = json.loads(Path(args.entries).read_text())
    rows = heldout_table(args.base or embedded_model_path(), entries, windows=args.windows, context=args.context)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("| pattern | F kept | perplexity | bits/byte | prefill vs all-F | S layer: overlap with its source | what |")
    print("|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        ov = ", ".join(f"{l}:{v:.2f}" for l, v in enumerate(r["source_overlap"]) if v is not None) or "–"
        print(f"| `{r['pattern']}` | {r['indexers_kept']:.3f} | {r['perplexity']:.3f} | {r['bits_per_byte']:.3f} | "
              f"{r['prefill_ratio']:.2f} | {ov} | {r['label']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
