"""Model files mapped read-only, their data sections end to end in one address range.

A ``.safetensors`` file (or each shard of a checkpoint) is mapped private and read-only
(``MAP_PRIVATE``, ``PROT_READ``) from the page holding the start of its data section, each file
at the next free page of one reserved range, so the mapped bytes are one flat, read-only numpy
array: the chief's arena, served without a copy in the chief's memory (the pages are the page
cache's). A tensor's offset in that arena keeps its offset in its file modulo the page size, so a
tensor aligned in its file is aligned in every arena laid out the same way. The bytes between two
files' tensors (the end of one file's last page, the next file's header) are padding, sent and
hashed like any other.

``check()`` compares every file with what was mapped (size, modification time): a file written
to while it is served changes the mapped bytes under the digests, and a file cut short makes the
pages past its end fault (SIGBUS) when read, so the chief calls it before it reads or sends.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from collective.errors import ModelError

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


@dataclass(frozen=True)
class DataFile:
    """A file whose bytes from ``data_start`` to its end are the values (a safetensors data section)."""

    path: Path
    label: str
    data_start: int


@dataclass(frozen=True)
class _Stamp:
    size: int
    mtime_ns: int
    inode: int


def _stamp(st: os.stat_result) -> _Stamp:
    return _Stamp(st.st_size, st.st_mtime_ns, st.st_ino)


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class MappedFiles:
    """The data sections of ``files`` mapped read-only, end to end: ``array`` (flat uint8, read
    only) and ``starts`` (where each file's data section begins in it). Raises ModelError naming
    the file when one cannot be opened or mapped."""

    def __init__(self, files: Sequence[DataFile]) -> None:
        self.files = list(files)
        self._fds: list[int] = []
        self._stamps: list[_Stamp] = []
        places, pos = [], 0
        try:
            for f in self.files:
                fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC)
                self._fds.append(fd)
                stamp = _stamp(os.fstat(fd))
                self._stamps.append(stamp)
                if stamp.size < f.data_start:
                    raise ModelError(f"{f.label}: {stamp.size} bytes is shorter than its header (truncated?)")
                first = f.data_start // PAGE * PAGE if places else 0  # the first file from byte 0
                pos = _round_up(pos)
                places.append((pos, first, stamp.size - first))
                pos += stamp.size - first
        except OSError as exc:
            self._close_fds()
            raise ModelError(f"{f.label}: cannot open: {exc.strerror or exc}") from exc
        except ModelError:
            self._close_fds()
            raise
        self.nbytes = pos
        self.places = places
        self.starts = [at + f.data_start - first for f, (at, first, _) in zip(self.files, places, strict=True)]
        try:
            self.array = map_end_to_end(self._fds, places, pos, close=list(self._fds))
        except OSError as exc:
            self._close_fds()
            raise ModelError(f"{self.files[0].label}: cannot map the model's files: {exc}") from exc

    def handout(self) -> tuple[bytes, list[int]]:
        """What a same-host member receives to map the arena itself (``transport/shm.py``): one
        file from its first byte is mapped like the chief's memfd (``ok``); several come with
        where each goes (``ok {"maps": [[at, first, length], ...]}``, for ``map_end_to_end``)."""
        if len(self.files) == 1:
            return b"ok", list(self._fds)
        return b"ok " + json.dumps({"maps": self.places}).encode(), list(self._fds)

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def check(self, start: int = 0, end: int | None = None) -> None:
        """Raise ModelError naming the first file that changed since it was mapped; only the files
        with bytes in ``start..end`` of the arena (default: every file)."""
        end = self.nbytes if end is None else end
        first = max(0, bisect.bisect_right([at for at, _, _ in self.places], start) - 1)
        for i in range(first, len(self.files)):
            at = self.places[i][0]
            if at >= end and i > first:
                break
            f, fd, was = self.files[i], self._fds[i], self._stamps[i]
            now = _stamp(os.fstat(fd))
            if now != was:
                what = (f"cut from {was.size} to {now.size} bytes" if now.size < was.size
                        else f"was {was.size} bytes modified at mtime_ns {was.mtime_ns}, now {now.size} at {now.mtime_ns}")
                raise ModelError(
                    f"{f.label}: changed while being served ({what}); the chief serves the file itself, "
                    f"so serve a file nothing writes to, or a copy of it"
                )

    def drop(self, start: int, end: int) -> None:
        """Unmap the pages wholly inside ``start..end`` from this process (the page cache keeps
        them; the next read maps them again), so reading a large file leaves no resident set."""
        lo, hi = _round_up(start), end // PAGE * PAGE
        if hi > lo:
            _libc.madvise(self.array.ctypes.data + lo, hi - lo, _MADV_DONTNEED)


def map_end_to_end(fds: Sequence[int], places: Sequence[Sequence[int]], total: int, *, writable: bool = False,
                   close: Sequence[int] = ()) -> np.ndarray:
    """Files mapped private, end to end in one reserved range: ``places[i]`` = (where in the
    range, from which page of file ``fds[i]``, how many bytes). A flat uint8 array of ``total``
    bytes, read-only unless ``writable`` (copy-on-write: writes never reach the files). The range
    is unmapped, and the descriptors in ``close`` closed, once nothing refers to the array.
    Raises OSError when the range cannot be reserved or a file mapped."""
    size = max(_round_up(total), PAGE)
    base = _libc.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"cannot reserve {size} bytes of address space")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    for fd, (at, first, length) in zip(fds, places, strict=True):
        if length and _libc.mmap(base + at, length, prot, mmap.MAP_PRIVATE | _MAP_FIXED, fd, first) != base + at:
            errno = ctypes.get_errno()
            _libc.munmap(base, size)
            raise OSError(errno, f"cannot map {length} bytes of a file")
    buffer = (ctypes.c_uint8 * size).from_address(base)
    weakref.finalize(buffer, _release, base, size, list(close))
    array = np.frombuffer(buffer, dtype=np.uint8, count=total)
    array.flags.writeable = writable
    return array


def _release(base: int, size: int, fds: list[int]) -> None:
    _libc.munmap(base, size)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
