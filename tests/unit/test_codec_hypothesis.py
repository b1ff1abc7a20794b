"""Property tests of the wire codec: plan -> Chunker -> protobuf bytes -> Receiver.

Arbitrary arrays of every allowed dtype round-trip byte for byte (bfloat16 and float8 as
arbitrary bit patterns, so NaN payloads and negative zeros included); arbitrary damage to the
serialized stream is rejected with the project's errors (or protobuf's DecodeError) only, and
the Receiver never writes outside the arena it was given.
"""

from __future__ import annotations

import math

import numpy as np
import xxhash
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from collective import dtypes
from collective._proto import collective_pb2 as pb
from collective.chief.arena import materialize
from collective.digest import array_digest, chunk_digests
from collective.errors import IntegrityError, ProtocolError
from collective.plan import Chunker, Receiver, build_plan, validate_plan
from tests.clusters import ArraySource

WORKERS = [pb.WorkerInfo(rank=0, worker_id="w0", devices=["cpu:0"])]
ALLOWED = (ProtocolError, IntegrityError, DecodeError)
GUARD = 64  # bytes of sentinel on each side of the worker arena
SENTINEL = 0x5A

_CODES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
DTYPES = [np.dtype("?")] + [np.dtype(o + c) for o in "<>" for c in _CODES]
EXTENDED = [dtypes.from_wire(name) for name in dtypes.EXTENDED]

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _views(a: np.ndarray) -> list[np.ndarray]:
    """The array itself and non-contiguous views of it (when it has an axis to stride over)."""
    out = [a]
    if a.ndim >= 1:
        out += [a[::2], a[::-1], a.T, a[..., ::-1]]
    if a.ndim >= 2:
        out += [a[:, 1::2], np.swapaxes(a, 0, -1)[::-1]]
    return out


@st.composite
def source_arrays(draw) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES + EXTENDED))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    if dtypes.is_extended(dtype):  # any bit pattern: NaN payloads, -0.0, infinities, subnormals
        bits = draw(hnp.arrays(np.dtype(f"<u{dtype.itemsize}"), shape))
        return draw(st.sampled_from(_views(bits.view(dtype))))
    fill = None
    if dtype.kind in "fc":  # make NaN, infinities and -0.0 common, not just possible
        fill = st.sampled_from([np.nan, -0.0, 0.0, np.inf, -np.inf]).map(dtype.type)
    base = draw(hnp.arrays(dtype, shape, fill=fill))
    return draw(st.sampled_from(_views(base)))


def materialised(arrays: list[np.ndarray], chunk_bytes: int):
    named = {f"layer{i}/v": a for i, a in enumerate(arrays)}
    specs, arena, digests = materialize(ArraySource(named))
    plan = build_plan(specs, digests, WORKERS, arena=arena, chunk_bytes=chunk_bytes, chief_incarnation="x", model="test")
    validate_plan(plan)
    return plan, arena


def guarded_arena(total: int) -> tuple[np.ndarray, np.ndarray]:
    """A worker arena of ``total`` bytes inside a larger buffer whose edges must stay untouched."""
    buf = np.full(total + 2 * GUARD, SENTINEL, dtype=np.uint8)
    return buf, buf[GUARD : GUARD + total]


def guards_intact(buf: np.ndarray) -> bool:
    return bool((buf[:GUARD] == SENTINEL).all() and (buf[-GUARD:] == SENTINEL).all())


# --- honest streams round-trip -----------------------------------------------------------------


@PROPERTY
@given(arrays=st.lists(source_arrays(), max_size=8), chunk_bytes=st.integers(1, 4096))
@example(
    arrays=[
        np.array([np.nan, -0.0, np.inf], ">f2"),
        np.array(-0.0, "<f8"),
        np.zeros((0, 3), ">c16"),
        np.arange(12, dtype=">i8").reshape(3, 4).T,
        np.array([True, False]),
        np.array([0x7FC3, 0xFFC1, 0x8000, 0x7F80, 0x0001], "<u2").view(EXTENDED[0]),  # bf16 NaN payloads
        np.array([0x7F, 0xFF, 0x80, 0x01], "u1").view(EXTENDED[1]),  # float8_e4m3fn NaNs, -0
    ],
    chunk_bytes=1,
)
@example(arrays=[], chunk_bytes=4096)
def test_any_arrays_reach_the_worker_arena_byte_for_byte(arrays, chunk_bytes):
    plan, chief_arena = materialised(arrays, chunk_bytes)
    plan = pb.Plan.FromString(plan.SerializeToString())  # the worker's copy of the plan
    chunks = list(Chunker(plan, chief_arena).chunks())
    wire = [c.SerializeToString() for c in chunks]
    assert len(wire) == math.ceil(plan.total_bytes / chunk_bytes) + 1 == len(plan.chunk_digests) + 1
    assert list(plan.chunk_digests) == chunk_digests(chief_arena, chunk_bytes)
    assert [c.digest for c in chunks] == [xxhash.xxh3_128_hexdigest(c.data) for c in chunks[:-1]] + [""]

    buf, arena = guarded_arena(plan.total_bytes)
    receiver = Receiver(plan, arena)
    for blob in wire:
        receiver.accept(pb.Chunk.FromString(blob))
    receiver.finish()

    assert arena.tobytes() == chief_arena.tobytes()
    assert guards_intact(buf)
    assert receiver.variables_verified == len(arrays)
    assert receiver.digests == list(plan.chunk_digests)
    for v, original in zip(plan.variables, arrays, strict=True):
        expected = np.ascontiguousarray(original).tobytes()
        assert arena[v.offset : v.offset + v.nbytes].tobytes() == expected
        assert v.digest == array_digest(original)
        assert tuple(v.shape) == original.shape and v.dtype == dtypes.wire(original.dtype)


# --- damaged streams are rejected with the project's errors only -------------------------------


def feed(plan: pb.Plan, arena: np.ndarray, blobs: list[bytes]) -> Receiver | None:
    """Parse and accept every blob, then finish. The Receiver if the stream was taken as good.

    ProtocolError, IntegrityError and DecodeError mean "rejected" (None); any other exception
    escapes and fails the test.
    """
    receiver = Receiver(plan, arena)
    try:
        for blob in blobs:
            receiver.accept(pb.Chunk.FromString(blob))
        receiver.finish()
    except ALLOWED as exc:
        event(f"rejected with {type(exc).__name__}")
        return None
    event("accepted")
    return receiver


def check_outcome(plan, arrays, chief_arena, buf, arena, receiver: Receiver | None) -> None:
    """Nothing outside the arena was touched; a stream taken as good delivered every byte.

    Every byte, padding included: the chunk digests cover the whole arena.
    """
    assert arena.size == plan.total_bytes
    assert guards_intact(buf)
    if receiver is not None:
        assert receiver.variables_verified == len(plan.variables)
        assert receiver.digests == list(plan.chunk_digests)
        assert arena.tobytes() == chief_arena.tobytes()
        for v, original in zip(plan.variables, arrays, strict=True):
            assert arena[v.offset : v.offset + v.nbytes].tobytes() == np.ascontiguousarray(original).tobytes()


MESSAGE_EDITS = ["data_flip", "data_flip_resealed", "data_shorten", "data_extend", "no_digest", "no_end", "no_keys"]


def edit_chunk(chunk: pb.Chunk, op: str, j: int, v: int) -> None:
    """Damage one well-formed message in place (it stays parseable)."""
    if op in ("data_flip", "data_flip_resealed") and chunk.data:
        data = bytearray(chunk.data)
        data[j % len(data)] ^= 1 << (v % 8)
        chunk.data = bytes(data)
        if op == "data_flip_resealed":  # a digest field that agrees with the damaged bytes
            chunk.digest = xxhash.xxh3_128_hexdigest(chunk.data)
    elif op == "data_shorten" and chunk.data:
        chunk.data = chunk.data[: j % len(chunk.data)]
    elif op == "data_extend":
        chunk.data += bytes([v % 256]) * (1 + j % 8)
    elif op == "no_digest":
        chunk.ClearField("digest")
    elif op == "no_end":
        chunk.ClearField("end")
    elif op == "no_keys":
        del chunk.instance_keys[:]
    elif op == "offset":
        chunk.offset = v
    elif op == "group_key":
        chunk.group_key = v
    elif op == "instance_key":
        chunk.instance_keys.append(v)
    elif op == "digest":
        chunk.digest = f"{v:032x}"
    elif op == "digest_text":
        chunk.digest = "xyz"[: j % 4] + chunk.digest[j % 4 :]
    elif op == "end_total":
        chunk.end.total_bytes = v


def _edit_message(blob: bytes, op: str, j: int, v: int) -> bytes:
    try:
        chunk = pb.Chunk.FromString(blob)
    except DecodeError:  # already broken by an earlier byte edit
        return blob
    edit_chunk(chunk, op, j, v)
    return chunk.SerializeToString()


_small_model = st.lists(source_arrays(), min_size=1, max_size=4)
_pos = st.integers(0, 10**6)

_mutation = st.one_of(
    # raw byte damage to one serialized message
    st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]), _pos, _pos, st.integers(0, 255)),
    # damage to the sequence of messages
    st.tuples(st.sampled_from(["drop", "duplicate", "swap"]), _pos, _pos, st.just(0)),
    # well-formed messages with damaged content, so the Receiver's own checks get the work
    st.tuples(st.sampled_from(MESSAGE_EDITS), _pos, _pos, st.integers(0, 255)),
)


def mutate(blobs: list[bytes], mutations) -> list[bytes]:
    blobs = list(blobs)
    for op, i, j, v in mutations:
        if not blobs:
            break
        i %= len(blobs)
        if op == "drop":
            del blobs[i]
        elif op == "duplicate":
            blobs.insert(i, blobs[i])
        elif op == "swap":
            j %= len(blobs)
            blobs[i], blobs[j] = blobs[j], blobs[i]
        elif op == "insert":
            b = bytearray(blobs[i])
            b.insert(j % (len(b) + 1), v)
            blobs[i] = bytes(b)
        elif op in ("flip", "set", "delete", "truncate"):
            b = bytearray(blobs[i])
            if b:
                j %= len(b)
                if op == "flip":
                    b[j] ^= 1 << (v % 8)
                elif op == "set":
                    b[j] = v
                elif op == "delete":
                    del b[j]
                else:
                    del b[j:]
            blobs[i] = bytes(b)
        else:
            blobs[i] = _edit_message(blobs[i], op, j, v)
    return blobs


@FUZZ
@given(
    arrays=_small_model,
    chunk_bytes=st.integers(1, 512),
    mutations=st.lists(_mutation, min_size=1, max_size=4),
)
def test_a_mutated_stream_is_rejected_cleanly_or_still_delivers_the_right_values(arrays, chunk_bytes, mutations):
    plan, chief_arena = materialised(arrays, chunk_bytes)
    wire = [c.SerializeToString() for c in Chunker(plan, chief_arena).chunks()]
    buf, arena = guarded_arena(plan.total_bytes)

    receiver = feed(plan, arena, mutate(wire, mutations))

    check_outcome(plan, arrays, chief_arena, buf, arena, receiver)


@FUZZ
@given(
    arrays=st.lists(source_arrays(), max_size=3),
    chunk_bytes=st.integers(1, 256),
    garbage=st.lists(st.binary(max_size=120), min_size=1, max_size=6),
    keep=st.integers(0, 8),
)
def test_random_bytes_as_chunks_raise_only_protocol_integrity_or_decode_errors(arrays, chunk_bytes, garbage, keep):
    plan, chief_arena = materialised(arrays, chunk_bytes)
    honest = [c.SerializeToString() for c in Chunker(plan, chief_arena).chunks()]
    # a valid prefix (possibly empty) followed by garbage, so garbage also lands mid-stream
    blobs = honest[: min(keep, len(honest) - 1)] + garbage
    buf, arena = guarded_arena(plan.total_bytes)

    receiver = feed(plan, arena, blobs)

    check_outcome(plan, arrays, chief_arena, buf, arena, receiver)


FIELD_EDITS = ["offset", "group_key", "instance_key", "digest", "digest_text", "end_total"]


@FUZZ
@given(
    arrays=_small_model,
    chunk_bytes=st.integers(1, 256),
    index=_pos,
    op=st.sampled_from(MESSAGE_EDITS + FIELD_EDITS),
    j=st.integers(0, 8),
    value=st.one_of(st.integers(0, 1024), st.integers(0, 2**64 - 1)),
)
def test_a_well_formed_but_wrong_message_is_rejected_cleanly(arrays, chunk_bytes, index, op, j, value):
    plan, chief_arena = materialised(arrays, chunk_bytes)
    chunks = list(Chunker(plan, chief_arena).chunks())
    edit_chunk(chunks[index % len(chunks)], op, j, value)
    buf, arena = guarded_arena(plan.total_bytes)

    receiver = feed(plan, arena, [c.SerializeToString() for c in chunks])

    check_outcome(plan, arrays, chief_arena, buf, arena, receiver)
