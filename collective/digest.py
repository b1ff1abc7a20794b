"""xxh3-128 digests of variables and workers.

A variable's digest is the xxh3-128 hex digest of its C-contiguous bytes, so anyone can
recompute it with ``xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).tobytes())``. A worker's
digest covers all its replicas: xxh3-128 over each replica's name and digest in order, each field
prefixed with its length (8 bytes, little-endian), so two workers agree only if they hold the
same replicas with the same bytes, whatever characters the names contain.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash


def array_digest(a: np.ndarray) -> str:
    """Hex xxh3-128 of the array's C-contiguous bytes (no copy when already contiguous)."""
    c = np.ascontiguousarray(a)
    return xxhash.xxh3_128_hexdigest(memoryview(c.reshape(-1).view(np.uint8)) if c.size else b"")


def bytes_digest(data) -> str:
    """Hex xxh3-128 of a bytes-like object."""
    return xxhash.xxh3_128_hexdigest(data)


def combined_digest(named: Iterable[tuple[str, str]]) -> str:
    """Digest of an ordered list of (name, digest) pairs: a worker's or a manifest's digest."""
    h = xxhash.xxh3_128()
    for name, digest in named:
        for field in (name.encode(), digest.encode()):
            h.update(len(field).to_bytes(8, "little"))
            h.update(field)
    return h.hexdigest()
