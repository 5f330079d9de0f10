"""Random weights for transformers' own DSA models, shared by the tests that write tiny
checkpoints with `save_pretrained` (tests/, tests_vllm/) and by bench/bench_llamacpp.py. Norms near
1, small biases, unit embeddings, fan-in scaled matrices: a random model whose activations stay
O(1) through a few layers, so top-k choices are not ties of noise."""

import torch


def randomize_(model, seed, norm_center: float = 1.0):
    """Fills every parameter and buffer of `model` (but RoPE's inv_freq) in place; returns it.
    ``norm_center``: where the norm weights centre (0 for models whose norms scale by 1 + w)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(norm_center + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    return model
