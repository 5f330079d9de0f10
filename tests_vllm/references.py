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
