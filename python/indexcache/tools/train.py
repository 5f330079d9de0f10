"""Train a small DeepSeek-V3.2-architecture DSA model on the standard library's text.

DSA's recipe in three phases (``indexcache train``; seeded, deterministic, resumable):

1. **dense** — the whole model trains with full causal attention; the indexers are idle.
2. **warmup** — only the indexers train: a KL divergence pulls each layer's indexer
   distribution (softmax of its logits over the causal window) toward the head-summed
   attention distribution of its layer. The rest of the model is frozen.
3. **sparse** — attention reads only each query's top-k tokens chosen by its layer's
   indexer; the model trains on the LM loss and the indexers on the KL restricted to the
   selected tokens. Indexer inputs are detached, so the KL never moves the main model.

Training runs the model's own blocks under a ``TorchPass`` (``DSAForCausalLM.hidden_states``):
the same projections as inference, with the differentiable torch definitions of attention
and of the indexer's scores in place of the kernels. The text is the Python standard library
(``tools.text``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from indexcache import differentiable
from indexcache.loader import load_config, save_pretrained, storage_dtypes
from indexcache.models.deepseek_v32 import DeepseekV32ForCausalLM
from indexcache.models.dsa import DSAForCausalLM
from indexcache.models.state import TorchPass
from indexcache.models.tiny import tiny_config
from indexcache.resume import load_resume_state, save_resume_state
from indexcache.tools.aware_loss import CHUNK_ELEMS, IndexerKL, serving_groups
from indexcache.tools.text import SPLITS, load_text, split_of, stdlib_files, text_tensor  # noqa: F401

MODES = ("dense", "warmup", "sparse")

# The shipped model: 8 layers, hidden 192, 4 routed experts (2 per token) + 1 shared, byte
# vocabulary, trained at context 1024 with a top-64 indexer of 4 heads. kv_lora 512, rope 64
# and index head dim 128 are DeepSeek-V3.2's, which the kernels are specialised to; the rest
# is scaled down so that training fits in about 20 minutes on two CPU cores.
TRAIN_CONFIG = tiny_config(
    hidden_size=192, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=2, index_n_heads=4, index_topk=64,
    max_position_embeddings=4096, num_nextn_predict_layers=1,
)


# ---------------------------------------------------------------------------- the differentiable forward

def train_forward(model: DSAForCausalLM, ids: torch.Tensor, mode: str, mtp_weight: float = 0.3,
                  chunk_elems: int = CHUNK_ELEMS, with_kl: bool = True):
    """The model's own forward under a ``TorchPass`` over ``ids [B, T+1]``: returns (LM loss, mean
    indexer KL as a float or None, MTP loss or None). ``dense``: causal attention, no indexer;
    ``warmup``: causal attention, each F layer's indexer distilled toward its layer's attention;
    ``sparse``: every layer attends over its F layer's top-k, the indexers distilled over the
    selection. With gradients on, each indexer's KL share is back-propagated into it as the
    forward goes (the indexers see detached inputs, so the KL never moves the main model)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    inp, tgt = ids[:, :-1], ids[:, 1:]
    b, t = inp.shape
    heads = max(model.args.num_attention_heads, model.args.index_n_heads)
    tp = TorchPass(b, t, "selected" if mode == "sparse" else "causal", differentiable.row_chunks(b, heads, t, chunk_elems))
    ctx = model.torch_pass_context(tp)
    use_mtp = bool(mtp_weight) and bool(model.mtp_layers) and t > 1
    kl = None
    if mode != "dense" and with_kl:
        n = model.args.num_hidden_layers
        groups = serving_groups(list(model.plan.source_layer), n)
        groups.update({n + j: [n + j] for j in range(len(model.mtp_layers) if use_mtp else 0)})
        kl = IndexerKL(model, groups, ctx, backward=torch.is_grad_enabled(), weight=1.0 / len(groups))
        tp.observe = kl
    hidden = model.hidden_states(inp.reshape(-1), ctx)
    lm = F.cross_entropy(model.lm_head(hidden).float(), tgt.reshape(-1))
    mtp = None
    if use_mtp:
        layer = model.mtp_layers[0]
        hm = layer.forward_mtp(model.model.embed_tokens(tgt.reshape(-1)), hidden, ctx)  # token i+1 beside h_i
        mlogits = layer.shared_head.head(layer.shared_head.norm(hm)).float().view(b, t, -1)[:, :-1]
        mtp = F.cross_entropy(mlogits.reshape(-1, model.args.vocab_size), tgt[:, 1:].reshape(-1))
    return lm, (sum(kl.kls.values()) / len(kl.kls) if kl is not None and kl.kls else None), mtp


# ---------------------------------------------------------------------------- the loop

@dataclass
class TrainSchedule:
    """The defaults are the first stage of the shipped model, about 20 minutes on two idle CPU
    cores: the dense phase at context 512 (attention cost per token halves), the indexer phases
    at the full context 1024, where top-64 is sparse. The shipped model then ran a second stage
    (``--init``, 120 more warm-up and 60 sparse steps at context 512; docs/patterns.md), because
    20 warm-up steps left the indexers far from the attention they imitate."""
    dense_steps: int = 360
    warmup_steps: int = 20
    sparse_steps: int = 30
    batch: int = 8
    context: int = 512
    sparse_batch: int = 2
    sparse_context: int = 1024
    lr: float = 2e-3
    indexer_lr: float = 3e-3
    seed: int = 0
    eval_every: int = 40
    eval_bytes: int = 65536

    @property
    def total(self) -> int:
        return self.dense_steps + self.warmup_steps + self.sparse_steps

    def phase(self, step: int) -> str:
        if step < self.dense_steps:
            return "dense"
        return "warmup" if step < self.dense_steps + self.warmup_steps else "sparse"


def _windows(data: torch.Tensor, batch: int, context: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
    return torch.stack([data[s:s + context + 1] for s in starts.tolist()])


@torch.no_grad()
def eval_bits_per_byte(model, data: torch.Tensor, context: int, mode: str = "dense", max_windows: int = 16) -> float:
    """Mean next-byte loss in bits over non-overlapping windows of ``data`` (training forward)."""
    n = min(max_windows, (data.numel() - 1) // context)
    if n < 1:
        raise ValueError(f"text of {data.numel()} bytes is shorter than the context {context} + 1")
    losses = [train_forward(model, data[i * context:(i + 1) * context + 1].unsqueeze(0), mode, mtp_weight=0,
                            with_kl=False)[0] for i in range(n)]
    return float(torch.stack(losses).mean()) / math.log(2)


def cosine_lr(step: int, base: float, start: int, length: int, warmup: int = 50) -> float:
    """The learning rate of a phase that began at ``start`` and lasts ``length`` steps: a linear
    warm-up over ``warmup`` steps, then a cosine decay to a tenth of ``base``."""
    frac = (step - start) / max(1, length)
    warm = min(1.0, (step - start + 1) / warmup)
    return base * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class _Trainer:
    """The model, its two optimizers (main weights, indexers) and one step of the schedule."""

    def __init__(self, config: dict, schedule: TrainSchedule, init: Optional[Path]):
        self.schedule = schedule
        torch.manual_seed(schedule.seed)
        self.model = model = DeepseekV32ForCausalLM.from_config(config, dtype=torch.float32, seed=schedule.seed,
                                                                indexer_fp8=False)
        if init is not None:
            start = DeepseekV32ForCausalLM.from_pretrained(init, dtype=torch.float32, indexer_fp8=False)
            model.load_state_dict(start.state_dict())
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.zero_()
        self.indexer_params = [p for n, p in model.named_parameters() if ".indexer." in n]
        self.main_params = [p for n, p in model.named_parameters()
                            if ".indexer." not in n and "e_score_correction_bias" not in n]
        self.opt_main = torch.optim.AdamW(self.main_params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.opt_idx = torch.optim.AdamW(self.indexer_params, lr=schedule.indexer_lr, betas=(0.9, 0.95), weight_decay=0.0)

    def _set_lrs(self, step: int, phase: str) -> None:
        s = self.schedule
        if phase == "dense":
            main, idx = cosine_lr(step, s.lr, 0, s.dense_steps), None
        elif phase == "warmup":
            main, idx = None, cosine_lr(step, s.indexer_lr, s.dense_steps, s.warmup_steps)
        else:
            start = s.dense_steps + s.warmup_steps
            main = cosine_lr(step, s.lr * 0.3, start, s.sparse_steps)
            idx = cosine_lr(step, s.indexer_lr * 0.3, start, s.sparse_steps)
        for opt, lr in ((self.opt_main, main), (self.opt_idx, idx)):
            for grp in opt.param_groups:
                grp["lr"] = grp["lr"] if lr is None else lr

    def step(self, step: int, data: torch.Tensor) -> dict:
        """One optimizer step; the indexers' KL gradients arrive during the forward (train_forward)."""
        s, phase = self.schedule, self.schedule.phase(step)
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
        ids = _windows(data, s.batch, s.context, g) if phase == "dense" else \
            _windows(data, s.sparse_batch, s.sparse_context, g)
        self._set_lrs(step, phase)
        self.opt_main.zero_grad(set_to_none=True)
        self.opt_idx.zero_grad(set_to_none=True)
        self.model.train()
        with torch.set_grad_enabled(True):
            lm, kl, mtp = train_forward(self.model, ids, phase)
            if phase != "warmup":
                (lm + (0.3 * mtp if mtp is not None else 0)).backward()
        torch.nn.utils.clip_grad_norm_(self.main_params + self.indexer_params, 1.0)
        if phase != "warmup":
            self.opt_main.step()
        if phase != "dense":
            self.opt_idx.step()
        return {"step": step, "phase": phase, "lm_bits": float(lm.detach()) / math.log(2), "kl": kl,
                "mtp_bits": None if mtp is None else float(mtp.detach()) / math.log(2)}

    def state(self, config: dict, step: int, history: list) -> dict:
        return {"schedule": asdict(self.schedule), "config": config, "model": self.model.state_dict(),
                "opt_main": self.opt_main.state_dict(), "opt_idx": self.opt_idx.state_dict(),
                "step": step, "history": history}

    def resume(self, state_path: Path, config: dict) -> tuple[int, list]:
        state = load_resume_state(state_path, {"schedule": asdict(self.schedule), "config": config}, self.model,
                                  keys=("model", "opt_main", "opt_idx", "step", "history"))
        self.model.load_state_dict(state["model"])
        self.opt_main.load_state_dict(state["opt_main"])
        self.opt_idx.load_state_dict(state["opt_idx"])
        return state["step"], state["history"]


def train(out_dir: Path, schedule: TrainSchedule = TrainSchedule(), *, log=print, config: Optional[dict] = None,
          stdlib_root: Optional[Path] = None, max_train_bytes: Optional[int] = None,
          init: Optional[Path] = None) -> Path:
    """Run (or resume) training into ``out_dir``; returns the final checkpoint directory.

    ``init``: start from this checkpoint's weights (its config replaces ``config``), e.g. to run
    more indexer warm-up and sparse steps on a finished model with ``dense_steps=0``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(load_config(init) if init is not None else (config or TRAIN_CONFIG))
    trainer = _Trainer(config, schedule, init)
    train_data = text_tensor(load_text("train", max_train_bytes, stdlib_root))
    heldout = text_tensor(load_text("heldout", schedule.eval_bytes, stdlib_root))
    state_path, log_path = out_dir / "train_state.pt", out_dir / "train_log.jsonl"
    step, history = 0, []
    if state_path.is_file():
        step, history = trainer.resume(state_path, config)
        log(f"resuming at step {step}")
    t0 = time.time()
    while step < schedule.total:
        rec = trainer.step(step, train_data)
        rec["elapsed_s"] = round(time.time() - t0, 1)
        step += 1
        if step % schedule.eval_every == 0 or step == schedule.total:
            trainer.model.eval()
            dense = rec["phase"] == "dense"
            rec["heldout_bits"] = eval_bits_per_byte(trainer.model, heldout,
                                                     schedule.context if dense else schedule.sparse_context,
                                                     "dense" if dense else "sparse", 8 if dense else 4)
            log(json.dumps(rec))
        history.append(rec)
        if "heldout_bits" in rec:  # a resumable point: state and the log up to it
            save_resume_state(state_path, trainer.state(config, step, history))
            log_path.write_text("".join(json.dumps(r) + "\n" for r in history))
    final = out_dir / "checkpoint"
    trainer.model.eval()
    save_pretrained(trainer.model, final, dtypes=storage_dtypes(trainer.model))  # ship bf16 (indexer head weights: fp32)
    return final


def plot_history(logs: list, png: Path) -> None:
    """Loss curve of one or more consecutive train_log.jsonl files (steps continue across them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, lm, held, phases, offset = [], [], [], [], 0
    for path in logs:
        hist = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        for h in hist:
            steps.append(offset + h["step"])
            lm.append(h["lm_bits"])
            phases.append(h["phase"])
            held.append((offset + h["step"], h["heldout_bits"]) if "heldout_bits" in h else None)
        offset = steps[-1] + 1 if steps else 0
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, lm, lw=0.6, alpha=0.6, label="train batch (bits/byte)")
    pts = [p for p in held if p]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="held-out (bits/byte)")
    for name, color in (("warmup", "tab:orange"), ("sparse", "tab:green")):
        xs = [s for s, ph in zip(steps, phases) if ph == name]
        if xs:
            ax.axvspan(min(xs), max(xs), color=color, alpha=0.12, label=f"{name} phase")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(top=min(8.5, max(lm) + 0.2))
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
