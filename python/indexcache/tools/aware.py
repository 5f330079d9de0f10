"""Training-aware IndexCache: retrain the kept (F) indexers to serve every layer that reuses them.

Training-free IndexCache (``indexcache search``) chooses which layers keep an indexer; the
indexers themselves were trained for their own layer only. Here each F layer's indexer is
trained with the multi-layer distillation loss of ``tools.aware_loss`` (its target: the mean
attention distribution of the layers it serves), in a **warm-up** stage (dense attention) and
a **sparse** stage (every layer attends over its F indexer's top-k, as at inference).

The forward is the model's own (``hidden_states`` under a ``TorchPass``): the blocks hand each
layer's record to an ``IndexerKL`` observer that takes a group's loss as soon as its last
layer has run, so memory stays bounded on long contexts (O(T) tensors for one group at a
time, attention and indexer scores in query chunks of at most ``chunk_elems``).

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
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from indexcache import differentiable
from indexcache.config import IndexCacheConfig, parse_overrides
from indexcache.loader import load_config, save_pretrained, storage_dtypes
from indexcache.models import from_pretrained
from indexcache.models.state import TorchPass
from indexcache.resume import load_resume_state, save_resume_state
from indexcache.tools.aware_loss import CHUNK_ELEMS, IndexerKL, serving_groups
from indexcache.tools.text import load_text, text_tensor
from indexcache.tools.train import cosine_lr

MODES = ("indexers", "model")
# Keys that describe a pattern; the saved config carries the pattern as indexer_types only.
PATTERN_KEYS = ("index_topk_freq", "index_topk_pattern", "index_skip_topk_offset", "indexer_types")
STAGES = ("warmup", "sparse")


def aware_forward(model, ids: torch.Tensor, stage: str, groups: dict, *, grad: bool = False,
                  chunk_elems: int = CHUNK_ELEMS, kl_backward: bool = False, keep: bool = False,
                  with_kl: bool = True):
    """The model's forward over ``ids [B, T+1]`` under its plan, as a ``TorchPass``: returns (LM loss,
    {F layer: multi-layer KL}, the layer records kept). stage ``warmup``: dense causal attention
    everywhere; ``sparse``: each layer attends over the top-k its source F layer's indexer
    selected (fp32 scores). ``grad``: keep the main model's graph (attention chunks recomputed in
    backward). ``kl_backward``: back-propagate each group's ``KL / len(groups)`` into its indexer.
    ``keep``: keep every layer's record. ``with_kl`` False: the LM loss only."""
    if stage not in STAGES:
        raise ValueError(f"stage must be warmup or sparse, got {stage!r}")
    inp, tgt = ids[:, :-1], ids[:, 1:]
    b, t = inp.shape
    heads = max(model.args.num_attention_heads, model.args.index_n_heads)
    tp = TorchPass(b, t, "causal" if stage == "warmup" else "selected", differentiable.row_chunks(b, heads, t, chunk_elems),
                   recompute=grad)
    ctx = model.torch_pass_context(tp)
    kl = IndexerKL(model, groups, ctx, backward=kl_backward, weight=1.0 / len(groups), keep=keep) if with_kl else None
    tp.observe = kl
    with torch.set_grad_enabled(grad):
        hidden = model.hidden_states(inp.reshape(-1).to(model.device), ctx)
        lm = F.cross_entropy(model.lm_head(hidden).float(), tgt.reshape(-1).to(model.device))
    return lm, (kl.kls if kl else {}), (kl.records if kl else {})


# ---------------------------------------------------------------------------- model, plan, saving

def load_for_pattern(init, hf_overrides, *, dtype=torch.float32, device="cpu"):
    """The checkpoint at ``init`` built for the pattern in ``hf_overrides`` (S layers hold no
    indexer), fp32 and unquantized indexer scoring. Clear errors for a pattern of another
    layer count and for a checkpoint without indexers."""
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
    # any family the registry knows; an FP8 checkpoint's linears dequantized into trainable ``dtype``
    model = from_pretrained(init, hf_overrides=ov or None, dtype=dtype, device=device, indexer_fp8=False,
                            weights="bf16")
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
    path = Path(path)
    config = {k: v for k, v in model.config.items() if k not in PATTERN_KEYS}
    save_pretrained(model, path, dtypes=storage_dtypes(model, like), config=config,
                    extra_config={"use_index_cache": True, "indexer_types": indexer_types_of(model.plan)})
    # a reload with no overrides must give exactly this plan
    reloaded = IndexCacheConfig.from_config(load_config(path)).plan()
    if reloaded.pattern != model.plan.pattern:
        raise RuntimeError(f"{path} reloads with pattern {reloaded.pattern}, trained for {model.plan.pattern}")
    return path


# ---------------------------------------------------------------------------- the schedule

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


# ---------------------------------------------------------------------------- the loop

class _AwareTrainer:
    """The model under the pattern, its serving groups, what trains and its optimizers."""

    def __init__(self, init, hf_overrides, schedule: "AwareSchedule"):
        if schedule.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {schedule.mode!r}")
        self.schedule = s = schedule
        self.model = model = load_for_pattern(init, hf_overrides)
        self.groups = serving_groups(list(model.plan.source_layer), model.args.num_hidden_layers)
        self.idx_params = [p for f in self.groups for p in model.model.layers[f].self_attn.indexer.parameters()]
        idx_ids = {id(p) for p in self.idx_params}
        self.main_params = []
        if s.mode == "model":
            mtp = {id(p) for layer in model.mtp_layers for p in layer.parameters()}
            self.main_params = [p for name, p in model.named_parameters() if id(p) not in idx_ids and id(p) not in mtp
                                and ".indexer." not in name and "e_score_correction_bias" not in name]
        for p in model.parameters():
            p.requires_grad_(False)
        for p in self.idx_params + self.main_params:
            p.requires_grad_(True)
        self.opt_idx = torch.optim.AdamW(self.idx_params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.opt_main = torch.optim.AdamW(self.main_params, lr=s.main_lr, betas=(0.9, 0.95), weight_decay=0.1) \
            if self.main_params else None

    def step(self, step: int, data: torch.Tensor) -> dict:
        s, stage = self.schedule, self.schedule.stage(step)
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        starts = torch.randint(0, data.numel() - s.context - 1, (s.batch,), generator=g)
        ids = torch.stack([data[i:i + s.context + 1] for i in starts.tolist()])
        start, length = (0, s.warmup_steps) if stage == "warmup" else (s.warmup_steps, s.sparse_steps)
        for grp in self.opt_idx.param_groups:
            grp["lr"] = cosine_lr(step, s.lr * (1.0 if stage == "warmup" else 0.3), start, length, warmup=10)
        self.opt_idx.zero_grad(set_to_none=True)
        train_main = self.opt_main is not None and stage == "sparse"
        if self.opt_main is not None:
            self.opt_main.zero_grad(set_to_none=True)
        self.model.train()
        lm, kls, _ = aware_forward(self.model, ids, stage, self.groups, grad=train_main, chunk_elems=s.chunk_elems,
                                   kl_backward=True)  # the indexers' gradients, group by group
        if train_main:
            lm.backward()
            torch.nn.utils.clip_grad_norm_(self.main_params, 1.0)
            for grp in self.opt_main.param_groups:
                grp["lr"] = cosine_lr(step, s.main_lr, start, length, warmup=10)
            self.opt_main.step()
        torch.nn.utils.clip_grad_norm_(self.idx_params, 1.0)
        self.opt_idx.step()
        return {"step": step, "stage": stage, "lm_bits": float(lm.detach()) / math.log(2),
                "kl": sum(kls.values()) / len(kls), "kl_per_f": {str(k): v for k, v in kls.items()}}

    def state(self, meta: dict, step: int, history: list) -> dict:
        return {"meta": meta, "model": self.model.state_dict(), "opt_idx": self.opt_idx.state_dict(),
                "opt_main": self.opt_main.state_dict() if self.opt_main is not None else None,
                "step": step, "history": history}

    def resume(self, state_path: Path, meta: dict) -> tuple[int, list]:
        state = load_resume_state(state_path, {"meta": meta}, self.model,
                                  keys=("model", "opt_idx", "opt_main", "step", "history"))
        self.model.load_state_dict(state["model"])
        self.opt_idx.load_state_dict(state["opt_idx"])
        if self.opt_main is not None:
            self.opt_main.load_state_dict(state["opt_main"])
        return state["step"], state["history"]


def train_aware(out_dir, init, hf_overrides, schedule: AwareSchedule = AwareSchedule(), *,
                train_text: Optional[bytes] = None, heldout_text: Optional[bytes] = None,
                log: Callable = print, progress: bool = True, threads: Optional[int] = None) -> Path:
    """Train the F indexers of ``init`` for the pattern in ``hf_overrides`` (resumable in
    ``out_dir``); returns ``out_dir/checkpoint``. Text defaults to the standard library's
    train / held-out splits."""
    if threads:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    trainer = _AwareTrainer(init, hf_overrides, schedule)
    model, groups = trainer.model, trainer.groups
    train_data = text_tensor(train_text if train_text is not None else load_text("train"))
    held = text_tensor(heldout_text if heldout_text is not None else
                       load_text("heldout", schedule.eval_windows * schedule.context + 1))
    if train_data.numel() <= schedule.context + 1:
        raise ValueError(f"the training text ({train_data.numel()} bytes) is shorter than one window of {schedule.context + 1}")
    meta = {"schedule": asdict(schedule), "init": str(init), "pattern": model.plan.pattern}
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path, log_path = out_dir / "aware_state.pt", out_dir / "aware_log.jsonl"
    step, history = trainer.resume(state_path, meta) if state_path.is_file() else (0, [])
    if history:
        log(f"resuming at step {step}")
    log(f"training-aware IndexCache: pattern {model.plan.pattern}, groups "
        + ", ".join(f"{f}<-{served}" for f, served in groups.items()) + f", mode {schedule.mode}")
    bar = None
    if progress and step < schedule.total:
        from tqdm import tqdm
        bar = tqdm(total=schedule.total, initial=step, desc="training-aware indexers", unit="step")
    t0 = time.time() - (history[-1]["elapsed_s"] if history else 0.0)
    while step < schedule.total:
        rec = trainer.step(step, train_data)
        rec["elapsed_s"] = round(time.time() - t0, 1)
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
            save_resume_state(state_path, trainer.state(meta, step, history))
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
