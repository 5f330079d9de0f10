"""The plain decode step (one new token per request) on static buffers, run eagerly or captured
once as a CUDA graph and replayed, as serving engines do for decode.

A ``DecodeStep`` serves one batch size over one ``PagedKVCache``. Before each step the caller
writes the step's inputs into its static tensors (``prepare``: the token ids, how many tokens
each request already has in the cache, and the requests' block tables); the step then computes
the cache slots, runs every layer with ``sync_free=True`` and leaves fp32 logits in
``self.logits``. Nothing in it reads device data back to the host: the indexer, top-k, sparse
MLA and both cache inserts are device-only ops on CUDA (docs/cuda_kernels.md, "Validation on the
device"), and the MoE takes its masked form (``MoE._masked``). So the same Python runs eagerly
(``graph=False``, any device: how the CPU tests check it) or is captured with
``torch.cuda.CUDAGraph`` and replayed (``graph=True``); a replay repeats exactly the kernels of
the eager run, so its logits are bit-identical to an eager run of the same step.

On the CPU the same step is compiled (``compiled=True``: ``torch.compile``, one graph, static
shapes) instead: the eager step's ~1000 aten calls and their Python become one generated function
around the extension's ops, its small ops fused (docs/profiling.md, fifteenth round).
"""

from __future__ import annotations

import os
import types
from typing import Optional, Sequence

import torch

from indexcache import ops

from indexcache.models.state import BatchMeta, PagedKVCache


# How a CPU step is compiled. cpp.threads 1: inductor's own kernels (the fused small ops of one
# decode row) run serially; with OpenMP regions of their own beside the extension's at::parallel_for
# ones, a 2-thread step took 100x longer (2026-12-07, Zen 4: 23 ms a swiglu_rows call, 0.1 eager).
# guard_filter_fn: no guard on the model's parameters at each call (1.2-1.9 ms a step on 2 cores);
# a step is compiled for one DecodeStep (one generate call), over which the model is not changed.
# emulate_precision_casts: fused ops round each bf16 intermediate as the eager ops do (without it a
# GLM-5 step's logits moved 1.6 % from eager's and greedy tokens parted after ~14; with it equal).
COMPILE_OPTIONS = {"cpp.threads": 1, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                   "emulate_precision_casts": True}


def unsupported_reason(model, cache: PagedKVCache, graph: bool = False, compiled: bool = False) -> Optional[str]:
    """Why ``model`` cannot run a sync-free decode step over ``cache`` (None: it can); ``graph``:
    also as a captured CUDA graph; ``compiled``: also compiled for the CPU."""
    if graph and cache.device.type != "cuda":
        return f"a CUDA graph needs a CUDA device; the model is on {cache.device}"
    if compiled and cache.device.type != "cpu":
        return f"a compiled step is for the CPU (on CUDA use 'graph'); the model is on {cache.device}"
    if graph and os.environ.get("INDEXCACHE_CHECK", "0") not in ("", "0"):
        return "INDEXCACHE_CHECK=1 checks every CUDA op's indices on the host (a copy and a sync)"
    if model.par.world_size > 1:
        return "tensor / pipeline parallel runs are not captured (their collectives run eagerly)"
    if not model.args.native_mla:
        return (f"the sparse MLA of a {model.args.kv_lora_rank} + {model.args.qk_rope_head_dim} latent runs "
                "reference.sparse_mla (512 + 64 only has the device op)")
    for layer in list(model.model.layers) + list(model.mtp_layers):
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None and not indexer.fp8:
            return "the fp32 indexer reads each request's length on the host (use the fp8 indexer)"
    return None


class DecodeStep:
    """One decode step of ``batch`` requests, one row each, over ``cache``; block tables padded to
    ``max_blocks`` columns. ``graph``: capture on the first call and replay after (CUDA only);
    ``pool``: a CUDA graph memory pool to share with other steps (``DecodeStep.pool``);
    ``compiled``: compile the step with ``torch.compile`` on the first call (CPU only)."""

    def __init__(self, model, cache: PagedKVCache, batch: int, max_blocks: int, graph: bool = False, pool=None,
                 compiled: bool = False):
        if graph and compiled:
            raise ValueError("a decode step is either captured (graph) or compiled, not both")
        reason = unsupported_reason(model, cache, graph, compiled)
        if reason is not None:
            raise ValueError(f"no sync-free decode step here: {reason}")
        if not 1 <= batch <= model.topk_buffer.shape[0]:
            raise ValueError(f"decode batch {batch} outside [1, {model.topk_buffer.shape[0]}] (the top-k buffer's rows)")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.model, self.cache, self.batch, self.use_graph = model, cache, batch, graph
        dev = cache.device
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)       # = tokens already cached
        self.seq_lens = torch.ones(batch, dtype=torch.int32, device=dev)        # = positions + 1
        self.req_of_row = torch.arange(batch, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=dev)
        self.logits: Optional[torch.Tensor] = None
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.pool = pool
        self.replays = 0
        self.caps: Optional[list] = None  # each row's allocated tokens (from its request's blocks)
        self.run = self._forward
        if compiled:
            # A code object of this step's own: torch keeps compiled graphs per code object, and a
            # graph bakes in its step's model (the plan, which layers hold an indexer) with the
            # guards on it dropped (COMPILE_OPTIONS), so a second model of the same shapes must not
            # find it (it did: the S layers of one ran as the other's F layers).
            own = types.FunctionType(DecodeStep._forward.__code__.replace(), globals(), "_forward")
            self.run = torch.compile(types.MethodType(own, self), fullgraph=True, dynamic=False,
                                     options=COMPILE_OPTIONS)

    def prepare(self, token_ids: Sequence[int], cached: Sequence[int], rids: Optional[Sequence] = None) -> None:
        """Inputs of the next step: request b feeds ``token_ids[b]`` at position ``cached[b]``.
        ``rids``: the requests of the rows (their block tables are copied in); None keeps the last."""
        b = self.batch
        if len(token_ids) != b or len(cached) != b or (rids is not None and len(rids) != b):
            raise ValueError(f"this decode step serves {b} requests; got {len(token_ids)} ids, {len(cached)} lengths")
        vocab = self.model.args.vocab_size
        if any(not 0 <= int(t) < vocab for t in token_ids):
            raise ValueError(f"token ids must lie in [0, {vocab}), got {list(token_ids)}")
        width = self.block_table.shape[1] * self.cache.block_size
        if rids is not None:
            caps = [self.cache.manager.capacity(r) for r in rids]
            if any(c > width for c in caps):
                raise ValueError(f"a request holds {max(caps)} tokens of blocks; this step's tables hold {width}")
            self.caps = caps
            self.block_table.copy_(self.cache.manager.block_table(rids, "cpu", width=self.block_table.shape[1]))
        if self.caps is None:
            raise ValueError("the first prepare() of a decode step needs the requests (rids)")
        if any(int(c) < 0 or int(c) >= cap for c, cap in zip(cached, self.caps)):
            raise ValueError(f"positions {list(cached)} outside the requests' allocated blocks {self.caps}")
        self.ids.copy_(torch.tensor([int(t) for t in token_ids], dtype=torch.long))
        self.positions.copy_(torch.tensor([int(c) for c in cached], dtype=torch.long))
        self.seq_lens.copy_(self.positions + 1)

    def _forward(self) -> torch.Tensor:
        slots = ops.positions_to_slots(self.positions.view(-1, 1).int(), self.req_of_row, self.block_table,
                                       self.cache.block_size).view(-1).long()
        # ctx_lens stays empty: no host-side length is known (the paths that would read it refuse)
        meta = BatchMeta(self.positions, self.req_of_row, [1] * self.batch, [], self.seq_lens, self.block_table,
                         self.cache.block_size, slots)
        h = self.model.forward_tokens(self.ids, meta, self.cache, sync_free=True)
        return self.model.compute_logits(h)

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """Run the step; returns fp32 logits ``[batch, vocab]`` (the graph's output buffer when captured:
        overwritten by the next replay)."""
        if not self.use_graph:
            self.logits = self.run()
            return self.logits
        if self.graph is None:
            self._capture()
        self.graph.replay()
        self.replays += 1
        return self.logits

    def _capture(self) -> None:
        # One eager run on a side stream first (lazy library and workspace set-up must not be
        # captured); it writes this step's cache entries, which the replay rewrites identically.
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            self._forward()
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.logits = self._forward()
        self.pool = self.graph.pool()
