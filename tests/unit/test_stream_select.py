"""A Receiver fed by several streams, each a selection of the chunks (``Select``): a double
tree's two halves, or a fetch striped over k holders; a sender that sends only its selection."""

from __future__ import annotations

import numpy as np
import pytest

from collective._proto import collective_pb2 as pb
from collective.errors import IntegrityError, ProtocolError
from collective.plan import Chunker, Receiver, Select, with_bytes
from tests.unit.test_plan import make_plan, worker_arena

ARRAYS = {"w": np.arange(40_000, dtype=np.uint8), "b": np.arange(100, dtype=np.float32)}  # 10 chunks of 4 KiB


def chunks(plan, arena, select: Select) -> list[pb.Chunk]:
    return list(with_bytes(Chunker(plan, arena).frames(select=select)))


def test_a_sender_sends_only_the_selected_chunks_then_the_end():
    plan, arena, _, _ = make_plan(ARRAYS)
    n = -(-plan.total_bytes // plan.chunk_bytes)
    for k in (2, 3):
        for j in range(k):
            got = chunks(plan, arena, Select(k, j))
            assert [c.offset for c in got[:-1]] == [i * plan.chunk_bytes for i in range(j, n, k)]
            assert got[-1].HasField("end") and got[-1].offset == plan.total_bytes


@pytest.mark.parametrize("k", [2, 3])
def test_streams_of_k_selections_interleaved_fill_the_arena_bit_exact(k):
    plan, arena, _, _ = make_plan(ARRAYS)
    out = worker_arena(plan)
    r = Receiver(plan, out)
    parts = [r.part(Select(k, j)) for j in range(k)]
    streams = [chunks(plan, arena, Select(k, j)) for j in range(k)]
    # the last selection first, then round robin: chunks land out of order
    for step in range(max(map(len, streams))):
        for j in reversed(range(k)):
            if step < len(streams[j]):
                parts[j].accept(streams[j][step])
    r.finish()
    assert out.tobytes() == arena.reshape(-1).view(np.uint8)[: plan.total_bytes].tobytes()
    assert r.digests == list(plan.chunk_digests) and r.bytes_received == plan.total_bytes


def test_a_chunk_lands_only_once_verified_and_a_stream_resumes_at_its_first_missing_chunk():
    plan, arena, _, _ = make_plan(ARRAYS)
    r = Receiver(plan, worker_arena(plan))
    b = r.part(Select(2, 1))
    odd = chunks(plan, arena, Select(2, 1))
    b.accept(odd[0])  # chunk 1
    assert r.landed(1) and not r.landed(0) and b.resume_from == 3 * plan.chunk_bytes
    assert r.variables_verified == 0  # chunk 0 is missing: nothing verified from the start
    bad = pb.Chunk()
    bad.CopyFrom(odd[1])
    bad.data = bytes([bad.data[0] ^ 1]) + bad.data[1:]
    with pytest.raises(IntegrityError, match="differ"):
        b.accept(bad)
    assert not r.landed(3) and r.verified[3] == ""  # never forwarded by a relay (RelayHandler waits on landed)
    with pytest.raises(ProtocolError, match="arrived where offset 12288 was expected"):
        b.accept(odd[2])  # a chunk of this selection out of turn


def test_streams_that_end_without_every_chunk_are_never_taken_as_complete():
    plan, arena, _, _ = make_plan(ARRAYS)
    r = Receiver(plan, worker_arena(plan))
    a, b = r.part(Select(2, 0)), r.part(Select(2, 1))
    for c in chunks(plan, arena, Select(2, 0)):
        a.accept(c)
    with pytest.raises(IntegrityError, match="stream ended early"):
        r.finish()
    # an end message while chunks of the selection are missing is refused
    with pytest.raises(ProtocolError, match="was expected"):
        b.accept(chunks(plan, arena, Select(2, 1))[-1])


def test_a_relays_chunker_waits_for_each_selected_chunk_to_land_in_any_order():
    plan, arena, _, _ = make_plan(ARRAYS)
    asked = []
    frames = Chunker(plan, arena, known=[""] * 10).frames(0, asked.append, Select(2, 1))
    assert [m.offset for m, _ in frames][:-1] == [i * plan.chunk_bytes for i in asked] and asked == [1, 3, 5, 7, 9]


def test_a_request_asking_for_a_phase_beyond_its_stride_is_refused():
    with pytest.raises(ProtocolError, match="chunk phase 2 of stride 2"):
        Select.of(pb.WorkerRef(chunk_stride=2, chunk_phase=2))
    assert Select.of(pb.WorkerRef()) == Select() and Select(2, 1).ask(pb.WorkerRef()).chunk_stride == 2
    # the whole stream leaves the fields unset: an older sender reads the request as before
    assert Select().ask(pb.WorkerRef()).ByteSize() == 0
