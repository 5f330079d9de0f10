"""Train a small DeepSeek-V3.2-architecture DSA model on the standard library's text.

DSA's recipe in three phases (``indexcache train``; seeded, deterministic, resumable):

1. **dense** — the whole model trains with full causal attention; the indexers are idle.
2. **warmup** — only the indexers train: a KL divergence pulls each layer's indexer
   distribution (softmax of its logits over the causal window) toward the head-summed
   attention distribution of its layer. The rest of the model is frozen.
3. **sparse** — attention reads only each query's top-k tokens chosen by its layer's
   indexer; the model trains on the LM loss and the indexers on the KL restricted to the
   selected tokens. Indexer inputs are detached, so the KL never moves the main model.

Training needs gradients, so it runs through this module's differentiable pure-torch
forward over the model's own parameters; inference uses the ops. The text is the Python
standard library (sources and pydoc documentation) that ships with the interpreter, split
into train / calibration / held-out by file name hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from .models.deepseek_v32 import DeepseekV32ForCausalLM, apply_rope
from .loader import save_pretrained, storage_dtypes
from .models.tiny import tiny_config
from .resume import load_resume_state, save_resume_state

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
SPLITS = ("train", "calib", "heldout")


# ---------------------------------------------------------------------------- text

def stdlib_files(root: Optional[Path] = None) -> list[Path]:
    """The standard library's .py files (pydoc's documentation topics included), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_of(relpath: str) -> str:
    """train (90 %), calib (5 %) or heldout (5 %), by a hash of the file's relative path."""
    h = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100
    return "train" if h < 90 else ("calib" if h < 95 else "heldout")


def load_text(split: str, max_bytes: Optional[int] = None, root: Optional[Path] = None) -> bytes:
    """Concatenated bytes of one split's files (in path order), up to max_bytes."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for p in stdlib_files(root):
        if split_of(p.relative_to(root).as_posix()) != split:
            continue
        data = p.read_bytes()
        out.append(data)
        size += len(data) + 1
        if max_bytes is not None and size >= max_bytes:
            break
    text = b"\n".join(out)
    return text[:max_bytes] if max_bytes is not None else text


def text_tensor(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


# ---------------------------------------------------------------------------- differentiable forward

def unabsorbed_qkv(attn, x, rope):
    """An MLA layer's projections in the unabsorbed form, for training: ``x [B, T, hidden]`` ->
    (q latent ``[B*T, q_lora]``, q ``[B, h, T, nope + rope]``, k (same), v ``[B, h, T, v_dim]``)."""
    b, t, _ = x.shape
    h, nope, rdim, vdim, latent = attn.n_heads, attn.nope, attn.rope, attn.v_dim, attn.latent
    flat = x.reshape(b * t, -1)
    qr = attn.q_a_layernorm(attn.q_a_proj(flat))
    q_nope, q_pe = attn.q_b_proj(qr).view(b * t, h, nope + rdim).split([nope, rdim], dim=-1)
    q_pe = apply_rope(q_pe, rope.cos, rope.sin, interleaved=True)
    kv = attn.kv_a_proj_with_mqa(flat)
    kv_c = attn.kv_a_layernorm(kv[:, :latent])
    k_pe = apply_rope(kv[:, latent:], rope.cos, rope.sin, interleaved=True)
    k_nope, v = attn.kv_b_proj(kv_c).view(b * t, h, nope + vdim).split([nope, vdim], dim=-1)
    qf = torch.cat((q_nope, q_pe), dim=-1).view(b, t, h, -1).transpose(1, 2)
    kf = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)), dim=-1).view(b, t, h, -1).transpose(1, 2)
    return qr, qf, kf, v.view(b, t, h, vdim).transpose(1, 2)


def _layer_attention(attn, x, rope, mode: str, topk: int):
    """One MLA layer (unabsorbed form) plus its indexer; returns (output, indexer KL or None)."""
    b, t, _ = x.shape
    h, vdim = attn.n_heads, attn.v_dim
    qr, qf, kf, vf = unabsorbed_qkv(attn, x, rope)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    scale = attn.sparse_attn.softmax_scale
    kl, mask = None, None
    if mode != "dense" and attn.indexer is not None:
        idx_logits = _indexer_logits(attn.indexer, x.detach(), qr.detach().view(b, t, -1), rope)  # [B, T, T]
        idx_logits = idx_logits.masked_fill(~causal, -math.inf)
        allowed = causal.expand(b, t, t)
        if mode == "sparse":
            sel = idx_logits.detach().topk(min(topk, t), dim=-1).indices
            allowed = torch.zeros(b, t, t, dtype=torch.bool, device=x.device).scatter_(-1, sel, True) & causal
            mask = allowed.unsqueeze(1)
        with torch.no_grad():  # the head-summed attention distribution over the allowed keys
            scores = (qf @ kf.transpose(-1, -2)).float() * scale
            target = torch.softmax(scores.masked_fill(~allowed.unsqueeze(1), -math.inf), dim=-1).sum(1)
            target = target / target.sum(-1, keepdim=True)
            del scores
        logp = torch.log_softmax(idx_logits.masked_fill(~allowed, -math.inf), dim=-1)
        kl = (target * (torch.log(target.clamp_min(1e-12)) - logp.clamp_min(-1e4))).masked_fill(~allowed, 0).sum(-1).mean()
    if mask is None:
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2).reshape(b * t, h * vdim)
    return attn.o_proj(out).view(b, t, -1), kl


def _indexer_logits(indexer, x, qr, rope):
    """fp32 indexer logits [B, T, T] from unquantized q and k (DESIGN.md §4)."""
    b, t, _ = x.shape
    q = indexer.wq_b(qr.reshape(b * t, -1)).view(b * t, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(x.reshape(b * t, -1)))
    q = indexer._rope(q, rope).float().view(b, t, indexer.n_heads, -1)
    k = indexer._rope(k, rope).float().view(b, t, -1)
    w = indexer.weights_proj(x.reshape(b * t, -1).float()).view(b, t, -1) * (indexer.n_heads ** -0.5) * (
        indexer.head_dim ** -0.5)
    out = None
    for hh in range(indexer.n_heads):  # one [B, T, T] at a time keeps memory at O(T^2)
        term = (q[:, :, hh] @ k.transpose(1, 2)).relu() * w[:, :, hh:hh + 1]
        out = term if out is None else out + term
    return out


def _decoder_layer(layer, x, rope, mode, topk):
    a, kl = _layer_attention(layer.self_attn, layer.input_layernorm(x), rope, mode, topk)
    x = x + a
    y = layer.post_attention_layernorm(x)
    x = x + layer.mlp(y.reshape(-1, y.shape[-1])).view_as(x)
    return x, kl


def train_forward(model: DeepseekV32ForCausalLM, ids: torch.Tensor, mode: str, mtp_weight: float = 0.3):
    """Differentiable forward over ``ids [B, T+1]``: returns (lm loss, mean indexer KL or None, mtp loss or None)."""
    if mode not in ("dense", "warmup", "sparse"):
        raise ValueError(f"mode must be dense, warmup or sparse, got {mode!r}")
    inp, tgt = ids[:, :-1], ids[:, 1:]
    b, t = inp.shape
    pos = torch.arange(t, device=ids.device).repeat(b).float()
    angles = pos.unsqueeze(1) * model.rope_inv_freq.unsqueeze(0)
    rope = SimpleNamespace(cos=angles.cos() * model.rope_attn_factor, sin=angles.sin() * model.rope_attn_factor)
    x = model.model.embed_tokens(inp)
    kls = []
    for layer in model.model.layers[: model.args.num_hidden_layers]:
        x, kl = _decoder_layer(layer, x, rope, mode, model.args.index_topk)
        if kl is not None:
            kls.append(kl)
    hidden = model.model.norm(x)
    lm = F.cross_entropy(model.lm_head(hidden).float().reshape(-1, model.args.vocab_size), tgt.reshape(-1))
    mtp = None
    if mtp_weight and model.mtp_layers and t > 1:
        layer = model.mtp_layers[0]
        emb = model.model.embed_tokens(tgt)  # token i+1 beside h_i
        hm = layer.eh_proj(torch.cat((layer.enorm(emb), layer.hnorm(hidden)), dim=-1))
        hm, kl = _decoder_layer(layer, hm, rope, mode, model.args.index_topk)
        if kl is not None:
            kls.append(kl)
        mlogits = layer.shared_head.head(layer.shared_head.norm(hm)).float()[:, :-1]
        mtp = F.cross_entropy(mlogits.reshape(-1, model.args.vocab_size), tgt[:, 1:].reshape(-1))
    return lm, (torch.stack(kls).mean() if kls else None), mtp


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
    losses = [train_forward(model, data[i * context:(i + 1) * context + 1].unsqueeze(0), mode, mtp_weight=0)[0]
              for i in range(n)]
    return float(torch.stack(losses).mean()) / math.log(2)


def train(out_dir: Path, schedule: TrainSchedule = TrainSchedule(), *, log=print, config: Optional[dict] = None,
          stdlib_root: Optional[Path] = None, max_train_bytes: Optional[int] = None,
          init: Optional[Path] = None) -> Path:
    """Run (or resume) training into ``out_dir``; returns the final checkpoint directory.

    ``init``: start from this checkpoint's weights (its config replaces ``config``), e.g. to run
    more indexer warm-up and sparse steps on a finished model with ``dense_steps=0``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if init is not None:
        from .loader import load_config
        config = load_config(init)
    config = dict(config or TRAIN_CONFIG)
    torch.manual_seed(schedule.seed)
    model = DeepseekV32ForCausalLM.from_config(config, dtype=torch.float32, seed=schedule.seed, indexer_fp8=False)
    if init is not None:
        start = DeepseekV32ForCausalLM.from_pretrained(init, dtype=torch.float32, indexer_fp8=False)
        model.load_state_dict(start.state_dict())
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
    train_data = text_tensor(load_text("train", max_train_bytes, stdlib_root))
    heldout = text_tensor(load_text("heldout", schedule.eval_bytes, stdlib_root))
    indexer_params = [p for n, p in model.named_parameters() if ".indexer." in n]
    main_params = [p for n, p in model.named_parameters() if ".indexer." not in n and "e_score_correction_bias" not in n]
    opt_main = torch.optim.AdamW(main_params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt_idx = torch.optim.AdamW(indexer_params, lr=schedule.indexer_lr, betas=(0.9, 0.95), weight_decay=0.0)
    state_path, log_path = out_dir / "train_state.pt", out_dir / "train_log.jsonl"
    step, history = 0, []
    if state_path.is_file():  # resume
        state = load_resume_state(state_path, {"schedule": asdict(schedule), "config": config}, model,
                                  keys=("model", "opt_main", "opt_idx", "step", "history"))
        model.load_state_dict(state["model"])
        opt_main.load_state_dict(state["opt_main"])
        opt_idx.load_state_dict(state["opt_idx"])
        step, history = state["step"], state["history"]
        log(f"resuming at step {step}")

    def lr_at(s: int, base: float, start: int, length: int) -> float:
        frac = (s - start) / max(1, length)
        warm = min(1.0, (s - start + 1) / 50)
        return base * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    t0 = time.time()
    while step < schedule.total:
        phase = schedule.phase(step)
        g = torch.Generator().manual_seed(schedule.seed * 1_000_003 + step)
        if phase == "dense":
            ids = _windows(train_data, schedule.batch, schedule.context, g)
        else:
            ids = _windows(train_data, schedule.sparse_batch, schedule.sparse_context, g)
        model.train()
        lm, kl, mtp = train_forward(model, ids, phase)
        if phase == "dense":
            loss = lm + (0.3 * mtp if mtp is not None else 0)
            for grp in opt_main.param_groups:
                grp["lr"] = lr_at(step, schedule.lr, 0, schedule.dense_steps)
        elif phase == "warmup":
            loss = kl
            for grp in opt_idx.param_groups:
                grp["lr"] = lr_at(step, schedule.indexer_lr, schedule.dense_steps, schedule.warmup_steps)
        else:
            loss = lm + (0.3 * mtp if mtp is not None else 0) + kl
            start = schedule.dense_steps + schedule.warmup_steps
            for grp in opt_main.param_groups:
                grp["lr"] = lr_at(step, schedule.lr * 0.3, start, schedule.sparse_steps)
            for grp in opt_idx.param_groups:
                grp["lr"] = lr_at(step, schedule.indexer_lr * 0.3, start, schedule.sparse_steps)
        opt_main.zero_grad(set_to_none=True)
        opt_idx.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(main_params + indexer_params, 1.0)
        if phase != "warmup":
            opt_main.step()
        if phase != "dense":
            opt_idx.step()
        rec = {"step": step, "phase": phase, "lm_bits": float(lm.detach()) / math.log(2),
               "kl": None if kl is None else float(kl.detach()),
               "mtp_bits": None if mtp is None else float(mtp.detach()) / math.log(2),
               "elapsed_s": round(time.time() - t0, 1)}
        step += 1
        if step % schedule.eval_every == 0 or step == schedule.total:
            model.eval()
            dense = phase == "dense"
            rec["heldout_bits"] = eval_bits_per_byte(model, heldout, schedule.context if dense else schedule.sparse_context,
                                                     "dense" if dense else "sparse", 8 if dense else 4)
            log(json.dumps(rec))
        history.append(rec)
        if "heldout_bits" in rec:  # a resumable point: state and the log up to it
            save_resume_state(state_path, {"schedule": asdict(schedule), "config": config, "model": model.state_dict(),
                                           "opt_main": opt_main.state_dict(), "opt_idx": opt_idx.state_dict(),
                                           "step": step, "history": history})
            log_path.write_text("".join(json.dumps(r) + "\n" for r in history))
    final = out_dir / "checkpoint"
    model.eval()
    save_pretrained(model, final, dtypes=storage_dtypes(model))  # ship bf16 (the indexer head weights stay fp32)
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
