"""Receive arenas: where a worker's, a fetch's and a holder's stream lands, allocated here with
its pages put in place before the stream writes them (``new_arena``), or as each range is asked
for (``lazy_arena`` + ``warm``).
"""

from __future__ import annotations

import mmap
import time

import numpy as np

PAGE = 4096
SEGMENT = 8 << 20
"""``new_arena`` puts the pages of an arena in place this many bytes at a time."""
SEGMENT_SLOW = 0.005
"""CPU seconds of one segment's huge pages beyond which the rest of the arena takes small pages
populated by the kernel (``POPULATE_STEP`` bytes a call). On a 2-core VM 32 MiB take 1.5-2.5 ms
of huge pages where the memory is warm, 75-100 ms where its host touches it first, and 10-11 ms
of small pages either way (40 ms at worst): per 8 MiB segment, under 0.7 ms, about 20 ms and under 3 ms. The thread's CPU time,
not the clock: a thread preempted meanwhile is not slow memory (the host's first touch stalls
the virtual CPU, so it counts)."""
_MADV_POPULATE_WRITE = 23  # madvise(2), Linux 5.14; Python 3.11's mmap has no name for it
POPULATE_STEP = 64 << 20
"""``new_arena`` has the kernel populate small pages this many bytes a call. ``mmap.madvise``
holds the GIL for a whole call: one call for the rest of a 4 GiB arena held it 37.7 s beside
three CPU-bound processes, the worker's heartbeat thread never ran meanwhile, and the chief
declared the worker lost (no heartbeat for 17.5 s, lease 15 s). Between two calls other threads
run."""


def new_arena(nbytes: int) -> np.ndarray:
    """A receive arena with every page already in place: a worker's, a fetch's, a holder's.

    The first write to each fresh page costs a fault and a zeroing (about 0.5 ms per MiB on a
    small VM); done here, before the stream is asked for, that cost is not paid between two
    chunks of the stream, where it held one gRPC stream to a third of its rate. The peers'
    buffers (``collective bench --peers``) are warm too.

    Huge pages first, a segment at a time: 0.012 s per 256 MiB where the memory is warm, and a
    socket writes into them about 10 % faster than into 4 KiB pages. On a VM whose host has not
    backed that memory yet they cost 0.4-1.1 s per 256-512 MiB (the host's first touch, not
    compaction: the kernel counted no compaction stall); a segment that slow (``SEGMENT_SLOW``)
    turns the rest of the arena to 4 KiB pages populated by the kernel, ``POPULATE_STEP`` a call
    (``MADV_POPULATE_WRITE``: 0.08-0.19 s per 256 MiB, every time). So the arena costs about the
    faster of the two, plus at most one slow segment.
    """
    arena = lazy_arena(nbytes)
    warm(arena, 0, nbytes)
    return arena


def lazy_arena(nbytes: int) -> np.ndarray:
    """A receive arena whose pages are not in place yet: memory is committed only as parts of
    it are written or put in place (``warm``). A fetch's: a peer's claimed size commits nothing
    before its bytes are asked for."""
    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux
        return np.empty(nbytes, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8)


def warm(arena: np.ndarray, start: int, end: int) -> None:
    """Put the pages of bytes ``start..end`` of a ``lazy_arena`` in place (as ``new_arena`` does
    for a whole one), before a stream writes them. Writes only bytes of that range (those not
    received yet), so other ranges may be received meanwhile."""
    base = arena.base.obj if isinstance(arena.base, memoryview) else arena.base  # np.frombuffer's
    region = base if isinstance(base, mmap.mmap) else None
    if region is None:  # not Linux: one write per page
        arena[start:end:PAGE] = 0
        return
    for at in range(start, end, SEGMENT):
        began = time.thread_time()
        arena[at : min(at + SEGMENT, end) : PAGE] = 0
        rest = (at + SEGMENT) // PAGE * PAGE  # madvise takes whole pages
        if rest < end and time.thread_time() - began > SEGMENT_SLOW:
            region.madvise(mmap.MADV_NOHUGEPAGE, rest, end - rest)
            for step in range(rest, end, POPULATE_STEP):  # one call holds the GIL: a step at a time
                length = min(POPULATE_STEP, end - step)
                try:
                    region.madvise(_MADV_POPULATE_WRITE, step, length)
                except OSError:  # a kernel before 5.14: one write per page
                    arena[step : step + length : PAGE] = 0
            break
