"""A fetch's pages put in place ahead of its streams (``snapshot.stripes.Ahead``): a thread of
its own populates the next stripe while one streams, never more than ``depth`` stripes beyond
the last asked for, and never a stripe a stream is writing."""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

import numpy as np
import pytest

from collective import arena as arenas
from collective.snapshot import stripes as S

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and lazy arenas (Linux)")

STRIPE = 4 << 20
WAIT = 60.0  # a bound on waiting for a thread under load, never a timing assertion


def _resident(array: np.ndarray, a: int, b: int) -> int:
    """How many of the pages of bytes ``a..b`` of ``array`` are in memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    pages = (b - a) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(array.ctypes.data + a, b - a, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def _spans(n: int) -> list[tuple[int, int]]:
    return [(i * STRIPE, (i + 1) * STRIPE) for i in range(n)]


def _until(ahead: S.Ahead, i: int, state: int) -> None:
    with ahead.cond:
        assert ahead.cond.wait_for(lambda: ahead.state[i] == state, WAIT), ahead.state


def test_the_next_stripe_is_populated_while_one_streams_and_no_further():
    arena = arenas.lazy_arena(4 * STRIPE)
    ahead = S.Ahead(arena, _spans(4), depth=1)
    try:
        _until(ahead, 0, 2)  # the first one before any is asked for: the stream's request overlaps it
        assert ahead.state[1:] == [0, 0, 0]
        assert _resident(arena, STRIPE, 4 * STRIPE) == 0  # nothing committed beyond the depth
        ahead.ready(0, STRIPE)  # stripe 0 asked for (in place already): stripe 1 is populated meanwhile
        _until(ahead, 1, 2)
        assert _resident(arena, 0, 2 * STRIPE) == 2 * STRIPE // mmap.PAGESIZE
        assert ahead.state[2:] == [0, 0] and _resident(arena, 2 * STRIPE, 4 * STRIPE) == 0
        ahead.ready(STRIPE, 2 * STRIPE)
        _until(ahead, 2, 2)
        assert ahead.state[3] == 0 and _resident(arena, 3 * STRIPE, 4 * STRIPE) == 0
    finally:
        ahead.close()
    assert not ahead.thread.is_alive()


def test_a_stripe_the_thread_has_not_reached_is_populated_by_whoever_asks():
    arena = arenas.lazy_arena(4 * STRIPE)
    ahead = S.Ahead(arena, _spans(4), depth=0)
    try:
        ahead.ready(3 * STRIPE, 4 * STRIPE)  # far ahead of the thread: populated here, now
        assert ahead.state[3] == 2
        assert _resident(arena, 3 * STRIPE, 4 * STRIPE) == STRIPE // mmap.PAGESIZE
        arena[3 * STRIPE :] = 7  # received; the thread, reaching it, must not write it again
        ahead.ready(0, STRIPE)
        for i in range(3):
            _until(ahead, i, 2)
    finally:
        ahead.close()
    assert (arena[3 * STRIPE :] == 7).all()


def test_a_stream_waits_for_the_stripe_being_populated(monkeypatch):
    # ``populate`` writes zeros to the pages of its range: a stream must not write them meanwhile.
    began, release = threading.Event(), threading.Event()
    real = S.warm

    def slow_warm(arena, a, b):
        if a == STRIPE:
            began.set()
            assert release.wait(WAIT)
        real(arena, a, b)

    monkeypatch.setattr(S, "warm", slow_warm)
    arena = arenas.lazy_arena(2 * STRIPE)
    ahead = S.Ahead(arena, _spans(2), depth=1)
    returned = threading.Event()
    try:
        ahead.ready(0, STRIPE)  # stripe 0 streams: the thread goes on to stripe 1
        assert began.wait(WAIT)  # the thread is inside stripe 1
        asker = threading.Thread(target=lambda: (ahead.ready(STRIPE, 2 * STRIPE), returned.set()))
        asker.start()
        asker.join(0.3)
        assert not returned.is_set() and ahead.state[1] == 1  # still waiting for the thread
        release.set()
        asker.join(WAIT)
        assert returned.is_set() and ahead.state[1] == 2
    finally:
        release.set()
        ahead.close()


def test_what_is_left_of_a_stripe_is_populated_alone():
    # A dropped holder's stripe comes back as what it had not verified (pos..end): populated
    # alone if the stripe never was, and the stripe is not counted in place for that.
    arena = arenas.lazy_arena(2 * STRIPE)
    ahead = S.Ahead(arena, _spans(2), depth=0)
    ahead.close()  # no thread: every stripe populated by who asks
    arena[: STRIPE // 2] = 5
    ahead.ready(STRIPE // 2, STRIPE)
    assert ahead.state[0] == 0 and (arena[: STRIPE // 2] == 5).all()
    assert _resident(arena, STRIPE // 2, STRIPE) == STRIPE // 2 // mmap.PAGESIZE

