"""What the tests comparing against transformers' own DSA models share: a top-k with the ops' tie
order (their random weights are indexcache.tools.random_weights.randomize_)."""

import torch


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """``Tensor.topk`` with ties broken toward the lower index, as the ops do: monkeypatched into
    transformers' indexers by the tests that compare against them."""
    values, order = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), order.narrow(dim, 0, k)))
