"""The element-level delta codec (collective/delta.py): bit-exact round trips, the coding's
choices, hostile wire forms refused with nothing written, and the chunks a delta touches."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from collective import delta as dl
from collective.digest import chunk_digests
from collective.errors import CollectiveError, ProtocolError, UsageError
from collective.plan import layout

RNG = np.random.default_rng(38)


def _changed(a: np.ndarray, density: float, seed: int = 0) -> np.ndarray:
    """A copy of ``a`` with about ``density`` of its elements' bytes changed (every byte of a
    chosen element flipped, so the element always differs)."""
    b = a.copy()
    units = b.reshape(-1).view(np.uint8).reshape(b.size, b.dtype.itemsize)
    where = np.random.default_rng(seed).random(b.size) < density
    units[where] ^= 0xFF
    return b


def _round_trip(base: np.ndarray, new: np.ndarray) -> dl.Delta:
    d = dl.make_delta(base, new)
    wire = d.to_bytes()
    assert len(wire) == d.nbytes
    target = base.copy()
    out = dl.apply_delta(target, wire)
    assert out is target
    assert target.tobytes() == new.tobytes()
    return d


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.uint16, np.int8, np.bool_,
                                   np.float64, np.complex128])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.01, 0.3, 1.0])
def test_a_delta_round_trips_bit_for_bit(dtype, density):
    base = RNG.standard_normal(5000).astype(dtype) if dtype is not np.bool_ else RNG.random(5000) < 0.5
    _round_trip(base, _changed(base, density))


def test_nan_payloads_and_negative_zero_are_elements_of_their_own():
    base = np.array([0.0, np.nan, 1.0, 2.0] * 50, dtype=np.float32)
    new = base.copy()
    new[0] = -0.0  # == 0.0 as a float, another element as bytes
    bits = new.view(np.uint32)
    bits[1] = 0x7FC00001  # another NaN payload
    d = _round_trip(base, new)
    assert d.kind == dl.ELEMENTS and d.count == 2
    assert dl.make_delta(base, base.copy()).kind == dl.SAME  # NaN == NaN as bytes


def test_bf16_as_uint16_view_and_as_ml_dtypes_make_the_same_wire_form():
    base = RNG.standard_normal(4000).astype(ml_dtypes.bfloat16)
    new = _changed(base, 0.01)
    assert dl.make_delta(base, new).to_bytes() == dl.make_delta(base.view(np.uint16), new.view(np.uint16)).to_bytes()


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2)])
def test_zero_d_and_empty_arrays(shape):
    base = np.full(shape, 1.5, dtype=np.float32)
    new = np.full(shape, 2.5, dtype=np.float32)
    d = _round_trip(base, new)
    assert d.kind == (dl.SAME if base.size == 0 else dl.WHOLE)


def test_an_unchanged_tensor_costs_only_its_header():
    a = RNG.standard_normal(100_000).astype(np.float32)
    d = dl.make_delta(a, a.copy())
    assert d.kind == dl.SAME and d.nbytes == 16
    target = a.copy()
    dl.apply_delta(target, d.to_bytes())
    assert target.tobytes() == a.tobytes()


def test_a_dense_change_goes_whole_and_a_sparse_one_as_elements_with_the_crossover_between():
    base = np.zeros(100_000, dtype=np.uint16)
    assert _round_trip(base, _changed(base, 1.0)).kind == dl.WHOLE
    assert _round_trip(base, _changed(base, 0.01)).kind == dl.ELEMENTS
    # Every second element: one-byte gaps + 2-byte values = 3 bytes a change, 1.5 per element of
    # the tensor: still elements. Two of every three: 2 bytes per element, no saving: whole.
    half, most = base.copy(), base.copy()
    half[::2] = 1
    most[np.arange(base.size) % 3 != 0] = 1
    d_half, d_most = _round_trip(base, half), _round_trip(base, most)
    assert d_half.kind == dl.ELEMENTS and d_half.coding == 1 and d_half.nbytes < base.nbytes
    assert d_most.kind == dl.WHOLE and d_most.nbytes == 16 + base.nbytes


def test_the_gap_coding_is_the_smallest_that_fits():
    n = 1 << 20
    base = np.zeros(n, dtype=np.uint16)
    cases = {  # positions -> expected coding (0: one byte with escapes)
        (5, 10, 200): 1,
        (5, 60_000): 2,
        (5, 100_000): 0,  # one byte + one 4-byte escape (6 bytes) beats two 4-byte gaps
        tuple(range(5, n, 70_000)): 4,  # every gap escaped would cost 5 bytes a gap
    }
    for positions, coding in cases.items():
        new = base.copy()
        new[list(positions)] = 7
        assert _round_trip(base, new).coding == coding, positions
    # 1% uniformly: most gaps fit a byte, a few escape: smaller than two bytes a gap.
    d = _round_trip(base, _changed(base, 0.01))
    assert d.coding == 0 and d.escaped.size > 0
    assert d.gaps.nbytes + d.escaped.nbytes < 2 * d.count
    assert d.nbytes < 0.0175 * base.nbytes  # 1% of bf16 elements: under 1.75% of the bytes


def test_the_wire_form_is_the_documented_one():
    base = np.zeros(1000, dtype=np.uint16)
    new = base.copy()
    new[[3, 4, 700]] = [11, 12, 13]
    wire = dl.make_delta(base, new).to_bytes()
    assert wire[:16] == b"CDL1" + bytes([1, 2, 0, 0]) + struct.pack("<Q", 1000)
    k, coding, esc_w, zero, e = struct.unpack_from("<QBB6sQ", wire, 16)
    # gaps from position -1: 4, 1, 696; one byte each with 696 escaped (5 bytes) beats 2 bytes each
    assert (k, coding, esc_w, zero, e) == (3, 0, 2, bytes(6), 1)
    assert np.frombuffer(wire, "<u2", 3, 40).tolist() == [11, 12, 13]
    assert list(wire[46:49]) == [4, 1, 0]
    assert np.frombuffer(wire, "<u2", 1, 49).tolist() == [696]
    assert len(wire) == 51
    assert dl.make_delta(base, base).to_bytes() == b"CDL1" + bytes([0, 2, 0, 0]) + struct.pack("<Q", 1000)
    whole = dl.make_delta(base, base + 1).to_bytes()
    assert whole[4] == dl.WHOLE and whole[16:] == (base + 1).tobytes()


# Hostile wire forms: each refused with one ProtocolError line, the target untouched.

def _sparse_wire(n: int = 1000) -> tuple[np.ndarray, bytes]:
    base = np.arange(n, dtype=np.uint16)
    new = base.copy()
    new[[3, 4, 700]] = 9
    return base, dl.make_delta(base, new).to_bytes()


def _elements(n: int, gaps: list[int], *, coding: int = 4, k: int | None = None, values: int | None = None,
              width: int = 2, escaped: list[int] = (), esc_w: int = 0, e: int | None = None) -> bytes:
    k = len(gaps) if k is None else k
    head = b"CDL1" + bytes([1, width, 0, 0]) + struct.pack("<Q", n)
    head += struct.pack("<QBB6sQ", k, coding, esc_w, bytes(6), len(escaped) if e is None else e)
    vals = bytes(width * (len(gaps) if values is None else values))
    gap_bytes = np.array(gaps, dtype=f"<u{coding if coding in (2, 4, 8) else 1}").tobytes()
    esc = np.array(escaped, dtype=f"<u{esc_w or 1}").tobytes() if escaped else b""
    return head + vals + gap_bytes + esc


HOSTILE = {
    "truncated header": lambda: _sparse_wire()[1][:30],
    "truncated values": lambda: _sparse_wire()[1][:-4],
    "a byte too many": lambda: _sparse_wire()[1] + b"\0",
    "bad magic": lambda: b"XDL1" + _sparse_wire()[1][4:],
    "unknown kind": lambda: _sparse_wire()[1][:4] + b"\x07" + _sparse_wire()[1][5:],
    "wrong width": lambda: _elements(1000, [1, 2], width=4),
    "other tensor size": lambda: _elements(999, [1, 2]),
    "position out of range": lambda: _elements(1000, [10, 991]),
    "a gap past the end": lambda: _elements(1000, [1 << 31]),
    "a repeated position": lambda: _elements(1000, [5, 0, 3]),
    "wrapping gaps": lambda: _elements(1000, [1, (1 << 64) - 1], coding=8),
    "count past the size": lambda: _elements(1000, [1] * 1001),
    "count of zero": lambda: _elements(1000, [], k=0),
    "a 1 GB position list": lambda: _elements(1000, [1], k=1 << 30, values=1),
    "whole, truncated": lambda: b"CDL1" + bytes([2, 2, 0, 0]) + struct.pack("<Q", 1000) + bytes(1998),
    "same, with a tail": lambda: b"CDL1" + bytes([0, 2, 0, 0]) + struct.pack("<Q", 1000) + b"x",
    "unknown gap coding": lambda: _elements(1000, [1, 2], coding=3),
    "escapes not declared": lambda: _elements(1000, [1, 0, 2], coding=0, escaped=[300], esc_w=2, e=0),
    "an escape without its gap": lambda: _elements(1000, [1, 0, 0], coding=0, escaped=[300], esc_w=2, e=1),
    "an escaped gap of 0": lambda: _elements(1000, [1, 0], coding=0, escaped=[0], esc_w=2),
    "an escaped gap past the end": lambda: _elements(1000, [1, 0], coding=0, escaped=[5000], esc_w=2),
    "an escaped width of 1": lambda: _elements(1000, [1, 0], coding=0, escaped=[3], esc_w=1),
    "nonzero reserved bytes": lambda: _sparse_wire()[1][:26] + b"\x01" + _sparse_wire()[1][27:],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_delta_is_refused_with_nothing_written(case):
    target = np.arange(1000, dtype=np.uint16)
    before = target.copy()
    with pytest.raises(ProtocolError) as info:
        dl.apply_delta(target, HOSTILE[case](), name="layer.0.w")
    assert target.tobytes() == before.tobytes()
    message = str(info.value)
    assert "\n" not in message and "layer.0.w" in message and "refused" in message


def test_a_huge_declared_count_is_refused_before_anything_is_allocated(monkeypatch):
    calls = []
    real = np.frombuffer
    monkeypatch.setattr(np, "frombuffer", lambda *a, **k: calls.append(k.get("count")) or real(*a, **k))
    with pytest.raises(ProtocolError):
        dl.parse_delta(HOSTILE["a 1 GB position list"](), size=1000, itemsize=2)
    assert calls == []


def test_a_valid_sparse_wire_form_applies():
    target = np.ones(1000, dtype=np.uint16)
    dl.apply_delta(target, _elements(1000, [1, 0, 2], coding=0, escaped=[300], esc_w=2))
    assert np.flatnonzero(target == 0).tolist() == [0, 300, 302]  # the values are zeros
    d = dl.parse_delta(_elements(1000, [1, 0, 2], coding=0, escaped=[300], esc_w=2), size=1000, itemsize=2)
    assert next(d.blocks())[0].tolist() == [0, 300, 302]


def test_the_callers_mistakes_are_usage_errors():
    a = np.zeros(10, dtype=np.float32)
    with pytest.raises(UsageError):
        dl.make_delta(a, np.zeros(11, dtype=np.float32))
    with pytest.raises(UsageError):
        dl.make_delta(a, np.zeros(10, dtype=np.float64))
    wire = dl.make_delta(a, a + 1).to_bytes()
    with pytest.raises(UsageError):
        dl.apply_delta(np.zeros(20, dtype=np.float32)[::2], wire)  # not contiguous: not in place
    read_only = np.zeros(10, dtype=np.float32)
    read_only.flags.writeable = False
    with pytest.raises(UsageError):
        dl.apply_delta(read_only, wire)
    assert issubclass(ProtocolError, CollectiveError) and issubclass(UsageError, CollectiveError)


def test_a_delta_longer_than_a_block_round_trips(monkeypatch):
    monkeypatch.setattr(dl, "BLOCK", 1000)  # many blocks, with escapes crossing their edges
    base = np.zeros(300_000, dtype=np.uint16)
    d = _round_trip(base, _changed(base, 0.01, seed=3))
    assert d.count > 2 * dl.BLOCK and d.coding == 0


# The chunks a delta touches, and their digests after applying.

def _state(sizes, dtype=np.uint16):
    return [RNG.integers(0, 1000, n).astype(dtype) for n in sizes]


def _arena(arrays) -> tuple[np.ndarray, list[int]]:
    offsets, total = layout(arrays)
    arena = np.zeros(total, dtype=np.uint8)
    for off, a in zip(offsets, arrays, strict=True):
        arena[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
    return arena, offsets


def test_touched_chunks_are_exactly_the_chunks_whose_bytes_changed():
    chunk = 1000  # not a multiple of the item size: elements cross chunk edges
    for dtype in (np.uint16, np.float64, np.complex128):
        base = _state([30_000, 7, 0, 12_345, 1], dtype)
        new = [_changed(a, 0.0005, seed=i) for i, a in enumerate(base)]
        new[1] = base[1].copy()  # an unchanged tensor touches nothing
        new[4] = _changed(base[4], 1.0)
        deltas = [dl.make_delta(a, b) for a, b in zip(base, new, strict=True)]
        before, offsets = _arena(base)
        after, _ = _arena(new)
        want = sorted({i // chunk for i in np.flatnonzero(before != after)})
        got = dl.state_touched_chunks(deltas, offsets, chunk)
        assert got.tolist() == want, dtype


def test_chunk_digests_at_equal_the_arenas_chunk_digests():
    arrays = _state([1000, 3, 0, 5000, 17])
    arena, offsets = _arena(arrays)
    for chunk in (64, 1000, 4096, 1 << 20):
        want = chunk_digests(arena, chunk)
        assert dl.chunk_digests_at(arrays, chunk, range(len(want))) == want
        assert dl.chunk_digests_at(arrays, chunk, range(len(want)), offsets=offsets, total=arena.size) == want


def test_after_applying_the_touched_chunks_match_the_publishers_and_a_wrong_byte_is_found():
    chunk = 4096
    base = _state([50_000, 20_000, 9])
    new = [_changed(a, 0.001, seed=i) for i, a in enumerate(base)]
    publisher = chunk_digests(_arena(new)[0], chunk)
    offsets, _ = layout(new)
    wires = [dl.make_delta(a, b).to_bytes() for a, b in zip(base, new, strict=True)]
    targets = [a.copy() for a in base]
    deltas = [dl.parse_delta(w, size=t.size, itemsize=t.dtype.itemsize) for t, w in zip(targets, wires, strict=True)]
    for t, d in zip(targets, deltas, strict=True):
        dl.apply_delta(t, d)
    touched = dl.state_touched_chunks(deltas, offsets, chunk)
    assert 0 < touched.size < len(publisher)
    assert dl.mismatched_chunks(targets, chunk, touched, [publisher[c] for c in touched]) == []
    targets[1][100] ^= 1  # a byte the delta did not bring
    bad = (offsets[1] + 200) // chunk
    if bad in touched:
        assert dl.mismatched_chunks(targets, chunk, touched, [publisher[c] for c in touched]) == [bad]
    assert dl.mismatched_chunks(targets, chunk, [bad], [publisher[bad]]) == [bad]


def test_parsing_and_applying_hold_a_block_of_positions_not_the_whole_list(monkeypatch):
    import tracemalloc

    monkeypatch.setattr(dl, "BLOCK", 1 << 14)
    base = np.zeros(1 << 21, dtype=np.uint16)
    new = _changed(base, 0.3)
    wire = dl.make_delta(base, new).to_bytes()
    target = base.copy()
    tracemalloc.start()
    try:
        d = dl.parse_delta(wire, size=target.size, itemsize=2)
        dl.apply_delta(target, d)
        dl.touched_chunks(d, 0, 4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert d.count * 8 > 4 << 20  # all positions at once: over 4 MiB
    assert peak < 12 * 8 * dl.BLOCK  # a few blocks' temporaries (1.5 MiB; the whole list: 20 MiB)
    assert target.tobytes() == new.tobytes()


def test_positions_checked_in_a_writable_buffer_cannot_change_before_they_are_applied():
    base, wire = _sparse_wire()
    buf = bytearray(wire)
    d = dl.parse_delta(buf, size=base.size, itemsize=2)
    buf[40 + 2 * d.count :] = b"\xff" * (len(buf) - 40 - 2 * d.count)  # the gaps, after the check
    target = base.copy()
    dl.apply_delta(target, d)
    assert np.flatnonzero(target != base).tolist() == [3, 4, 700]
