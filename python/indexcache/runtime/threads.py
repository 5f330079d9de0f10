"""The CPU decode step's thread count, chosen by timing it.

A decode step is a few hundred small ops, each an OpenMP region where the work is tiny. With
every core busy (other processes, a shared server), each region waits for all its threads to be
scheduled, and torch's spinning workers steal time from the ones with work: on 2 cores with
other load the embedded model decoded at 3.7 tok/s on 2 threads and 29 tok/s on 1
(docs/model.md). Which count is faster depends on the machine, the model and the load, so, as
llama.cpp keeps apart the threads of generation and of batch processing, ``generate`` picks
the decode count by measuring: the first steps cycle through the candidates (1, 2, 4, … up to
torch's count), a few steps each, interleaved; a candidate whose best step is more than twice
the best step seen drops out at once (on a loaded machine a bad count costs 10x a step, so
three trials of it would cost more than the choice saves in a short generation), and the one
with the lowest median step time is kept for the rest of the call.

Prefill's ops are larger, but they wait on a busy core all the same: the embedded model's
541-token prompt on a Zen 3 whose other core was compiling prefilled at 34-86 tok/s on 2 threads
and 450-1438 on 1, and one 32-token piece at 2 threads took 9.6 s there, so prefill cannot try
counts on pieces of the prompt. :func:`prefill_threads` chooses by the same rule over a probe
whose cost is bounded: an fp32 ``PROBE_MM``-cube matmul (a few ms a trial on one core; one
scheduler wait a trial on a busy machine).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

TRIALS_PER_CANDIDATE = 3
DROP_RATIO = 2.0
PROBE_MM = 512


def candidates(max_threads: int) -> list:
    """1, 2, 4, … below ``max_threads``, then ``max_threads`` itself."""
    out, n = [], 1
    while n < max_threads:
        out.append(n)
        n *= 2
    return out + [max_threads]


class DecodeThreads:
    """Sets torch's intra-op thread count for each decode step (``tuner.run(step)``).

    ``fixed``: a count to use for every step (no timing); None: choose by timing as above.
    ``tune``: False for a device where the host's thread count is not the step's (CUDA). The
    count in force before is restored by :meth:`restore`. ``clock``: seconds, for the timing.
    """

    def __init__(self, fixed: Optional[int], tune: bool = True, clock=time.perf_counter):
        self.clock = clock
        self.original = torch.get_num_threads()
        if fixed is not None and fixed < 1:
            raise ValueError(f"decode_threads must be >= 1 (or None for auto), got {fixed}")
        self.chosen: Optional[int] = fixed if fixed is not None else (None if tune else self.original)
        self.cands = candidates(self.original) if self.chosen is None else [self.chosen]
        if len(self.cands) == 1:
            self.chosen = self.cands[0]
        self.times: dict = {c: [] for c in self.cands}
        self.trial = 0

    def current(self) -> int:
        return self.chosen if self.chosen is not None else self.cands[self.trial % len(self.cands)]

    def _settle(self) -> None:
        """Drop the candidates already twice as slow as the best step; choose when one is left or
        every one left has its trials."""
        best = min(min(t) for t in self.times.values() if t)
        self.cands = [c for c in self.cands if not self.times[c] or min(self.times[c]) <= DROP_RATIO * best]
        if len(self.cands) == 1 or all(len(self.times[c]) >= TRIALS_PER_CANDIDATE for c in self.cands):
            self.chosen = min(self.cands, key=lambda c: statistics.median(self.times[c]))

    def run(self, step):
        """``step()`` under the count of this step; while choosing, its wall time is recorded."""
        n = self.current()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        if self.chosen is not None:
            return step()
        t0 = self.clock()
        out = step()
        self.times[n].append(self.clock() - t0)
        self.trial += 1
        self._settle()
        return out

    def restore(self) -> None:
        if torch.get_num_threads() != self.original:
            torch.set_num_threads(self.original)


def prefill_threads(clock=time.perf_counter, work=None) -> int:
    """The intra-op count for a prefill on the CPU, chosen as the decode count is (candidates up
    to torch's count, interleaved trials, the slow ones dropped) over ``work`` (default: an fp32
    ``PROBE_MM``-cube matmul, prefill's kind of op). torch's count is left as it was."""
    if work is None:
        a = torch.full((PROBE_MM, PROBE_MM), 0.25)  # not torch.randn: the caller's RNG stays untouched
        c = torch.empty_like(a)
        work = lambda: torch.mm(a, a, out=c)  # noqa: E731
    tuner = DecodeThreads(None, clock=clock)
    try:
        while tuner.chosen is None:
            tuner.run(work)
    finally:
        tuner.restore()
    return tuner.chosen
