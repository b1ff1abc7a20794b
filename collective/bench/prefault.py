"""The ways of putting an arena's pages in place, timed on this machine (issue 37, step 1).

``python -m collective.bench.prefault [SIZE] [RUNS]`` (default 1GiB, 5): for an anonymous private
mapping (a worker's, a fetch's, a holder's receive arena) and a memfd mapped shared (the chief's
or a host leader's arena), a fresh mapping each run:

- ``touch``: one write per 4 KiB page from Python (numpy, a strided store);
- ``map-populate``: ``mmap(MAP_POPULATE)``, the kernel faults every page in inside the call;
- ``populate-write``: ``madvise(MADV_POPULATE_WRITE)`` 64 MiB a call (``arena.POPULATE_STEP``);
- ``huge-first`` (anonymous only): ``arena.populate``, the one kept (as ``new_arena``): a huge-page
  hint and a write per page 8 MiB at a time, turning to ``populate-write`` when a segment is slow.

Prints the median and range of seconds and GiB/s per way; the mapping's own creation is inside
the clock (``MAP_POPULATE`` does its work there). No process is started.
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time

import numpy as np

from collective.arena import populate
from collective.sizes import parse_size

PAGE = 4096
STEP = 64 << 20
_MADV_POPULATE_WRITE = 23


def _anon(n: int, extra: int = 0) -> mmap.mmap:
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | extra)


def _memfd(n: int, extra: int = 0) -> mmap.mmap:
    fd = os.memfd_create("prefault-bench", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, n)
        return mmap.mmap(fd, n, flags=mmap.MAP_SHARED | extra)
    finally:
        os.close(fd)


def touch(make, n: int) -> mmap.mmap:
    region = make(n)
    np.frombuffer(region, np.uint8)[::PAGE] = 0
    return region


def map_populate(make, n: int) -> mmap.mmap:
    return make(n, mmap.MAP_POPULATE)


def populate_write(make, n: int) -> mmap.mmap:
    region = make(n)
    for at in range(0, n, STEP):
        region.madvise(_MADV_POPULATE_WRITE, at, min(STEP, n - at))
    return region


def huge_first(make, n: int) -> mmap.mmap:
    region = make(n)
    region.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(region, np.uint8)
    populate(region, array, 0, n)
    del array
    return region


def main(argv: list[str]) -> None:
    size = parse_size(argv[0]) if argv else 1 << 30
    runs = int(argv[1]) if len(argv) > 1 else 5
    ways = {"touch": touch, "map-populate": map_populate, "populate-write": populate_write,
            "huge-first": huge_first}
    print(f"{'mapping':<10} {'way':<15} {'median s':>9} {'min-max s':>15} {'GiB/s':>6}")
    for kind, make in (("anonymous", _anon), ("memfd", _memfd)):
        for name, way in ways.items():
            if kind == "memfd" and name == "huge-first":
                continue
            times = []
            for _ in range(runs):
                began = time.perf_counter()
                region = way(make, size)
                times.append(time.perf_counter() - began)
                region.close()
            med = statistics.median(times)
            print(f"{kind:<10} {name:<15} {med:9.3f} {min(times):7.3f}-{max(times):<7.3f} {size / med / 2**30:6.2f}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
