"""The references the vLLM tests compare with: this project's own model (the same kernels as the plugin)
and transformers' own classes (an independent implementation), each one forward over a sequence."""

import warnings

import torch

from indexcache.models import from_pretrained


def load_ours(path, overrides=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_pretrained(path, hf_overrides=overrides, dtype=torch.float32, **kw)


def ours_logprobs(path, seq, overrides=None, model=None, **kw):
    """log-probs of every token of ``seq`` (after the first) and the greedy choice at each position."""
    model = model if model is not None else load_ours(path, overrides, **kw)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq])).float()[0], dim=-1)
    ids = torch.tensor(seq[1:])
    return logp[:-1].gather(1, ids[:, None])[:, 0], logp.argmax(-1)


def greedy_gap(prompt, generated, ref_greedy):
    """The generated tokens against the reference's argmax after each prefix (None when equal)."""
    want = ref_greedy[len(prompt) - 1:len(prompt) + len(generated) - 1].tolist()
    return None if list(generated) == want else (list(generated), want)


def transformers_logprobs(path, seq, model_cls=None):
    """log-probs of every token of ``seq`` (after the first) under transformers' own class of the
    checkpoint (``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM``; ``model_cls`` when the process's
    AutoConfig maps the model_type elsewhere, as vLLM's config registry does for deepseek_v4), fp32,
    eager attention."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = model_cls or transformers.AutoModelForCausalLM
        kw = {} if model_cls is None else {"config": model_cls.config_class.from_pretrained(path)}
        model = cls.from_pretrained(path, dtype=torch.float32, **kw).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits.float()[0], dim=-1)
    return logp[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def generate_logprobs(model, token_prompts, new_tokens, **settings):
    """This package's own ``generate`` (greedy, no stop tokens): per prompt, the generated tokens and the
    log-prob of each under the logits ``generate`` sampled it from (read as it computes them: prefill's
    rows, one per request in order, then one row per live request per decode step)."""
    from indexcache.runtime import generate

    rows = []
    compute_logits = model.compute_logits

    def recording(hidden):
        logits = compute_logits(hidden)
        rows.extend(torch.log_softmax(logits.float(), dim=-1).unbind(0))
        return logits

    model.compute_logits = recording
    try:
        out = generate(model, token_prompts, new_tokens, stop_tokens=[], decode_step="eager", decode_threads=1,
                       **settings)
    finally:
        del model.compute_logits
    n = len(token_prompts)
    assert len(rows) == n * new_tokens and all(len(t) == new_tokens for t in out.tokens)
    # every request lives for all new_tokens steps: row j * n + b is request b's j-th token
    logprobs = [[float(rows[j * n + b][t]) for j, t in enumerate(out.tokens[b])] for b in range(n)]
    return out.tokens, logprobs


def reuse_rule(saved: list, saved_pos: int, pos: int, k: int) -> list:
    """The step-reuse row, written out (docs/model.md): the positions decoded since the saved selection
    (the last k at most), then the smallest k - m saved positions; ascending, -1-padded to k."""
    new = list(range(max(saved_pos + 1, pos + 1 - k), pos + 1))
    old = sorted(p for p in saved if p >= 0)[:k - len(new)]
    row = sorted(old + new)
    return row + [-1] * (k - len(row))


class ReuseRuleCheck:
    """Forward hooks on every lightning indexer of this package's model under ``index_reuse_steps`` R: a
    request's one decode row whose layer selection was saved fewer than R positions before must be
    :func:`reuse_rule` of it, unless the adaptive probe (the first F layer, which scores every decode
    row) sent the request back to computing in this forward (``ctx.reuse_forced``); every other row
    computes and its request's last row is saved (the probe keeps its older row where the request
    reused). Counts decode rows that reused, that recomputed on schedule and that the probe forced."""

    def __init__(self, model, steps):
        from indexcache.models.blocks.indexer import Indexer

        self.steps, self.k = steps, model.args.index_topk
        self.saved, self.reused, self.recomputed, self.forced = {}, 0, 0, 0
        indexers = [m for m in model.modules() if isinstance(m, Indexer)]
        assert indexers
        self.probe = min(m.layer_id for m in indexers)
        self.hooks = [m.register_forward_hook(self._hook(m.layer_id)) for m in indexers]

    def _hook(self, layer_id):
        def hook(module, args, rows):
            ctx = args[2]
            meta, offs = ctx.meta, ctx.meta.row_offsets()
            for b, rid in enumerate(meta.rids):
                pos, q = meta.ctx_lens[b], meta.q_lens[b]
                last = rows[offs[b] + q - 1].tolist()
                saved = self.saved.get((rid, layer_id))
                if ctx.decode_reuse and q == 1 and saved is not None and pos - saved[0] < self.steps:
                    if rid in ctx.reuse_forced:
                        self.forced += layer_id != self.probe
                    elif layer_id == self.probe and ctx.reuse_min_recall is not None:
                        continue  # scored afresh to check the others' reuse; its older row stays saved
                    else:
                        assert last == reuse_rule(saved[1], saved[0], pos, self.k), (layer_id, rid, pos)
                        self.reused += 1
                        continue
                else:
                    self.recomputed += bool(ctx.decode_reuse)
                self.saved[(rid, layer_id)] = (pos + q - 1, last)
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()
