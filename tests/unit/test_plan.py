"""The broadcast plan: layout, build/validate, and the Chunker -> Receiver stream (collective.plan)."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from collective._proto import collective_pb2 as pb
from collective.chief.arena import materialize
from collective.digest import array_digest, chunk_digests, combined_digest
from collective.errors import IntegrityError, ProtocolError
from collective.keys import GROUP_KEY_START, INSTANCE_KEY_START
from collective.model import Aggregation, Synchronization, VariableSpec
from collective.plan import (
    ALIGN,
    MAX_CHUNK_BYTES,
    Chunker,
    Receiver,
    build_plan,
    check_completes,
    complete_plan,
    frame_messages,
    from_pieces,
    layout,
    manifest_digest,
    spec_of,
    to_pieces,
    validate_plan,
)
from tests.clusters import ArraySource, small_arrays

W0 = pb.WorkerInfo(rank=0, worker_id="w0", devices=["cpu:0"])
W1 = pb.WorkerInfo(rank=1, worker_id="w1", devices=["cpu:0", "cpu:1"])


def make_plan(arrays, *, chunk_bytes=4096, workers=(W0,)):
    """Materialise arrays the way the chief does; return (plan, chief arena, specs, digests)."""
    specs, arena, digests = materialize(ArraySource(dict(arrays)))
    plan = build_plan(
        specs, digests, list(workers), arena=arena, chunk_bytes=chunk_bytes, chief_incarnation="x", model="test"
    )
    return plan, arena, specs, digests


def empty_plan(**kw):
    """The plan of a model without variables (its arena is empty too)."""
    arena = np.zeros(0, np.uint8)
    return build_plan([], [], [W0], arena=arena, chunk_bytes=64, chief_incarnation="x", model="test", **kw)


def stream(plan, arena):
    return list(Chunker(plan, arena).chunks())


def worker_arena(plan, fill=0xA5):
    return np.full(plan.total_bytes, fill, dtype=np.uint8)


def receive(plan, chunks):
    """Feed every chunk to a fresh Receiver and finish; return the worker's arena."""
    out = worker_arena(plan)
    r = Receiver(plan, out)
    for c in chunks:
        r.accept(c)
    r.finish()
    return out


def reseal(plan):
    """Recompute the manifest digest after editing a plan, so only the edited rule is broken."""
    plan.manifest_digest = manifest_digest(plan.variables)
    return plan


def var_bytes(arena, v):
    return arena[v.offset : v.offset + v.nbytes].tobytes()


def flip(chunk, index, bit=0x10):
    """Flip one bit of a message's bytes, leaving its digest field as the chief wrote it."""
    data = bytearray(chunk.data)
    data[index] ^= bit
    chunk.data = bytes(data)


# Three variables over 392 bytes: a 0..100, b 128..328, c 384..392 (padding 100..128 and
# 328..384). With 128-byte chunks the stream is, each data message with its chunk's digest:
#   [0,128) a | [128,256) b | [256,384) b | [384,392) c | end (no bytes, no digest)
ABC = {
    "a": np.arange(100, dtype=np.uint8),
    "b": np.arange(50, dtype="<f4"),
    "c": np.array(7, dtype=">i8"),
}


@pytest.fixture
def abc():
    plan, arena, _, _ = make_plan(ABC, chunk_bytes=128)
    return plan, arena, stream(plan, arena)


def expect_reject(plan, chunks, exc, match):
    r = Receiver(plan, worker_arena(plan))
    with pytest.raises(exc, match=match):
        for c in chunks:
            r.accept(c)
        r.finish()


# --- layout ------------------------------------------------------------------------------------


def specs_of_sizes(sizes):
    return [VariableSpec(f"v{i}", (n,), "|u1") for i, n in enumerate(sizes)]


def test_layout_of_no_variables_is_empty():
    assert layout([]) == ([], 0)


def test_layout_aligns_each_variable_to_64_bytes_and_ends_at_the_last_byte():
    offsets, total = layout(specs_of_sizes([1, 64, 0, 65, 3]))
    assert offsets == [0, 64, 128, 128, 256]
    assert total == 259


def test_layout_accounts_for_shape_and_itemsize():
    specs = [VariableSpec("k", (3, 5), "<f8"), VariableSpec("s", (), ">i2"), VariableSpec("e", (0, 7), "<c16")]
    assert layout(specs) == ([0, 128, 192], 192)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=300), max_size=30))
def test_layout_places_variables_aligned_in_order_without_overlap(sizes):
    specs = specs_of_sizes(sizes)
    offsets, total = layout(specs)
    assert len(offsets) == len(specs)
    end = 0
    for off, spec in zip(offsets, specs, strict=True):
        assert off % ALIGN == 0
        assert end <= off < end + ALIGN
        end = off + spec.nbytes
    assert total == end


# --- build_plan --------------------------------------------------------------------------------


def test_build_plan_gives_one_group_of_every_workers_qualified_devices():
    plan, *_ = make_plan(ABC, workers=(W0, W1))
    assert [g.group_key for g in plan.groups] == [GROUP_KEY_START]
    assert list(plan.groups[0].devices) == sorted(
        [
            "/job:worker/task:0/device:CPU:0",
            "/job:worker/task:1/device:CPU:0",
            "/job:worker/task:1/device:CPU:1",
        ]
    )
    assert all(v.group_key == GROUP_KEY_START for v in plan.variables)
    assert plan.num_workers == 2
    assert list(plan.workers) == [W0, W1]


def test_build_plan_numbers_instance_keys_in_model_order():
    plan, *_ = make_plan({"z": np.zeros(1), "a": np.zeros(1), "m": np.zeros(1)})
    assert [(v.name, v.instance_key) for v in plan.variables] == [
        ("z", INSTANCE_KEY_START),
        ("a", INSTANCE_KEY_START + 1),
        ("m", INSTANCE_KEY_START + 2),
    ]


def test_build_plan_uses_the_layout_offsets_and_total():
    plan, arena, specs, _ = make_plan(small_arrays())
    offsets, total = layout(specs)
    assert [v.offset for v in plan.variables] == offsets
    assert [v.nbytes for v in plan.variables] == [s.nbytes for s in specs]
    assert plan.total_bytes == total == arena.size
    assert all(v.offset % ALIGN == 0 for v in plan.variables)


def test_build_plan_records_shape_dtype_and_the_given_digests():
    arrays = small_arrays()
    plan, _, _, digests = make_plan(arrays)
    assert [v.digest for v in plan.variables] == digests
    for v, (name, a) in zip(plan.variables, arrays.items(), strict=True):
        assert v.name == name
        assert tuple(v.shape) == a.shape
        assert v.dtype == a.dtype.str
        assert v.digest == xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).tobytes())


def test_build_plan_manifest_digest_covers_every_name_and_digest_in_order():
    plan, _, specs, digests = make_plan(small_arrays())
    assert plan.manifest_digest == combined_digest(zip([s.name for s in specs], digests, strict=True))


def test_build_plan_copies_chunk_size_incarnation_and_model():
    plan, *_ = make_plan(ABC, chunk_bytes=12345)
    assert (plan.chunk_bytes, plan.chief_incarnation, plan.model) == (12345, "x", "test")


def test_build_plan_writes_synchronization_aggregation_and_default_trainable():
    specs = [
        VariableSpec("w", (2,), "<f4"),
        VariableSpec("acc", (2,), "<f4", Synchronization.ON_READ, Aggregation.SUM),
        VariableSpec("frozen", (2,), "<f4", Synchronization.ON_WRITE, Aggregation.MEAN, trainable=False),
    ]
    digests = [array_digest(np.zeros(2, np.float32))] * 3
    arena = np.zeros(layout(specs)[1], np.uint8)
    plan = build_plan(specs, digests, [W0], arena=arena, chunk_bytes=64, chief_incarnation="x", model="test")
    assert [(v.synchronization, v.aggregation, v.trainable) for v in plan.variables] == [
        ("AUTO", "NONE", True),
        ("ON_READ", "SUM", False),
        ("ON_WRITE", "MEAN", False),
    ]
    assert [spec_of(v).synchronization for v in plan.variables] == [s.synchronization for s in specs]


def test_build_plan_is_deterministic_byte_for_byte():
    first, *_ = make_plan(small_arrays(), workers=(W0, W1))
    second, *_ = make_plan(small_arrays(), workers=(W0, W1))
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)
    assert first.SerializeToString() == second.SerializeToString()


def test_build_plan_refuses_a_digest_list_of_the_wrong_length():
    specs = specs_of_sizes([1, 2])
    arena = np.zeros(layout(specs)[1], np.uint8)
    with pytest.raises(ValueError):
        build_plan(specs, ["d"], [W0], arena=arena, chunk_bytes=64, chief_incarnation="x", model="test")


def test_build_plan_of_an_empty_model_has_no_variables_no_bytes_and_no_chunk_digests():
    plan = empty_plan()
    assert list(plan.variables) == [] and plan.total_bytes == 0
    assert list(plan.chunk_digests) == []
    assert plan.manifest_digest == xxhash.xxh3_128_hexdigest(b"")
    validate_plan(plan)


def test_build_plan_lists_the_digest_of_every_chunk_of_the_chief_arena():
    plan, arena, _, _ = make_plan(ABC, chunk_bytes=128)
    raw = arena.tobytes()
    expected = [xxhash.xxh3_128_hexdigest(raw[i : i + 128]) for i in (0, 128, 256, 384)]  # the last: 8 bytes
    assert list(plan.chunk_digests) == expected == chunk_digests(arena, 128)
    assert len(set(expected)) == 4


def test_build_plan_digests_the_arena_it_is_given():
    specs, arena, digests = materialize(ArraySource(dict(ABC)))
    other = arena.copy()
    other[300] ^= 1  # inside b, in the third chunk
    plans = [
        build_plan(specs, digests, [W0], arena=a, chunk_bytes=128, chief_incarnation="x", model="test")
        for a in (arena, other)
    ]
    first, second = (list(p.chunk_digests) for p in plans)
    assert first[:2] == second[:2] and first[3] == second[3]
    assert first[2] != second[2] == xxhash.xxh3_128_hexdigest(other[256:384].tobytes())


def test_build_plan_digests_only_the_arena_bytes_up_to_the_total():
    """A page-rounded arena (the shared-memory path) has spare bytes after the last variable."""
    specs, arena, digests = materialize(ArraySource(dict(ABC)))
    rounded = np.concatenate([arena, np.full(4096 - arena.size, 0xEE, np.uint8)])
    plan = build_plan(specs, digests, [W0], arena=rounded, chunk_bytes=128, chief_incarnation="x", model="test")
    assert list(plan.chunk_digests) == chunk_digests(arena, 128)
    validate_plan(plan)


# --- validate_plan -----------------------------------------------------------------------------


@pytest.fixture
def valid_plan():
    plan, *_ = make_plan(ABC, chunk_bytes=128)
    validate_plan(plan)  # the starting point is accepted, so each rejection below is the edit's
    return plan


def test_validate_plan_accepts_a_built_plan_with_every_allowed_dtype():
    arrays = {
        f"{o}{c}": np.zeros((2, 3), f"{o}{c}")
        for o in "<>"
        for c in ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
    }
    arrays["bool"] = np.zeros(3, bool)
    arrays["scalar"] = np.array(1.0)
    arrays["empty"] = np.zeros((0, 4), np.int32)
    plan, *_ = make_plan(arrays, workers=(W0, W1))
    validate_plan(plan)


def test_validate_plan_rejects_a_duplicate_name(valid_plan):
    valid_plan.variables[1].name = "a"
    with pytest.raises(ProtocolError, match="duplicate name"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_an_empty_name(valid_plan):
    valid_plan.variables[0].name = ""
    with pytest.raises(ProtocolError, match="empty or duplicate name"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_a_duplicate_instance_key(valid_plan):
    valid_plan.variables[2].instance_key = valid_plan.variables[0].instance_key
    with pytest.raises(ProtocolError, match="'c'.*instance key 1 is used twice"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_an_unknown_group_key(valid_plan):
    valid_plan.variables[1].group_key = 99
    with pytest.raises(ProtocolError, match="'b'.*group key 99 is not a group"):
        validate_plan(reseal(valid_plan))


@pytest.mark.parametrize("dtype", ["|O", "|V8", "<U2", "|S4", "<M8[ns]", "<m8[s]", "<i4,<i4", "(2,)<i4"])
def test_validate_plan_rejects_a_dtype_that_is_not_plain_numbers(valid_plan, dtype):
    valid_plan.variables[0].dtype = dtype
    with pytest.raises(ProtocolError, match="invalid dtype|not allowed on the wire"):
        validate_plan(reseal(valid_plan))


@pytest.mark.parametrize("dtype", ["", "float31", "x", "{}", "<f4 "])
def test_validate_plan_rejects_a_dtype_numpy_does_not_understand(valid_plan, dtype):
    valid_plan.variables[0].dtype = dtype
    with pytest.raises(ProtocolError, match="invalid dtype"):
        validate_plan(reseal(valid_plan))


@pytest.mark.parametrize("dtype", ["(2,3", "i4,(2", "(-1,)i4", "(99999999999999999999,)u1"])
def test_validate_plan_rejects_a_malformed_dtype_string_with_protocol_error(valid_plan, dtype):
    valid_plan.variables[0].dtype = dtype
    with pytest.raises(ProtocolError):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_a_negative_dimension(valid_plan):
    valid_plan.variables[0].shape[:] = [-1, -100]
    with pytest.raises(ProtocolError, match="'a'.*negative dimension"):
        validate_plan(reseal(valid_plan))


@pytest.mark.parametrize("nbytes", [99, 101, 0, 400])
def test_validate_plan_rejects_nbytes_that_do_not_match_shape_times_itemsize(valid_plan, nbytes):
    valid_plan.variables[0].nbytes = nbytes
    with pytest.raises(ProtocolError, match="'a'.*do not fit shape"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_a_dtype_whose_itemsize_does_not_match_nbytes(valid_plan):
    valid_plan.variables[1].dtype = "<f8"  # 50 x 8 != 200
    with pytest.raises(ProtocolError, match="'b'.*do not fit shape"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_nbytes_one_short_of_a_huge_shape():
    v = pb.VariableInfo(
        name="huge", shape=[2**53 + 1], dtype="|u1", group_key=1, instance_key=1,
        offset=0, nbytes=2**53, digest="d", synchronization="AUTO", aggregation="NONE",
    )
    plan = pb.Plan(groups=[pb.GroupInfo(group_key=1)], variables=[v], total_bytes=2**53, chunk_bytes=64)
    with pytest.raises(ProtocolError, match="do not fit shape"):
        validate_plan(reseal(plan))


def test_validate_plan_rejects_overlapping_variables(valid_plan):
    valid_plan.variables[1].offset = 64  # 'a' occupies 0..100
    with pytest.raises(ProtocolError, match="'b'.*overlap or pass the arena end"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_variables_out_of_arena_order(valid_plan):
    valid_plan.variables[0].offset, valid_plan.variables[1].offset = 128, 0
    with pytest.raises(ProtocolError, match="overlap or pass the arena end"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_a_variable_that_passes_the_arena_end(valid_plan):
    valid_plan.variables[2].offset = valid_plan.total_bytes - 4  # 8 bytes from there pass the end
    with pytest.raises(ProtocolError, match="'c'.*overlap or pass the arena end"):
        validate_plan(reseal(valid_plan))


def test_validate_plan_rejects_a_total_smaller_than_the_last_variable(valid_plan):
    valid_plan.total_bytes -= 1
    with pytest.raises(ProtocolError, match="'c'.*pass the arena end"):
        validate_plan(reseal(valid_plan))


@pytest.mark.parametrize("chunk_bytes", [0, MAX_CHUNK_BYTES + 1, 2**32 - 1])
def test_validate_plan_rejects_a_chunk_size_outside_the_allowed_range(valid_plan, chunk_bytes):
    valid_plan.chunk_bytes = chunk_bytes
    with pytest.raises(ProtocolError, match="chunk size"):
        validate_plan(valid_plan)


@pytest.mark.parametrize("chunk_bytes", [1, MAX_CHUNK_BYTES])
def test_validate_plan_accepts_the_chunk_size_bounds(chunk_bytes):
    plan, *_ = make_plan(ABC, chunk_bytes=chunk_bytes)
    assert len(plan.chunk_digests) == math.ceil(392 / chunk_bytes)
    validate_plan(plan)


def test_validate_plan_rejects_a_chunk_size_changed_without_the_chunk_digests(valid_plan):
    valid_plan.chunk_bytes = 64
    with pytest.raises(ProtocolError, match="plan lists 4 chunk digests for its 7 chunks"):
        validate_plan(valid_plan)


@pytest.mark.parametrize(
    ("edit", "count"),
    [(lambda d: d.append("0" * 32), 5), (lambda d: d.pop(), 3), (lambda d: d.__delitem__(slice(None)), 0)],
    ids=["one too many", "one missing", "none"],
)
def test_validate_plan_rejects_a_wrong_number_of_chunk_digests(valid_plan, edit, count):
    edit(valid_plan.chunk_digests)
    with pytest.raises(ProtocolError, match=f"plan lists {count} chunk digests for its 4 chunks"):
        validate_plan(valid_plan)


def test_validate_plan_rejects_an_empty_variable_whose_digest_is_not_that_of_no_bytes():
    plan, *_ = make_plan({"a": np.arange(3, dtype=np.uint8), "e": np.zeros((0, 2), np.float32)})
    validate_plan(plan)
    assert plan.variables[1].digest == xxhash.xxh3_128_hexdigest(b"")
    plan.variables[1].digest = "f" * 32
    empty = xxhash.xxh3_128_hexdigest(b"")
    with pytest.raises(ProtocolError, match=f"'e': an empty variable's digest must be {empty}, not 'f+'"):
        validate_plan(reseal(plan))


def test_validate_plan_rejects_a_tampered_manifest_digest(valid_plan):
    valid_plan.manifest_digest = "0" * 32
    with pytest.raises(ProtocolError, match="manifest digest"):
        validate_plan(valid_plan)


def test_validate_plan_rejects_a_variable_digest_changed_without_the_manifest(valid_plan):
    valid_plan.variables[1].digest = "f" * 32
    with pytest.raises(ProtocolError, match="manifest digest"):
        validate_plan(valid_plan)


def test_validate_plan_rejects_a_renamed_variable_without_the_manifest(valid_plan):
    valid_plan.variables[1].name = "b2"
    with pytest.raises(ProtocolError, match="manifest digest"):
        validate_plan(valid_plan)


@pytest.mark.parametrize("field", ["synchronization", "aggregation"])
def test_validate_plan_rejects_an_unknown_variable_mode(valid_plan, field):
    setattr(valid_plan.variables[0], field, "SOMETIMES")
    with pytest.raises(ProtocolError):
        validate_plan(reseal(valid_plan))


# --- Chunker + Receiver: honest streams --------------------------------------------------------


def test_stream_round_trip_reproduces_the_chief_arena_byte_for_byte():
    plan, arena, _, _ = make_plan(small_arrays(), chunk_bytes=1000)
    out = receive(plan, stream(plan, arena))
    assert out.tobytes() == arena.tobytes()
    for v, a in zip(plan.variables, small_arrays().values(), strict=True):
        assert var_bytes(out, v) == np.ascontiguousarray(a).tobytes()


def test_receiver_reports_bytes_received_and_variables_verified(abc):
    plan, _, chunks = abc
    r = Receiver(plan, worker_arena(plan))
    # A variable is verified once its last byte is in a verified chunk: a (ends at 100) with
    # chunk 0; b (ends at 328) only with chunk 2, not chunk 1; c (ends at 392) with chunk 3.
    progress = [(r.bytes_received, r.variables_verified)]
    for c in chunks:
        r.accept(c)
        progress.append((r.bytes_received, r.variables_verified))
    assert progress == [(0, 0), (128, 1), (256, 1), (384, 2), (392, 3), (392, 3)]
    r.finish()


def test_receiver_does_not_count_a_chunk_that_failed_its_check(abc):
    plan, _, chunks = abc
    r = Receiver(plan, worker_arena(plan))
    r.accept(chunks[0])
    flip(chunks[1], 0)
    with pytest.raises(IntegrityError):
        r.accept(chunks[1])
    assert (r.bytes_received, r.variables_verified, len(r.digests)) == (128, 1, 1)


def test_chunker_lays_out_the_expected_frames(abc):
    plan, _, chunks = abc
    ka, kb, kc = (v.instance_key for v in plan.variables)
    assert [c.offset for c in chunks] == [0, 128, 256, 384, 392]
    assert [len(c.data) for c in chunks] == [128, 128, 128, 8, 0]
    assert [list(c.instance_keys) for c in chunks] == [[ka], [kb], [kb], [kc], []]
    assert [c.digest for c in chunks] == [*plan.chunk_digests, ""]
    assert [c.HasField("end") for c in chunks] == [False, False, False, False, True]
    assert chunks[-1].end.total_bytes == plan.total_bytes
    assert chunks[-1].end.manifest_digest == plan.manifest_digest
    assert all(c.group_key == GROUP_KEY_START for c in chunks)
    assert len(Chunker(plan, np.zeros(plan.total_bytes, np.uint8))) == len(chunks)


def test_every_data_message_carries_the_digest_of_its_bytes(abc):
    plan, _, chunks = abc
    assert [c.digest for c in chunks[:-1]] == [xxhash.xxh3_128_hexdigest(c.data) for c in chunks[:-1]]
    assert chunks[-1].digest == "" and chunks[-1].data == b""


def test_receiver_lists_the_verified_chunk_digests_in_order(abc):
    plan, _, chunks = abc
    r = Receiver(plan, worker_arena(plan))
    for i, c in enumerate(chunks[:-1]):
        r.accept(c)
        assert r.digests == list(plan.chunk_digests[: i + 1])
    r.accept(chunks[-1])  # the end message has no bytes, hence no digest
    r.finish()
    assert r.digests == list(plan.chunk_digests)


def test_many_small_variables_fuse_into_few_chunks_with_one_digest_each():
    arrays = {f"v{i}": np.full(100, i % 256, np.uint8) for i in range(500)}
    plan, arena, _, _ = make_plan(arrays, chunk_bytes=16 * 1024)
    assert plan.total_bytes == 499 * 128 + 100
    chunks = stream(plan, arena)
    data = [c for c in chunks if c.data]
    assert len(data) == 4 == len(plan.chunk_digests)
    assert len(chunks) == len(data) + 1 and not chunks[-1].data and chunks[-1].HasField("end")
    assert sum(len(c.instance_keys) for c in data) == 500
    assert [c.digest for c in data] == list(plan.chunk_digests)
    # Nothing per variable is left on the wire but the instance keys: no trailers, and far
    # fewer bytes than one 32-character digest per variable.
    fields = {"offset", "data", "group_key", "instance_keys", "end", "digest"}
    assert set(pb.Chunk.DESCRIPTOR.fields_by_name) == fields
    overhead = sum(len(c.SerializeToString()) - len(c.data) for c in chunks)
    assert overhead < 500 * 8
    out = receive(plan, chunks)
    assert out.tobytes() == arena.tobytes()


def test_a_flipped_bit_in_a_fused_chunk_names_its_variable():
    arrays = {f"v{i}": np.full(100, i % 256, np.uint8) for i in range(500)}
    plan, arena, _, _ = make_plan(arrays, chunk_bytes=16 * 1024)
    chunks = stream(plan, arena)
    v321 = plan.variables[321]
    assert v321.offset == 321 * 128 and v321.offset // (16 * 1024) == 2
    flip(chunks[2], v321.offset - 2 * 16 * 1024 + 50)
    expect_reject(
        plan, chunks, IntegrityError, f"variable 'v321': digest of received bytes .* differs from the chief's {v321.digest}"
    )


def test_one_large_variable_spans_ceil_total_over_chunk_size_chunks():
    big = np.arange(100_003, dtype=np.uint8)
    plan, arena, _, _ = make_plan({"big": big}, chunk_bytes=4096)
    chunks = stream(plan, arena)
    assert len(chunks) == math.ceil(100_003 / 4096) + 1 == 26
    assert all(list(c.instance_keys) == [plan.variables[0].instance_key] for c in chunks[:-1])
    assert len(plan.chunk_digests) == 25
    assert [c.digest for c in chunks] == [xxhash.xxh3_128_hexdigest(c.data) for c in chunks[:-1]] + [""]
    assert len(chunks[-2].data) == 100_003 - 24 * 4096
    assert var_bytes(receive(plan, chunks), plan.variables[0]) == big.tobytes()


@pytest.mark.parametrize(
    ("chunk", "match"),
    [
        (10, r"variable 'big': its bytes 40960\.\.45056 \(in the chunk at offset 40960\) differ from the chief's"),
        (24, "variable 'big': digest of received bytes .* differs from the chief's"),
    ],
)
def test_a_flipped_bit_in_a_large_variable_names_it(chunk, match):
    big = np.arange(100_003, dtype=np.uint8)
    plan, arena, _, _ = make_plan({"big": big}, chunk_bytes=4096)
    chunks = stream(plan, arena)
    flip(chunks[chunk], 7)
    r = Receiver(plan, worker_arena(plan))
    for c in chunks[:chunk]:
        r.accept(c)
    with pytest.raises(IntegrityError, match=match):
        r.accept(chunks[chunk])


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 100, 128, 391, 392, 393, MAX_CHUNK_BYTES])
def test_stream_count_is_ceil_total_over_chunk_size_plus_the_end_message(chunk_bytes):
    plan, arena, _, _ = make_plan(ABC, chunk_bytes=chunk_bytes)
    chunks = stream(plan, arena)
    assert len(chunks) == math.ceil(plan.total_bytes / chunk_bytes) + 1 == len(plan.chunk_digests) + 1
    assert receive(plan, chunks).tobytes() == arena.tobytes()


def test_zero_size_and_0d_variables_round_trip():
    arrays = {
        "empty_first": np.zeros((0,), np.float32),
        "scalar": np.array(2.5, ">f8"),
        "empty_mid": np.zeros((3, 0), np.int64),
        "vec": np.arange(5, dtype=np.int16),
        "empty_last": np.zeros((0, 0, 2), np.complex64),
    }
    plan, arena, _, _ = make_plan(arrays, chunk_bytes=16)
    chunks = stream(plan, arena)
    empty = [v for v in plan.variables if v.nbytes == 0]
    assert [v.name for v in empty] == ["empty_first", "empty_mid", "empty_last"]
    assert all(v.digest == xxhash.xxh3_128_hexdigest(b"") for v in empty)
    assert not {v.instance_key for v in empty} & {k for c in chunks for k in c.instance_keys}
    assert {k for c in chunks for k in c.instance_keys} == {v.instance_key for v in plan.variables if v.nbytes}
    out = worker_arena(plan)
    r = Receiver(plan, out)
    for c in chunks:
        r.accept(c)
    r.finish()
    assert r.variables_verified == 5
    assert out.tobytes() == arena.tobytes()
    for v, a in zip(plan.variables, arrays.values(), strict=True):
        assert var_bytes(out, v) == a.tobytes()


def test_a_model_of_only_empty_variables_is_one_end_message_without_digests():
    plan, arena, _, _ = make_plan({"e1": np.zeros(0), "e2": np.zeros((0, 4))})
    chunks = stream(plan, arena)
    assert plan.total_bytes == 0 and list(plan.chunk_digests) == []
    assert len(chunks) == 1 and chunks[0].HasField("end") and chunks[0].digest == ""
    r = Receiver(plan, worker_arena(plan))
    with pytest.raises(IntegrityError, match="ended without its end message"):
        r.finish()  # the empty variables are verified trivially, but the end is still required
    r.accept(chunks[0])
    r.finish()
    assert r.variables_verified == 2 and r.digests == []


def test_an_empty_model_streams_a_single_end_message_of_total_zero():
    plan = empty_plan()
    chunks = stream(plan, np.zeros(0, np.uint8))
    assert len(chunks) == 1
    assert chunks[0].HasField("end") and chunks[0].end.total_bytes == 0 and not chunks[0].data
    assert receive(plan, chunks).size == 0


def test_an_empty_model_stream_without_its_end_message_ended_early():
    plan = empty_plan()
    with pytest.raises(IntegrityError, match="ended without its end message"):
        Receiver(plan, np.zeros(0, np.uint8)).finish()


def test_the_stream_survives_protobuf_serialization():
    plan, arena, _, _ = make_plan(small_arrays(), chunk_bytes=333)
    plan = pb.Plan.FromString(plan.SerializeToString())
    chunks = [pb.Chunk.FromString(c.SerializeToString()) for c in stream(plan, arena)]
    assert receive(plan, chunks).tobytes() == arena.tobytes()


def test_one_chunker_serves_several_receivers_identically(abc):
    plan, arena, _ = abc
    chunker = Chunker(plan, arena)
    first, second = list(chunker.chunks()), list(chunker.chunks())
    assert [c.SerializeToString() for c in first] == [c.SerializeToString() for c in second]


def test_bytes_placed_in_the_arena_are_checked_like_bytes_in_the_message(abc):
    """The MPI path: messages without bytes, each chunk written through ``view`` first."""
    plan, arena, _ = abc
    raw = arena.tobytes()
    out = worker_arena(plan)
    r = Receiver(plan, out)
    for msg, start, end in frame_messages(plan):
        assert not msg.data
        r.view(start, end - start)[:] = np.frombuffer(raw[start:end], np.uint8)
        r.accept(msg, placed=True)
    r.finish()
    assert out.tobytes() == raw and r.digests == list(plan.chunk_digests)

    r = Receiver(plan, worker_arena(plan))
    msg, start, end = next(frame_messages(plan))
    r.view(start, end - start)[:] = np.frombuffer(raw[start:end], np.uint8) ^ np.uint8(1)
    with pytest.raises(IntegrityError, match="variable 'a': digest of received bytes"):
        r.accept(msg, placed=True)


# --- Receiver: rejected streams ----------------------------------------------------------------


def test_receiver_rejects_an_unknown_instance_key(abc):
    plan, _, chunks = abc
    chunks[0].instance_keys.append(99)
    expect_reject(plan, chunks, ProtocolError, "instance key 99, not in the plan")


def test_receiver_rejects_an_unknown_group_key(abc):
    plan, _, chunks = abc
    chunks[1].group_key = 999
    expect_reject(plan, chunks, ProtocolError, "offset 128 has group key 999, not in the plan")


def test_receiver_rejects_a_chunk_that_skips_ahead(abc):
    plan, _, chunks = abc
    expect_reject(plan, chunks[1:], ProtocolError, "offset 128 arrived where offset 0 was expected")


def test_receiver_rejects_a_repeated_chunk(abc):
    plan, _, chunks = abc
    expect_reject(plan, [chunks[0], chunks[0]], ProtocolError, "offset 0 arrived where offset 128")


def test_receiver_rejects_chunks_out_of_order(abc):
    plan, _, chunks = abc
    swapped = [chunks[0], chunks[2], chunks[1], *chunks[3:]]
    expect_reject(plan, swapped, ProtocolError, "offset 256 arrived where offset 128 was expected")


def test_receiver_rejects_an_offset_that_is_not_a_chunk_boundary(abc):
    plan, _, chunks = abc
    chunks[0].offset = 1
    expect_reject(plan, chunks, ProtocolError, "offset 1 arrived where offset 0")


@pytest.mark.parametrize("delta", [-1, +1])
def test_receiver_rejects_a_chunk_of_the_wrong_length(abc, delta):
    plan, _, chunks = abc
    chunks[1].data = chunks[1].data[:-1] if delta < 0 else chunks[1].data + b"\0"
    expect_reject(plan, chunks, IntegrityError, f"offset 128 has {128 + delta} bytes; the plan says 128")


def test_receiver_rejects_data_on_the_end_message(abc):
    plan, _, chunks = abc
    chunks[-1].data = b"x"
    expect_reject(plan, chunks, IntegrityError, "has 1 bytes; the plan says 0")


def test_receiver_rejects_instance_keys_that_do_not_match_the_plan_for_that_offset(abc):
    plan, _, chunks = abc
    ka, kb, _ = (v.instance_key for v in plan.variables)
    chunks[1].instance_keys[:] = [ka]  # a known key, but 'a' has no bytes at offset 128
    expect_reject(plan, chunks, ProtocolError, rf"names instance keys \[{ka}\]; the plan puts \[{kb}\]")


def test_receiver_rejects_a_chunk_that_omits_its_instance_keys(abc):
    plan, _, chunks = abc
    del chunks[2].instance_keys[:]
    expect_reject(plan, chunks, ProtocolError, "the plan puts")


def test_receiver_rejects_a_forged_digest_field_on_intact_bytes(abc):
    plan, _, chunks = abc
    chunks[1].digest = "0" * 32
    expect_reject(
        plan, chunks, IntegrityError,
        f"chunk at offset 128: its trailer says digest {'0' * 32}, "
        f"the plan and the received bytes say {plan.chunk_digests[1]}",
    )


def test_receiver_rejects_the_digest_of_another_chunk(abc):
    plan, _, chunks = abc
    chunks[2].digest = chunks[1].digest
    expect_reject(
        plan, chunks, IntegrityError, f"chunk at offset 256: its trailer says digest {plan.chunk_digests[1]}"
    )


def test_receiver_rejects_a_message_without_its_digest(abc):
    plan, _, chunks = abc
    chunks[3].ClearField("digest")
    expect_reject(plan, chunks, IntegrityError, r"chunk at offset 384: its trailer says digest \(none\)")


def test_receiver_rejects_a_stream_whose_digests_were_dropped(abc):
    plan, _, chunks = abc
    for c in chunks:
        c.ClearField("digest")
    expect_reject(plan, chunks, IntegrityError, r"chunk at offset 0: its trailer says digest \(none\)")


# Flipping byte len/3 of each chunk: chunk 1 holds b's first 128 bytes only, so b cannot be
# hashed yet and its byte range is named; chunk 2 holds b's last byte, so b's digest is compared.
@pytest.mark.parametrize(
    ("chunk", "name", "whole"), [(0, "a", True), (1, "b", False), (2, "b", True), (3, "c", True)]
)
def test_receiver_names_the_variable_whose_bytes_have_a_flipped_bit(abc, chunk, name, whole):
    plan, _, chunks = abc
    flip(chunks[chunk], len(chunks[chunk].data) // 3)
    chief = next(v.digest for v in plan.variables if v.name == name)
    if whole:
        match = f"variable '{name}': digest of received bytes [0-9a-f]{{32}} differs from the chief's {chief}$"
    else:
        want = plan.chunk_digests[chunk]
        match = (rf"variable '{name}': its bytes 0\.\.128 \(in the chunk at offset 128\) differ from the chief's: "
                 rf"chunk digest [0-9a-f]{{32}}, the chief's {want}$")
    expect_reject(plan, chunks, IntegrityError, match)


@pytest.mark.parametrize(("at", "span"), [(110, "0..128"), (356, "256..384")])
def test_receiver_names_the_padding_when_only_padding_differs(abc, at, span):
    """Bytes 100..128 (after a) and 328..384 (after b) belong to no variable."""
    plan, _, chunks = abc
    flip(chunks[at // 128], at % 128)
    expect_reject(plan, chunks, IntegrityError, f"the padding between variables in bytes {span} differs from the chief's")


def test_receiver_checks_received_bytes_against_the_plan_not_only_the_trailer(abc):
    plan, _, chunks = abc
    forged = bytes(b ^ 0xFF for b in chunks[0].data)
    chunks[0].data = forged
    chunks[0].digest = xxhash.xxh3_128_hexdigest(forged)  # a trailer that matches the forged bytes
    got = xxhash.xxh3_128_hexdigest(forged[: plan.variables[0].nbytes])
    expect_reject(
        plan, chunks, IntegrityError,
        f"variable 'a': digest of received bytes {got} differs from the chief's {plan.variables[0].digest}",
    )


def test_receiver_checks_a_forged_chunk_inside_a_variable_against_the_plan(abc):
    plan, _, chunks = abc
    chunks[1].data = bytes(128)
    chunks[1].digest = xxhash.xxh3_128_hexdigest(bytes(128))
    expect_reject(plan, chunks, IntegrityError, r"variable 'b': its bytes 0\.\.128 \(in the chunk at offset 128\)")


def test_receiver_rejects_a_message_after_the_end(abc):
    plan, _, chunks = abc
    r = Receiver(plan, worker_arena(plan))
    for c in chunks:
        r.accept(c)
    with pytest.raises(ProtocolError, match="after the end of the stream"):
        r.accept(chunks[-1])


@pytest.mark.parametrize(
    ("kept", "received", "unverified", "first"), [(0, 0, 3, "a"), (1, 128, 2, "b"), (2, 256, 2, "b"), (3, 384, 1, "c")]
)
def test_a_truncated_stream_ended_early(abc, kept, received, unverified, first):
    plan, _, chunks = abc
    r = Receiver(plan, worker_arena(plan))
    for c in chunks[:kept]:
        r.accept(c)
    with pytest.raises(
        IntegrityError,
        match=rf"stream ended early: {received} of 392 bytes, {unverified} variable\(s\) unverified \(first: {first}\)",
    ):
        r.finish()


def test_a_stream_without_its_end_message_is_not_complete(abc):
    plan, _, chunks = abc
    r = Receiver(plan, worker_arena(plan))
    for c in chunks[:-1]:
        r.accept(c)
    assert (r.bytes_received, r.variables_verified) == (392, 3)
    with pytest.raises(IntegrityError, match="stream ended without its end message .* after all 392 bytes"):
        r.finish()


def test_receiver_rejects_an_end_with_the_wrong_total(abc):
    plan, _, chunks = abc
    chunks[-1].end.total_bytes += 64
    expect_reject(plan, chunks, IntegrityError, "stream end claims 456 bytes after 392 received; the plan has 392")


def test_receiver_rejects_an_end_before_the_last_byte(abc):
    plan, _, chunks = abc
    chunks[1].end.total_bytes = plan.total_bytes
    chunks[1].end.manifest_digest = plan.manifest_digest
    expect_reject(plan, chunks, IntegrityError, "stream end claims 392 bytes after 256 received; the plan has 392")


def test_receiver_rejects_an_end_with_the_wrong_manifest(abc):
    plan, _, chunks = abc
    chunks[-1].end.manifest_digest = "0" * 32
    expect_reject(plan, chunks, IntegrityError, "manifest digest that differs from the plan's")


def test_receiver_rejects_a_digest_on_a_message_without_bytes(abc):
    plan, _, chunks = abc
    chunks[-1].digest = "junk"
    expect_reject(plan, chunks, ProtocolError, "message at offset 392 has no bytes but claims digest junk")


def test_a_plan_cut_into_pieces_joins_back_to_the_same_plan():
    plan, *_ = make_plan(small_arrays())
    data = plan.SerializeToString()
    pieces = list(to_pieces(data, piece_bytes=100))
    assert len(pieces) == -(-len(data) // 100) and all(len(p.data) <= 100 for p in pieces)
    assert from_pieces(pb.Plan, pieces, "chief at x") == plan
    assert from_pieces(pb.Plan, list(to_pieces(data)), "chief at x") == plan  # one piece
    assert from_pieces(pb.ReadyRequest, to_pieces(b""), "w") == pb.ReadyRequest()  # an empty message: one piece


@pytest.mark.parametrize(
    ("damage", "says"),
    [(lambda ps: ps[:-1], "chief at x sent 1700 bytes of a Plan of 1736 bytes in 17 piece(s)"),
     (lambda ps: [], "chief at x sent 0 bytes of a Plan of ? bytes in 0 piece(s)"),
     (lambda ps: [*ps, ps[-1]], "chief at x sent a Plan in pieces that claim 1736 bytes after 1736"),
     (lambda ps: [pb.Piece(data=b"x", total_bytes=2**40)], "claim 1099511627776 bytes after 1099511627776 (at most 1073741824)"),
     (lambda ps: [pb.Piece(data=b"\xff" * 8, total_bytes=8)], "chief at x sent 8 bytes that are not a Plan")],
)
def test_missing_extra_or_garbled_pieces_are_a_protocol_error_naming_the_sender(damage, says):
    plan, *_ = make_plan(small_arrays())
    pieces = damage(list(to_pieces(plan.SerializeToString(), piece_bytes=100)))
    with pytest.raises(ProtocolError) as info:
        from_pieces(pb.Plan, pieces, "chief at x")
    assert says in str(info.value)


# --- a provisional plan: the digests follow the stream (served from files) -------------------


@pytest.fixture
def follow():
    """The abc model's provisional plan (no digests), its complete plan and the chief's arena."""
    specs, arena, digests = materialize(ArraySource(dict(ABC)))
    provisional = build_plan(specs, None, [W0], arena=arena, chunk_bytes=128, chief_incarnation="x", model="test")
    complete = complete_plan(provisional, digests, chunk_digests(arena, 128))
    return provisional, complete, arena


def test_a_provisional_plan_is_valid_without_digests_and_completes_to_the_plan_with_them(follow):
    provisional, complete, arena = follow
    validate_plan(provisional)
    assert provisional.digests_follow and not provisional.manifest_digest and not provisional.chunk_digests
    assert [v.digest for v in provisional.variables] == ["", "", ""]
    full, _, _, _ = make_plan(ABC, chunk_bytes=128)
    validate_plan(complete)
    assert complete == full  # filled in, the provisional plan is the plan built with the digests
    check_completes(provisional, complete)


def test_a_provisional_plan_that_carries_digests_is_refused(follow):
    provisional, complete, _ = follow
    provisional.variables[1].digest = complete.variables[1].digest
    with pytest.raises(ProtocolError, match="says its digests follow, yet carries some"):
        validate_plan(provisional)


def test_a_complete_plan_with_another_layout_is_refused(follow):
    provisional, complete, _ = follow
    complete.variables[2].offset += 64
    with pytest.raises(ProtocolError, match="does not lay out the bytes as the provisional plan"):
        check_completes(provisional, complete)


def test_the_chunker_of_a_provisional_plan_sends_each_chunks_digest_as_its_trailer(follow):
    provisional, complete, arena = follow
    chunks = stream(provisional, arena)
    assert [c.digest for c in chunks if c.data] == list(complete.chunk_digests)
    out = worker_arena(provisional)
    r = Receiver(provisional, out)
    for c in chunks:
        r.accept(c)
    r.finish()
    r.complete(complete)
    assert r.plan is complete and out.tobytes() == arena.tobytes()


def test_a_relays_chunker_sends_the_digests_it_verified_once_the_bytes_landed(follow):
    provisional, complete, arena = follow
    known, landed = ["k0", "k1"], []
    frames = Chunker(provisional, arena, known).frames(0, landed.append)
    got = [(m.offset, m.digest) for m, _ in frames]
    # The two known digests are sent as they are; the rest are hashed, each after landed(its index).
    assert got == [(0, "k0"), (128, "k1"), (256, complete.chunk_digests[2]), (384, complete.chunk_digests[3]),
                   (392, "")]
    assert landed == [0, 1, 2, 3]


def test_under_a_provisional_plan_a_chunk_without_its_trailer_is_refused(follow):
    provisional, _, arena = follow
    chunks = stream(provisional, arena)
    chunks[2].ClearField("digest")
    expect_reject(provisional, chunks, ProtocolError, "chunk at offset 256 has no digest trailer")


def test_under_a_provisional_plan_bytes_that_differ_from_their_trailer_name_the_variables(follow):
    provisional, _, arena = follow
    chunks = stream(provisional, arena)
    flip(chunks[1], 5)
    expect_reject(provisional, chunks, IntegrityError,
                  r"chunk at offset 128 \(bytes of 'b'\): digest of received bytes [0-9a-f]{32} differs from its trailer")


def test_bytes_with_a_forged_trailer_pass_the_stream_and_fail_against_the_chiefs_digests(follow):
    """A sender that changes bytes and hashes them again (a lying relay) passes every trailer;
    the chief's digests, which follow, name the variable."""
    provisional, complete, arena = follow
    chunks = stream(provisional, arena)
    flip(chunks[3], 2)
    chunks[3].digest = xxhash.xxh3_128_hexdigest(chunks[3].data)
    r = Receiver(provisional, worker_arena(provisional))
    for c in chunks:
        r.accept(c)
    r.finish()
    c_digest = complete.variables[2].digest
    with pytest.raises(IntegrityError, match=f"variable 'c': digest of received bytes [0-9a-f]{{32}} differs from "
                                             f"the chief's {c_digest}"):
        r.complete(complete)


def test_a_receiver_with_the_complete_plan_takes_the_stream_of_a_provisional_sender(follow):
    """A worker that restarted after the digests came resumes from a relay that still holds the
    provisional plan: the trailers are the same digests; the end carries no manifest."""
    provisional, complete, arena = follow
    assert receive(complete, stream(provisional, arena)).tobytes() == arena.tobytes()


def _mappings() -> dict[int, dict]:
    """This process's mappings by start address: their Rss, AnonHugePages (bytes) and VmFlags."""
    out, cur = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = out[lo] = {"size": hi - lo}
            elif head in ("Rss:", "AnonHugePages:"):
                cur[head[:-1]] = int(rest.split()[0]) * 1024
            elif head == "VmFlags:":
                cur["flags"] = rest.split()
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize("slow", [False, True], ids=["warm", "cold"])
def test_a_receive_arena_has_every_page_in_place_before_the_stream(monkeypatch, slow):
    # One allocator for the broadcast's, the fetch's and a holder's arenas: no page is faulted
    # in between two chunks of a stream. "cold": huge pages slower than small ones populated
    # in one call (a VM's host touching fresh memory): after the first segment the rest of the
    # arena takes small pages (no huge-page hint), every one still in place.
    from collective import arena as arenas
    from collective.arena import new_arena

    monkeypatch.setattr(arenas, "SEGMENT", 4 << 20)
    monkeypatch.setattr(arenas, "SEGMENT_SLOW", -1.0 if slow else 1e9)  # never by chance on a loaded machine
    arena = new_arena(12 << 20)
    assert (arena.size, arena.dtype, arena.flags.writeable) == (12 << 20, np.uint8, True)
    maps = _mappings()
    start = arena.ctypes.data
    first = maps[start]
    assert first["Rss"] == first["size"], first  # every page resident, none written since
    if slow:
        assert first["size"] == 4 << 20 and "hg" in first["flags"], first
        rest = maps[start + (4 << 20)]
        assert (rest["size"], rest["Rss"], rest["AnonHugePages"]) == (8 << 20, 8 << 20, 0), rest
        assert "nh" in rest["flags"], rest
    else:
        assert first["size"] == 12 << 20 and "hg" in first["flags"], first
    arena[:] = 7
    assert new_arena(0).size == 0


def test_other_threads_run_while_an_arena_s_pages_are_populated(monkeypatch):
    # A worker's heartbeat thread runs while its arena's pages are put in place. mmap.madvise
    # holds the GIL for the whole call: one MADV_POPULATE_WRITE call for a 4 GiB arena held it
    # 37.7 s beside three CPU-bound processes, and the chief declared the worker lost (no
    # heartbeat for 17.5 s, lease 15 s). Counted in turns, not seconds: with a tiny switch
    # interval, the other thread gets a turn whenever the populating thread lets the GIL go.
    import sys
    import threading

    from collective import arena as arenas
    from collective.arena import new_arena

    monkeypatch.setattr(arenas, "SEGMENT", 4 << 20)
    monkeypatch.setattr(arenas, "SEGMENT_SLOW", -1.0)  # after the first segment: populated by the kernel
    monkeypatch.setattr(arenas, "POPULATE_STEP", 1 << 20)
    turns, done = [0], threading.Event()

    def other() -> None:
        while not done.is_set():
            turns[0] += 1
            time.sleep(0)  # lets the GIL go, and asks for it again

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    try:
        before = turns[0]
        arena = new_arena(512 << 20)
        during = turns[0] - before
    finally:
        done.set()
        sys.setswitchinterval(interval)
        thread.join(30)
    steps = 512 - 4  # populate calls of 1 MiB after the first segment
    assert during >= steps // 10, f"another thread ran {during} times while {steps} steps of pages were populated"
    assert arena.size == 512 << 20
