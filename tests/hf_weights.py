"""What the tests comparing against transformers' own DSA models share: a top-k with the ops' tie
order (their random weights are indexcache.tools.random_weights.randomize_), per-row errors, and the
hooks that make a bf16 model replay an fp32 run's routers and indexers."""

import contextlib

import torch


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """``Tensor.topk`` with ties broken toward the lower index, as the ops do: monkeypatched into
    transformers' indexers by the tests that compare against them."""
    values, order = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), order.narrow(dim, 0, k)))


def row_errors(a, b):
    """Each row's (position's) relative error of logits ``a`` against ``b``."""
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()


@contextlib.contextmanager
def layer_hooks(layers, gate_hook, indexer_hook):
    """Forward hooks ``gate_hook(i, layer)`` on layer i's ``mlp.gate`` and ``indexer_hook(i, layer)``
    on its ``self_attn.indexer`` (either may return None: no hook there), removed on exit."""
    hooks = []
    for i, layer in enumerate(layers):
        for module, make in (("mlp.gate", gate_hook), ("self_attn.indexer", indexer_hook)):
            hook = make(i, layer)
            if hook is not None:
                hooks.append(layer.get_submodule(module).register_forward_hook(hook))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def choice_hooks(layers, choices, route, select):
    """``route(i)`` on the routers and ``select(i)`` on the indexers of the layers ``choices`` has
    ``("experts", i)`` / ``("selection", i)`` for."""
    return layer_hooks(layers, lambda i, _: route(i) if ("experts", i) in choices else None,
                       lambda i, _: select(i) if ("selection", i) in choices else None)


def recorded_choices(layers, routed, indexed, experts=lambda out: out[2], selection=lambda out: out):
    """``(hooks, choices)``: ``hooks`` (a context manager) records into the dict ``choices`` each
    ``routed(layer)``'s experts (``experts`` of its router's output: transformers' third) and each
    ``indexed(layer)``'s selection (``selection`` of its indexer's output), keyed ("experts" /
    "selection", i)."""
    choices = {}

    def keep(key, pick):
        return lambda mod, args, out: choices.__setitem__(key, pick(out))
    hooks = layer_hooks(layers, lambda i, l: keep(("experts", i), experts) if routed(l) else None,
                        lambda i, l: keep(("selection", i), selection) if indexed(l) else None)
    return hooks, choices
