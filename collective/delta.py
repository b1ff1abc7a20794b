"""Element-level deltas of one tensor: made, coded, parsed, applied in place, verified.

The building block of versioned updates (a step's delta from the step before): the publisher
and subscriber that send and receive them come later and build on this module alone. Pure
numpy and xxh3; no transport.

Elements are compared as raw bytes of their width (a bf16 array, its uint16 view or ml_dtypes'
bfloat16, float32: the unsigned integer of the item size), so NaN payloads and -0.0 travel
exactly. A tensor whose bytes did not change costs a 16-byte header; a changed one goes as its
changed elements (positions coded as gaps, plus the new values) when that is smaller than the
tensor, else whole.

Wire form of one tensor's delta (little-endian, never pickled)::

    0   4  magic b"CDL1"
    4   1  kind: 0 same (nothing follows), 1 elements, 2 whole
    5   1  item size w: 1, 2, 4, 8 or 16 bytes
    6   2  zero
    8   8  n: elements in the tensor
    kind 2: n * w bytes, the new tensor
    kind 1:
    16  8  k: changed elements, 1..n
    24  1  gap coding: 1, 2, 4 or 8 (every gap that many bytes), 0 (one byte a gap, 0 = escaped)
    25  1  escaped gaps' width: 2, 4 or 8 with coding 0, else 0
    26  6  zero
    32  8  e: escaped gaps (coding 0), else 0
    40     k * w bytes: the new values, in position order
           k gaps: position[i] - position[i-1], position[-1] = -1, so every gap is >= 1
           (coding 0: one byte each, 0 where the gap is the next escaped one)
           e * escaped width bytes: the escaped gaps, in order

A parser refuses (``ProtocolError``, one line) anything that is not exactly that: a wrong
magic, kind or width, a tensor size or width other than the target's, a count past the tensor's
size, a gap of 0 (a repeated position) or past the end, a buffer of any length but the declared
one. It checks everything before ``apply_delta`` writes a byte (the last position is the gaps'
sum: no decoding), and no step holds more than ``BLOCK`` decoded positions at a time (a 1 GB
position list for a small tensor is refused from its header, before any allocation; a writable
buffer's gaps are copied once, so the positions checked are the ones applied).

Verifying after applying: ``touched_chunks`` gives the arena chunks a delta wrote (from its
positions, no pass over the state) and ``chunk_digests_at`` their digests over the arrays where
the caller holds them, laid out as ``plan.layout`` lays out a published state (the padding
reads as zeros): the same digests as ``digest.chunk_digests`` of the arena.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from collective.errors import ProtocolError, UsageError
from collective.plan import layout

MAGIC = b"CDL1"
SAME, ELEMENTS, WHOLE = 0, 1, 2
WIDTHS = (1, 2, 4, 8, 16)
GAP_WIDTHS = (1, 2, 4, 8)
BLOCK = 1 << 20  # positions decoded, checked and written at a time: bounds the parser's memory
_HEAD = struct.Struct("<4sBBHQ")  # magic, kind, width, zero, n
_ELEMS = struct.Struct("<QBB6sQ")  # k, gap coding, escaped width, zero, e
_UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


@dataclass(frozen=True, eq=False)
class Delta:
    """One tensor's delta. Make one with ``make_delta`` or ``parse_delta``, not by hand.

    ``kind`` is SAME, ELEMENTS or WHOLE; ``itemsize`` and ``size`` describe the tensor;
    ``values`` the new elements (WHOLE: all of them) as unsigned integers of the item size (16-byte
    items: rows of two uint64). ``nbytes`` is the length of ``to_bytes()``."""

    kind: int
    itemsize: int
    size: int
    values: np.ndarray
    gaps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # ELEMENTS: as coded
    escaped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))  # coding 0's escaped gaps
    count: int = 0
    coding: int = 0  # ELEMENTS: the gap coding byte

    @property
    def nbytes(self) -> int:
        if self.kind == ELEMENTS:
            return _HEAD.size + _ELEMS.size + self.values.nbytes + self.gaps.nbytes + self.escaped.nbytes
        return _HEAD.size + (self.values.nbytes if self.kind == WHOLE else 0)

    def to_bytes(self) -> bytes:
        """The wire form (module docstring)."""
        head = _HEAD.pack(MAGIC, self.kind, self.itemsize, 0, self.size)
        if self.kind == SAME:
            return head
        if self.kind == WHOLE:
            return head + self.values.tobytes()
        escaped_width = self.escaped.dtype.itemsize if self.coding == 0 else 0
        elems = _ELEMS.pack(self.count, self.coding, escaped_width, bytes(6), self.escaped.size)
        return b"".join((head, elems, self.values.tobytes(), self.gaps.tobytes(), self.escaped.tobytes()))

    def blocks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(positions, values) of the changed elements, at most ``BLOCK`` at a time, in order
        (ELEMENTS only). A parsed delta's were checked by ``parse_delta``."""
        carry, taken = -1, 0
        for lo in range(0, self.count, BLOCK):
            gaps = self.gaps[lo : lo + BLOCK].astype(np.int64)
            if self.escaped.size:
                where = np.flatnonzero(gaps == 0)
                gaps[where] = self.escaped[taken : taken + where.size]
                taken += where.size
            positions = np.cumsum(gaps)
            positions += carry
            carry = int(positions[-1])
            yield positions, self.values[lo : lo + BLOCK]


def _units(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as unsigned integers of their width, flat, without a copy when ``a`` is
    C-contiguous: 16-byte items as rows of two uint64."""
    a = np.ascontiguousarray(a)
    w = a.dtype.itemsize
    if w not in WIDTHS:
        raise UsageError(f"a delta takes elements of 1, 2, 4, 8 or 16 bytes, not {a.dtype} ({w} bytes)")
    flat = a.reshape(-1)
    return flat.view(np.uint64).reshape(-1, 2) if w == 16 else flat.view(_UINT[w])


def _scan(a: np.ndarray, b: np.ndarray, limit: int) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(k, gaps, values) of the elements of units ``b`` whose bytes differ from ``a``'s, ``BLOCK``
    elements compared at a time (no full-size temporary): gaps from position -1 (uint32 when
    they fit, else int64), the new values in order. None as soon as more than ``limit`` differ
    (the tensor goes whole: the rest is not compared)."""
    n = a.shape[0]
    gap_dtype = np.uint32 if n < 1 << 32 else np.int64
    gaps, values, k, last = [], [], 0, -1
    mask = np.empty(min(BLOCK, n), dtype=bool)
    for lo in range(0, n, BLOCK):
        x, y = a[lo : lo + BLOCK], b[lo : lo + BLOCK]
        m = mask[: x.shape[0]]
        if x.ndim == 2:  # 16-byte elements: rows of two uint64
            m[:] = (x != y).any(axis=1)
        else:
            np.not_equal(x, y, out=m)
        idx = np.flatnonzero(m)
        if not idx.size:
            continue
        k += idx.size
        if k > limit:
            return None
        values.append(y[idx])
        gaps.append(np.diff(idx, prepend=last - lo).astype(gap_dtype))
        last = lo + int(idx[-1])
    if not k:
        return 0, np.zeros(0, gap_dtype), b[:0]
    return k, np.concatenate(gaps), np.concatenate(values)


def _smallest(maximum: int) -> np.dtype:
    return next(_UINT[w] for w in GAP_WIDTHS if maximum < 1 << (8 * w))


def _code_gaps(gaps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The smaller coding of ``gaps`` (all >= 1): the smallest fixed width that holds the largest,
    or one byte each with the larger ones escaped (0) into a list of their own width."""
    fixed = _smallest(int(gaps.max()))
    big = gaps > 255
    n_big = int(np.count_nonzero(big))
    if fixed.itemsize == 1 or n_big == 0:
        return gaps.astype(fixed), np.zeros(0, np.uint8)
    escaped = gaps[big]
    esc_dtype = _UINT[max(2, _smallest(int(escaped.max())).itemsize)]
    if gaps.size + n_big * esc_dtype.itemsize >= gaps.size * fixed.itemsize:
        return gaps.astype(fixed), np.zeros(0, np.uint8)
    small = gaps.astype(np.uint8)  # wraps the big ones: overwritten next
    small[big] = 0
    return small, escaped.astype(esc_dtype)


def make_delta(base: np.ndarray, new: np.ndarray) -> Delta:
    """The delta that turns ``base`` into ``new`` (same shape and dtype), bit for bit: SAME when
    no element's bytes differ, ELEMENTS when the changed ones cost fewer bytes than the tensor,
    WHOLE otherwise. Neither array is changed; ``values`` may be views of ``new``."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise UsageError(f"a delta needs arrays of one shape and dtype, not {base.shape} {base.dtype} "
                         f"and {new.shape} {new.dtype}")
    units = _units(new)
    w, n = new.dtype.itemsize, int(new.size)
    # Past ``limit`` changes even one-byte gaps cannot beat the whole tensor: stop comparing.
    scan = _scan(_units(base), units, limit=(n * w - _ELEMS.size) // (w + 1))
    if scan is not None:
        k, gaps, values = scan
        if k == 0:
            return Delta(SAME, w, n, units[:0])
        coded, escaped = _code_gaps(gaps)
        if k * w + coded.nbytes + escaped.nbytes + _ELEMS.size < n * w:
            coding = 0 if escaped.size else coded.dtype.itemsize
            return Delta(ELEMENTS, w, n, values, coded, escaped, k, coding)
    return Delta(WHOLE, w, n, units)


def _refuse(what: str, name: str) -> ProtocolError:
    return ProtocolError(f"delta of {name}: {what}; refused, nothing written")


def parse_delta(data, *, size: int, itemsize: int, name: str = "tensor") -> Delta:
    """Read and check a delta's wire form for a tensor of ``size`` elements of ``itemsize``
    bytes (the receiver's, never the sender's word). Raises ``ProtocolError`` naming ``name``
    when anything is off. The values returned are views of ``data``; so are the gaps when
    ``data`` is read-only (``bytes``), else they are copied, so what was checked is what
    ``apply_delta`` writes by, whoever writes to ``data`` after."""
    buf = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data.reshape(-1).view(np.uint8))
    if len(buf) < _HEAD.size:
        raise _refuse(f"{len(buf)} bytes is shorter than its {_HEAD.size}-byte header", name)
    magic, kind, w, zero, n = _HEAD.unpack_from(buf)
    if magic != MAGIC or zero:
        raise _refuse("not a delta (bad magic or header)", name)
    if w != itemsize:
        raise _refuse(f"its elements are {w} bytes wide, the target's {itemsize}", name)
    if n != size:
        raise _refuse(f"it is for {n} elements, the target has {size}", name)
    if w not in WIDTHS:
        raise UsageError(f"a delta takes elements of 1, 2, 4, 8 or 16 bytes, not {w}")
    units = np.dtype(np.uint64) if w == 16 else _UINT[w]

    def values(offset: int, count: int) -> np.ndarray:
        v = np.frombuffer(buf, dtype=units, count=count * (2 if w == 16 else 1), offset=offset)
        return v.reshape(-1, 2) if w == 16 else v

    if kind == SAME:
        _exact(buf, _HEAD.size, name)
        return Delta(SAME, w, n, values(0, 0))
    if kind == WHOLE:
        _exact(buf, _HEAD.size + n * w, name)
        return Delta(WHOLE, w, n, values(_HEAD.size, n))
    if kind != ELEMENTS:
        raise _refuse(f"unknown kind {kind}", name)
    if len(buf) < _HEAD.size + _ELEMS.size:
        raise _refuse(f"{len(buf)} bytes is shorter than its header", name)
    k, coding, esc_w, zero6, e = _ELEMS.unpack_from(buf, _HEAD.size)
    if zero6 != bytes(6) or coding not in (0, *GAP_WIDTHS) or esc_w not in ((2, 4, 8) if coding == 0 else (0,)):
        raise _refuse(f"bad gap coding {coding} (escaped width {esc_w})", name)
    if not 0 < k <= n:
        raise _refuse(f"{k} changed elements of a tensor of {n}", name)
    if e > (k if coding == 0 else 0):
        raise _refuse(f"{e} escaped gaps for {k} positions", name)
    gap_bytes = k * (coding or 1)
    start = _HEAD.size + _ELEMS.size
    _exact(buf, start + k * w + gap_bytes + e * esc_w, name)
    gaps = np.frombuffer(buf, dtype=_UINT[coding or 1], count=k, offset=start + k * w)
    escaped = (np.frombuffer(buf, dtype=_UINT[esc_w], count=e, offset=start + k * w + gap_bytes)
               if coding == 0 else np.zeros(0, np.uint8))
    if not buf.readonly:  # the positions checked must be the ones applied: a copy nobody else writes
        gaps, escaped = gaps.copy(), escaped.copy()
    delta = Delta(ELEMENTS, w, n, values(start, k), gaps, escaped, k, coding)
    _check_positions(delta, name)
    return delta


def _exact(buf: memoryview, expected: int, name: str) -> None:
    if len(buf) != expected:
        raise _refuse(f"{len(buf)} bytes where its header declares {expected}", name)


def _check_positions(delta: Delta, name: str) -> None:
    """Every gap >= 1 and the last position inside the tensor: positions strictly increase, so
    none repeats or lies outside."""
    n, gaps, escaped = delta.size, delta.gaps, delta.escaped
    zeros = delta.count - int(np.count_nonzero(gaps))  # no temporary of the gaps' size
    if delta.coding == 0 and zeros != escaped.size:
        raise _refuse(f"{escaped.size} escaped gaps declared, {zeros} escapes found", name)
    if (delta.coding and zeros) or (escaped.size and not escaped.all()):
        raise _refuse("a gap of 0 (a position repeated or out of order)", name)
    # Each gap <= n, so no block's sum wraps (n < 2**63 / BLOCK) and blocks() cannot either.
    if int(gaps.max()) > n or (escaped.size and int(escaped.max()) > n) or n >= (1 << 63) // BLOCK:
        raise _refuse(f"a position past the tensor's end ({n} elements)", name)
    # The last position is the sum of the gaps - 1 (escapes add 0 where they stand): a sum a
    # block at a time, without decoding the positions.
    total = sum(int(part[i : i + BLOCK].sum(dtype=np.uint64)) for part in (gaps, escaped)
                for i in range(0, part.size, BLOCK))
    if total > n:
        raise _refuse(f"a position past the tensor's end ({n} elements)", name)


def apply_delta(target: np.ndarray, delta, *, name: str = "tensor") -> np.ndarray:
    """Apply ``delta`` (a ``Delta`` or its wire form) to ``target`` in place; returns ``target``
    itself. A wire form is parsed and checked in full before the first byte is written: on
    refusal (``ProtocolError``) the target is untouched. ``target`` must be C-contiguous and
    writeable, of the delta's size and item size (``UsageError`` / ``ProtocolError``)."""
    if not isinstance(target, np.ndarray) or not target.flags.c_contiguous or not target.flags.writeable:
        raise UsageError(f"apply_delta writes in place: {name} must be a writeable C-contiguous numpy array")
    if not isinstance(delta, Delta):
        delta = parse_delta(delta, size=int(target.size), itemsize=target.dtype.itemsize, name=name)
    elif (delta.size, delta.itemsize) != (target.size, target.dtype.itemsize):
        raise _refuse(f"it is for {delta.size} elements of {delta.itemsize} bytes, the target has "
                      f"{target.size} of {target.dtype.itemsize}", name)
    if delta.kind == SAME or not target.size:
        return target
    units = _units(target)
    if delta.kind == WHOLE:
        units[...] = delta.values
    else:
        for positions, values in delta.blocks():
            units[positions] = values
    return target


def touched_chunks(delta: Delta, offset: int, chunk_bytes: int) -> np.ndarray:
    """Sorted indices of the arena's ``chunk_bytes`` chunks that applying ``delta`` to the tensor
    at arena byte ``offset`` writes: from its positions alone (a block at a time), never a pass
    over the state. SAME: none; WHOLE: every chunk the tensor spans."""
    w = delta.itemsize
    if delta.kind == SAME or not delta.size:
        return np.zeros(0, dtype=np.int64)
    first, last = offset // chunk_bytes, (offset + delta.size * w - 1) // chunk_bytes
    if delta.kind == WHOLE:
        return np.arange(first, last + 1, dtype=np.int64)
    # Chunk c holds (part of) the elements lo[c]..hi[c]: an element across a chunk edge is in both.
    chunks = np.arange(first, last + 1, dtype=np.int64)
    lo = np.maximum((chunks * chunk_bytes - offset) // w, 0)  # = ceil((c C - offset - w + 1) / w)
    hi = ((chunks + 1) * chunk_bytes - offset - 1) // w
    hit = np.zeros(chunks.size, dtype=bool)
    for positions, _ in delta.blocks():  # sorted: how many fall in lo..hi, by binary search
        hit |= np.searchsorted(positions, hi, side="right") > np.searchsorted(positions, lo, side="left")
    return chunks[hit]


def state_touched_chunks(deltas: Sequence[Delta], offsets: Sequence[int], chunk_bytes: int) -> np.ndarray:
    """The union of ``touched_chunks`` over a state's tensors at their arena ``offsets``."""
    parts = [touched_chunks(d, off, chunk_bytes) for d, off in zip(deltas, offsets, strict=True)]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def chunk_digests_at(arrays: Sequence[np.ndarray], chunk_bytes: int, chunks: Sequence[int], *,
                     offsets: Sequence[int] | None = None, total: int | None = None) -> list[str]:
    """The xxh3-128 digest of each listed chunk of the arena the ``arrays`` make when laid out at
    ``offsets`` (default: ``plan.layout``'s, up to ``total`` bytes, default its end), padding read
    as zeros: what ``digest.chunk_digests`` of that arena gives for those chunks, read from the
    arrays where they are (no arena, no copy)."""
    if offsets is None:
        offsets, end = layout(arrays)
        total = end if total is None else total
    elif total is None:
        total = max((off + a.nbytes for off, a in zip(offsets, arrays, strict=True)), default=0)
    parts = [(off, np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for off, a in zip(offsets, arrays, strict=True)
             if a.nbytes]
    starts = [off for off, _ in parts]
    out = []
    for c in chunks:
        lo, hi = int(c) * chunk_bytes, min((int(c) + 1) * chunk_bytes, total)
        if not 0 <= lo < hi:
            raise UsageError(f"chunk {c} is outside the arena's {total} bytes")
        h, pos = xxhash.xxh3_128(), lo
        for off, flat in parts[max(0, int(np.searchsorted(starts, lo, side="right")) - 1):]:
            if off >= hi:
                break
            a, b = max(lo, off), min(hi, off + flat.size)
            if a >= b:
                continue
            if a > pos:
                h.update(bytes(a - pos))
            h.update(memoryview(flat[a - off : b - off]))
            pos = b
        if hi > pos:
            h.update(bytes(hi - pos))
        out.append(h.hexdigest())
    return out


def mismatched_chunks(arrays: Sequence[np.ndarray], chunk_bytes: int, chunks: Sequence[int],
                      expected: Sequence[str], **where) -> list[int]:
    """The listed chunks whose digest (``chunk_digests_at``) is not the ``expected`` one (the
    publisher's for the step, in the same order): empty when the step applied bit for bit."""
    got = chunk_digests_at(arrays, chunk_bytes, chunks, **where)
    return [int(c) for c, g, e in zip(chunks, got, expected, strict=True) if g != e]
