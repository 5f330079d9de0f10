"""Run a hot loop of Python calls where CPython's frame stack does not map and unmap memory.

Since 3.11 CPython keeps its frames on a per-thread stack of chunks (``Python/pystate.c``): a
call that does not fit the current chunk gets a new one from ``mmap``, and the return that empties
that chunk hands it back with ``munmap``. A loop whose call depth goes back and forth across a
chunk's end therefore maps and unmaps on every crossing. Where the depth is depends on whatever
called the loop, so the same decode loop crossed in one caller and not in another. Each ``munmap``
of a process that runs a second thread (torch's OpenMP worker at 2 threads) sends a TLB-flush
interrupt to the other core, which costs the most under a hypervisor. On the 2-core AMX Xeon
(KVM, 2026-12-07) that held ``bench/bench_llamacpp.py``'s all-F decode at 2 threads to 45-52 tok/s,
80-92 in the same caller once the loop had a chunk of its own: perf put the lost time in ``munmap`` ->
``flush_tlb_mm_range`` -> ``x2apic_send_IPI``, strace found ~10,000 16 KiB ``munmap`` calls from
``_PyThreadState_PopFrame`` (docs/performance.md, "the 2-thread all-F cell explained and fixed").

:func:`call_with_room` calls a function from a frame that is bigger than a chunk, so that frame
starts a fresh chunk of 64 KiB of which about 32 KiB are left for the callee and everything it
calls: a loop whose steps stay within that depth never crosses a chunk's end. The frame's size
comes from its unused local variables (``ROOM_SLOTS`` of them, never assigned); on a Python without
the chunked stack (before 3.11) it is an ordinary call.
"""

from __future__ import annotations

# Frame slots (8 bytes each) of the calling frame. A chunk is the smallest of 16, 32, 64, ... KiB
# that holds the frame and a margin of about 1 KB (measured on 3.11: 3200 slots got a 32 KiB chunk
# with ~6 KiB left, 4000 a 64 KiB one with ~32 KiB left, 6000 64 KiB with ~16 KiB), so 4000 slots
# (31.3 KiB) are just over half a 64 KiB chunk and leave the callee the other half.
ROOM_SLOTS = 4000


def _room_caller(slots: int):
    """A ``call(fn, *args, **kwargs)`` whose frame holds ``slots`` more local variables."""
    names = ", ".join(f"_s{i}" for i in range(slots))
    src = ("def call(fn, *args, **kwargs):\n"
           "    if fn is None:  # never true: the names only size the frame\n"
           f"        {names} = (None,) * {slots}\n"
           "    return fn(*args, **kwargs)\n")
    scope: dict = {}
    exec(compile(src, "<indexcache.runtime.stack_room>", "exec"), scope)
    return scope["call"]


_call = _room_caller(ROOM_SLOTS)


def call_with_room(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, called from a frame that starts a frame-stack chunk of its own
    (module docstring). Not nested: a second one inside the first would sit in the first's chunk."""
    if not callable(fn):
        raise ValueError(f"call_with_room needs a callable, got {type(fn).__name__}")
    return _call(fn, *args, **kwargs)
