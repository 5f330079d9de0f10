"""runtime.stack_room: a call from a frame that starts its own frame-stack chunk, so that a loop
whose call depth goes back and forth does not map and unmap CPython's chunks (counted here as the
minor page faults a fresh chunk's first touch costs)."""

import resource
import sys

import pytest

from indexcache.runtime.stack_room import ROOM_SLOTS, call_with_room

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11) or not sys.platform.startswith("linux"),
                                reason="CPython's chunked frame stack (3.11+); minor faults from getrusage (Linux)")

# ~54 bytes a frame of _down on 3.11: 400 frames (21 KiB) stay inside the room's ~32 KiB; the control
# goes to 38 KiB, past at least one end of the 16 KiB chunks plain calls run in.
DEPTHS = range(1, 400, 3)
CONTROL_DEPTHS = range(1, 700, 3)
SWINGS = 256  # a crossing faults at least once a swing; the room itself costs one fresh chunk a call (<= ~20)


def _down(n: int) -> int:
    return _down(n - 1) if n else 0


def _swing(depth: int) -> None:
    for _ in range(SWINGS):
        _down(depth)


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _worst_faults(call, depths=DEPTHS) -> int:
    """The most minor faults any one depth's swings cost, each depth called through ``call``."""
    worst = 0
    for d in depths:
        call(_swing, d)  # first touch of whatever this depth needs, not counted
        before = _minflt()
        call(_swing, d)
        worst = max(worst, _minflt() - before)
    return worst


def test_plain_calls_cross_a_chunk_end_and_fault():
    """The control: without the room, some depth in CONTROL_DEPTHS crosses a chunk's end, and each swing
    across it maps a fresh chunk (at least one fault a swing)."""
    assert _worst_faults(lambda f, d: f(d), CONTROL_DEPTHS) >= SWINGS


def test_call_with_room_keeps_the_swings_in_one_chunk():
    assert _worst_faults(call_with_room) < SWINGS // 4


def test_call_with_room_passes_arguments_results_and_errors():
    assert call_with_room(lambda a, b=0: (a, b), 3, b=4) == (3, 4)
    with pytest.raises(KeyError, match="boom"):
        call_with_room(lambda: {}["boom"])
    with pytest.raises(ValueError, match="needs a callable, got int"):
        call_with_room(5)


def test_room_slots_size_the_frame():
    from indexcache.runtime import stack_room
    assert stack_room._call.__code__.co_nlocals >= ROOM_SLOTS
