"""Arenas, in one place: the bytes a plan's stream is cut from or lands in.

- ``Arena``: what a ``Chunker`` reads, a size and the bytes of a range (``slice``). A flat array
  is one (``Flat``, ``as_arena``); so is ``ScatterView``, an arena whose bytes lie elsewhere in
  pieces (a shard's rows in the whole model's arena, a holder's state in the caller's arrays).
- One allocator for receive arenas (a worker's, a fetch's, a holder's copy): ``new_arena``
  (every page in place first) or ``lazy_arena`` + ``warm`` (a range at a time), and one routine
  that puts pages in place, ``populate``, which the memfd arena uses too.
- ``SharedArena``: an arena in a memfd (the chief's, a host leader's, a holder's copy), sealed
  once complete; ``transport.shm`` hands it to same-host peers.
"""

from __future__ import annotations

import bisect
import mmap
import os
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

PAGE = 4096
SEGMENT = 8 << 20
"""``populate`` puts huge pages in place this many bytes at a time."""
SEGMENT_SLOW = 0.005
"""CPU seconds of one segment's huge pages beyond which the rest of the range takes small pages
populated by the kernel (``POPULATE_STEP`` bytes a call). On a 2-core VM 32 MiB take 1.5-2.5 ms
of huge pages where the memory is warm, 75-100 ms where its host touches it first, and 10-11 ms
of small pages either way (40 ms at worst): per 8 MiB segment, under 0.7 ms, about 20 ms and
under 3 ms. The thread's CPU time, not the clock: a thread preempted meanwhile is not slow
memory (the host's first touch stalls the virtual CPU, so it counts)."""
_MADV_POPULATE_WRITE = 23  # madvise(2), Linux 5.14; Python 3.11's mmap has no name for it
POPULATE_STEP = 64 << 20
"""``populate`` has the kernel populate small pages this many bytes a call. ``mmap.madvise``
holds the GIL for a whole call: one call for the rest of a 4 GiB arena held it 37.7 s beside
three CPU-bound processes, the worker's heartbeat thread never ran meanwhile, and the chief
declared the worker lost (no heartbeat for 17.5 s, lease 15 s). So the call goes through ctypes,
which lets go of the GIL (``_madvise``): a stream received in another thread runs beside it (a
fetch populates the next stripe while this one streams); where ctypes cannot, ``mmap.madvise``
a step at a time, other threads running between two calls."""


class Arena(Protocol):
    """What a stream is cut from: ``nbytes``, and the bytes ``start..end`` (a view where they
    lie in one piece; a buffer of their own, at most one chunk, where they do not)."""

    nbytes: int

    def slice(self, start: int, end: int) -> memoryview: ...


class Flat:
    """A flat array as an ``Arena``: every slice a view of it."""

    def __init__(self, array: np.ndarray) -> None:
        self._flat = memoryview(array.reshape(-1).view(np.uint8))
        self.nbytes = self._flat.nbytes

    def slice(self, start: int, end: int) -> memoryview:
        return self._flat[start:end]


def as_arena(arena: Arena | np.ndarray) -> Arena:
    """``arena`` as an ``Arena``: an array becomes a ``Flat`` one."""
    return Flat(arena) if isinstance(arena, np.ndarray) else arena


class ScatterView:
    """An arena without a copy: each piece's bytes where they lie, at its offset here; the bytes
    between pieces read as zeros (a layout's padding). A shard's rows in the whole model's arena
    (``within``), a holder's state in the caller's arrays. ``slice`` is a view of one piece when
    the range lies in it, else the range gathered into a buffer of its own (at most one chunk).

    ``origins``: where each piece lies in the array it comes from (``sources``, ``segments``)."""

    def __init__(self, pieces: Sequence[tuple[int, np.ndarray]], nbytes: int, *,
                 origins: Sequence[int] | None = None) -> None:
        kept = [(off, a.reshape(-1).view(np.uint8), origins[i] if origins is not None else 0)
                for i, (off, a) in enumerate(pieces) if a.nbytes]  # in offset order, without overlaps
        self._parts = [(off, flat) for off, flat, _ in kept]
        self._origins = [o for _, _, o in kept]
        self._starts = [off for off, _, _ in kept]
        self.nbytes = nbytes
        self.segments = [(off, o, flat.size) for off, flat, o in kept] if origins is not None else []
        """(offset here, offset in the source array, bytes) per piece, given ``origins``."""

    @classmethod
    def within(cls, flat: np.ndarray, segments: Sequence[tuple[int, int, int]], nbytes: int) -> ScatterView:
        """The pieces of one array: ``segments`` (offset here, offset in ``flat``, bytes)."""
        return cls([(lo, flat[src : src + n]) for lo, src, n in segments], nbytes,
                   origins=[src for _, src, _ in segments])

    def _overlapping(self, start: int, end: int):
        """(start, end, piece index) of each piece's part of ``start..end``."""
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        for j in range(i, len(self._parts)):
            off, flat = self._parts[j]
            if off >= end:
                break
            a, b = max(start, off), min(end, off + flat.size)
            if a < b:
                yield a, b, j

    def _view(self, a: int, b: int, j: int) -> np.ndarray:
        off, flat = self._parts[j]
        return flat[a - off : b - off]

    def slice(self, start: int, end: int) -> memoryview:
        parts = list(self._overlapping(start, end))
        if len(parts) == 1 and parts[0][:2] == (start, end):
            return memoryview(self._view(*parts[0]))
        return memoryview(self._gather(start, end, parts))

    def _gather(self, start: int, end: int, parts) -> np.ndarray:
        out = np.zeros(end - start, dtype=np.uint8)
        for a, b, j in parts:
            out[a - start : b - start] = self._view(a, b, j)
        return out

    def sources(self, start: int, end: int) -> list[tuple[int, int]]:
        """The source array's ranges that bytes ``start..end`` come from (given ``origins``)."""
        return [(self._origins[j] + a - self._starts[j], self._origins[j] + b - self._starts[j])
                for a, b, j in self._overlapping(start, end)]

    def copy(self) -> np.ndarray:
        """The whole arena, copied out once."""
        return self._gather(0, self.nbytes, self._overlapping(0, self.nbytes))


def _libc_madvise():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.madvise, ctypes.get_errno
    except (OSError, AttributeError):  # no libc madvise here: mmap.madvise instead
        return None


_LIBC_MADVISE = _libc_madvise() if hasattr(mmap, "MADV_HUGEPAGE") else None


def _madvise(region: mmap.mmap, array: np.ndarray, start: int, length: int, advice: int) -> None:
    """``region.madvise(advice, start, length)`` (``array`` a view of all of it), the GIL let go
    meanwhile where ctypes reaches libc's ``madvise``; OSError as ``mmap.madvise`` raises it."""
    if _LIBC_MADVISE is None:
        region.madvise(advice, start, length)
        return
    call, errno = _LIBC_MADVISE
    if call(array.ctypes.data + start, length, advice) != 0:
        code = errno()
        raise OSError(code, os.strerror(code))


def populate(region: mmap.mmap | None, array: np.ndarray, start: int, end: int) -> None:
    """Put the pages of bytes ``start..end`` of ``array`` (a view of all of ``region``) in place
    before a stream writes them. Writes only bytes of that range (those not received yet), so
    other ranges may be received meanwhile. Without ``region`` (not Linux): one write per page.

    A segment (``SEGMENT``) at a time, one write per page: huge pages where the mapping asked
    for them (``lazy_arena``), 0.012 s per 256 MiB where the memory is warm, and a socket writes
    into them about 10 % faster than into 4 KiB pages. On a VM whose host has not backed that
    memory yet they cost 0.4-1.1 s per 256-512 MiB (the host's first touch); a segment that slow
    (``SEGMENT_SLOW``) turns the rest of the range to 4 KiB pages populated by the kernel,
    ``POPULATE_STEP`` a call (``MADV_POPULATE_WRITE``: 0.08-0.19 s per 256 MiB, every time; one
    write per page before Linux 5.14). So it costs about the faster of the two, plus at most one
    slow segment. A memfd (``SharedArena``) has small pages either way.

    The faster of the ways measured on the broadcast and the fetch (BENCHMARKS.md, "Putting an
    arena's pages in place"; ``python -m collective.bench.prefault``): on its own, 1 GiB in
    0.34-0.37 s for it, populating alone and ``MAP_POPULATE`` on a quiet machine, 0.80 s against
    0.97 s and 1.09 s under load; a broadcast receives into its huge pages faster."""
    if region is None:
        array[start:end:PAGE] = 0
        return
    for at in range(start, end, SEGMENT):
        began = time.thread_time()
        array[at : min(at + SEGMENT, end) : PAGE] = 0
        rest = (at + SEGMENT) // PAGE * PAGE  # madvise takes whole pages
        if rest < end and time.thread_time() - began > SEGMENT_SLOW:
            region.madvise(mmap.MADV_NOHUGEPAGE, rest, end - rest)
            for step in range(rest, end, POPULATE_STEP):  # one call holds the GIL: a step at a time
                length = min(POPULATE_STEP, end - step)
                try:
                    _madvise(region, array, step, length, _MADV_POPULATE_WRITE)
                except OSError:  # a kernel before 5.14: one write per page
                    array[step : step + length : PAGE] = 0
            break


def new_arena(nbytes: int) -> np.ndarray:
    """A receive arena with every page already in place (``populate``): a worker's, a fetch's, a
    holder's. The first write to each fresh page costs a fault and a zeroing; done here, before
    the stream is asked for, that cost is not paid between two chunks of the stream."""
    arena = lazy_arena(nbytes)
    warm(arena, 0, nbytes)
    return arena


def lazy_arena(nbytes: int) -> np.ndarray:
    """A receive arena whose pages are not in place yet: memory is committed only as parts of
    it are written or put in place (``warm``). A fetch's: a peer's claimed size commits nothing
    before its bytes are asked for. Huge pages asked for (``populate`` turns from them where
    they are slow)."""
    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux
        return np.empty(nbytes, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8)


def warm(arena: np.ndarray, start: int, end: int) -> None:
    """Put the pages of bytes ``start..end`` of a ``lazy_arena`` in place (``populate``), before
    a stream writes them."""
    base = arena.base.obj if isinstance(arena.base, memoryview) else arena.base  # np.frombuffer's
    populate(base if isinstance(base, mmap.mmap) else None, arena, start, end)


class SharedArena:
    """An arena in a memfd: the chief's, a host leader's (a worker that receives from the
    network and serves its same-host peers), a holder's copy. ``array`` is writable until
    ``seal()``; ``transport.shm.ShmServer`` hands the descriptor out."""

    def __init__(self, size: int, *, prefault: bool = False) -> None:
        """``prefault``: every page in place now (``populate``, as for a receive arena), not
        between two chunks of the stream."""
        self.size = size
        self.fd = os.memfd_create("collective-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, max(size, 1))
        self._map = mmap.mmap(self.fd, max(size, 1))
        self.array = np.frombuffer(self._map, dtype=np.uint8)[:size]
        if prefault:
            populate(self._map, self.array, 0, size)

    def reader(self) -> np.ndarray:
        """A read-only view that sees every write through ``array`` at once and does not keep the
        segment from being sealed (a relay serves from it).

        Private, not shared: before Linux 6.7 any shared mapping of a writable file counts as a
        writable one and the seal fails (EBUSY). A private mapping that is never written maps the
        file's own pages, which exist from the start (``prefault``), so it sees every write.
        """
        mm = mmap.mmap(self.fd, max(self.size, 1), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        return np.frombuffer(mm, dtype=np.uint8)[: self.size]

    def private(self) -> np.ndarray:
        """A copy-on-write mapping, as a peer maps it: writes to it stay in this process."""
        return map_private(self.fd, self.size)

    def seal(self) -> None:
        """Make the segment read-only for everyone, this process included (F_SEAL_WRITE).

        Writable shared mappings forbid the seal, so ours is replaced by a read-only one. Raises
        BufferError while a view of ``array`` is still held elsewhere.
        """
        data = self.array
        del data
        self.array = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            import gc

            gc.collect()  # a view kept alive only by a reference cycle
            try:
                self._map.close()
            except BufferError:
                self.array = np.frombuffer(self._map, dtype=np.uint8)[: self.size]
                raise
        import fcntl

        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _seals())
        self._map = mmap.mmap(self.fd, max(self.size, 1), prot=mmap.PROT_READ)
        self.array = np.frombuffer(self._map, dtype=np.uint8)[: self.size]

    def handout(self) -> tuple[bytes, list[int]]:
        """What a member receives: ``ok`` and the descriptor (``MappedFiles`` hands out files)."""
        return b"ok", [self.fd]

    def close(self) -> None:
        os.close(self.fd)


def _seals() -> int:
    """What ``seal`` adds: write, shrink, grow and the seals themselves (Linux's names)."""
    import fcntl

    return fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def map_private(fd: int, size: int) -> np.ndarray:
    """``size`` bytes of ``fd`` mapped copy-on-write: this process's writes stay its own."""
    mm = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(mm, dtype=np.uint8)[:size]
