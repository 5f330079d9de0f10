"""IndexCache across decode steps (``index_reuse_steps``) through the vLLM plugin.

The rule is the package's own (:mod:`indexcache.models.step_reuse`: which rows recompute, the reuse
row, the adaptive probe), run on vLLM's batches. What vLLM adds is the bookkeeping a step-reuse
decision needs and vLLM's attention metadata lacks:

* **which request each row is.** ``GPUModelRunner._model_forward`` (vLLM's documented override point
  for model execution, wrapped in ``vllm_patches.PATCHES``) puts a :class:`StepRequests` on vLLM's
  forward context before the model runs: the request ids of the step's requests in row order (the
  persistent batch's order after vLLM's condensing and reordering, the order its metadata uses), their
  prompt lengths, and the ids the runner still holds. Saved selections are keyed by vLLM's request
  ids, so they follow a request wherever the persistent batch moves it;
* **prefill versus decode.** A request whose rows start inside its prompt (a prompt chunk, even a
  one-token one, a prefix-cache hit's last prompt token) computes in every F layer, as ``generate``'s
  prefill does; its computing rows save the F layers' selections anew. A one-row forward past the
  prompt is a decode row and follows the rule (``0 < pos - saved_pos < R``). A preempted request keeps
  its saved rows: its sequence, and so the selection at a position, is the one it had, and the
  recompute's computing chunks overwrite them. A request id that comes back for a new request starts
  with a prompt row, which computes and saves;
* **freeing.** Once per forward the selections of ids the runner no longer holds (finished, aborted)
  are dropped.

Forwards that do not come through ``_model_forward`` (vLLM's dummy and profiling runs) compute every
row and save nothing. One set per forward (:attr:`StepRequests.forced`) holds the requests that compute
in every F layer: those prefilling, then those the adaptive probe sends back to computing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from indexcache.models import step_reuse
from indexcache.models.state import BatchMeta, ForwardContext, SelectionStore

FORWARD_ATTR = "indexcache_requests"  # the attribute of vLLM's ForwardContext holding StepRequests


@dataclass
class StepRequests:
    """The requests of one vLLM forward, in row order."""
    rids: tuple         # vLLM's request ids
    prompt_lens: tuple  # their prompt lengths (tokens)
    live: object        # a container of every request id the runner holds (running or preempted)
    forced: Optional[set] = None  # ids computing in every F layer this forward (forced_set)

    def forced_set(self, ctx_lens) -> set:
        """The ids whose rows start inside the prompt (``ctx_lens``: tokens before each request's rows),
        made once per forward; the adaptive probe adds to the same set."""
        if len(ctx_lens) != len(self.rids):
            raise RuntimeError(f"indexcache: a forward of {len(ctx_lens)} requests, but vLLM's runner scheduled "
                               f"{len(self.rids)} ({list(self.rids)})")
        if self.forced is None:
            self.forced = {rid for rid, c, p in zip(self.rids, ctx_lens, self.prompt_lens) if c < p}
        return self.forced


def runner_requests(runner) -> StepRequests:
    """The :class:`StepRequests` of the forward ``runner`` (vLLM's GPUModelRunner / CPUModelRunner) is
    about to run."""
    batch = runner.input_batch
    n = batch.num_reqs
    return StepRequests(tuple(batch.req_ids[:n]), tuple(int(p) for p in batch.num_prompt_tokens[:n]),
                        runner.requests.keys())


def current() -> Optional[StepRequests]:
    """This forward's requests (None: a forward vLLM runs without its runner's batch, e.g. profiling)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return getattr(get_forward_context(), FORWARD_ATTR, None)


def prune(store: SelectionStore, step: StepRequests) -> None:
    """Drop the saved selections of requests vLLM's runner no longer holds."""
    for rid in store.requests():
        if rid not in step.live:
            store.free(rid)


def begin(ctx: ForwardContext, steps: int, min_recall: Optional[float], step: StepRequests) -> None:
    """Put step reuse in force on a package forward context over vLLM's batch (``ctx.meta.rids`` vLLM's)."""
    ctx.reuse_steps, ctx.decode_reuse, ctx.reuse_min_recall = steps, True, min_recall
    ctx.reuse_forced = step.forced_set(ctx.meta.ctx_lens)


# --------------------------------------------------------------------------------------------
# vLLM's own DSA model (DeepSeek-V3.2, GLM-5): the plugin's indexer forward plans each F layer
# --------------------------------------------------------------------------------------------


@dataclass
class ServedReuse:
    """Step reuse of one served model (vLLM's model code): its saved selections and the plan's F layers."""
    steps: int
    min_recall: Optional[float]
    full: tuple         # per layer id: F
    block_size: int
    selections: SelectionStore

    @property
    def first_f(self) -> int:
        return next(i for i, f in enumerate(self.full) if f)


def attach(model, hf_config, pattern: str, block_size: int) -> int:
    """Give every indexer of a served model (vLLM's ``Indexer`` modules) the model's step-reuse state and
    its layer id, when ``hf_config.index_reuse_steps`` > 1; returns how many indexers were given it."""
    steps = int(getattr(hf_config, "index_reuse_steps", 1) or 1)
    if steps <= 1:
        return 0
    state = ServedReuse(steps, getattr(hf_config, "index_reuse_min_recall", None),
                        tuple(c == "F" for c in pattern), int(block_size), SelectionStore())
    n = 0
    for mod in model.modules():
        if type(mod).__name__ == "Indexer" and hasattr(mod, "k_cache"):
            mod.ic_reuse, mod.ic_layer_id = state, layer_id(mod.prefix)
            n += 1
    return n


def layer_id(prefix: str) -> int:
    """``model.layers.3.self_attn.indexer`` -> 3."""
    parts = prefix.split(".")
    if "layers" not in parts[:-1]:
        raise ValueError(f"indexcache: cannot tell the layer of indexer {prefix!r}")
    return int(parts[parts.index("layers") + 1])


def plan_layer(indexer, meta, positions, buf) -> Optional[step_reuse.ReusePlan]:
    """The rows of this F layer that compute in this forward (``meta`` the plugin's indexer metadata,
    ``positions`` vLLM's, ``buf`` the shared top-k buffer); None: every row computes, nothing is saved
    (step reuse off, or a forward without the runner's requests)."""
    state: Optional[ServedReuse] = getattr(indexer, "ic_reuse", None)
    step = current() if state is not None else None
    if step is None:
        return None
    import torch

    n, q_lens = meta.num_actual_tokens, [int(q) for q in meta.q_lens_cpu]
    ctx_lens = [int(s) - q for s, q in zip(meta.seq_lens_cpu, q_lens)]
    req_of_row = torch.repeat_interleave(torch.arange(len(q_lens), dtype=torch.int32), torch.tensor(q_lens))
    batch = BatchMeta(positions[:n].to(torch.int64), req_of_row.to(positions.device), q_lens, ctx_lens,
                      meta.seq_lens, meta.block_table, state.block_size, meta.slot_mapping[:n].to(torch.int64),
                      step.rids)
    ctx = ForwardContext(meta=batch, cos=None, sin=None, topk_buffer=buf, full=state.full, cache=state)
    begin(ctx, state.steps, state.min_recall, step)
    if indexer.ic_layer_id == state.first_f:  # the first F layer of the forward
        prune(state.selections, step)
    return step_reuse.plan_forward(ctx, indexer.ic_layer_id)


def host_seq_lens(meta: BatchMeta) -> list:
    """Per request of a (sub-)batch, the tokens in the cache after this step."""
    return [c + q for c, q in zip(meta.ctx_lens, meta.q_lens)]
