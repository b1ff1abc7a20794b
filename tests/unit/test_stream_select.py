"""A Receiver fed by several streams, each a selection of the chunks (``ChunkRange`` stride and
phase): a double tree's two halves; a sender that sends only its selection; selections within one
stripe of the stream (``Receiver(span=ChunkRange(start, stop), base=)``: a snapshot fetch's)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from collective._proto import collective_pb2 as pb
from collective.errors import IntegrityError, ProtocolError
from collective.plan import Chunker, ChunkRange, Lockstep, Receiver, sibling_streams, with_bytes
from collective.topology import dtree_parents
from tests.unit.test_plan import make_plan, worker_arena

ARRAYS = {"w": np.arange(40_000, dtype=np.uint8), "b": np.arange(100, dtype=np.float32)}  # 10 chunks of 4 KiB


def chunks(plan, arena, rng: ChunkRange) -> list[pb.Chunk]:
    return list(with_bytes(Chunker(plan, arena).frames(rng)))


def test_a_sender_sends_only_the_selected_chunks_then_the_end():
    plan, arena, _, _ = make_plan(ARRAYS)
    n = -(-plan.total_bytes // plan.chunk_bytes)
    for k in (2, 3):
        for j in range(k):
            got = chunks(plan, arena, ChunkRange(stride=k, phase=j))
            assert [c.offset for c in got[:-1]] == [i * plan.chunk_bytes for i in range(j, n, k)]
            assert got[-1].HasField("end") and got[-1].offset == plan.total_bytes


@pytest.mark.parametrize("k", [2, 3])
def test_streams_of_k_selections_interleaved_fill_the_arena_bit_exact(k):
    plan, arena, _, _ = make_plan(ARRAYS)
    out = worker_arena(plan)
    r = Receiver(plan, out)
    parts = [r.part(ChunkRange(stride=k, phase=j)) for j in range(k)]
    streams = [chunks(plan, arena, ChunkRange(stride=k, phase=j)) for j in range(k)]
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
    b = r.part(ChunkRange(stride=2, phase=1))
    odd = chunks(plan, arena, ChunkRange(stride=2, phase=1))
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
    a, b = r.part(ChunkRange(stride=2, phase=0)), r.part(ChunkRange(stride=2, phase=1))
    for c in chunks(plan, arena, ChunkRange(stride=2, phase=0)):
        a.accept(c)
    with pytest.raises(IntegrityError, match="stream ended early"):
        r.finish()
    # an end message while chunks of the selection are missing is refused
    with pytest.raises(ProtocolError, match="was expected"):
        b.accept(chunks(plan, arena, ChunkRange(stride=2, phase=1))[-1])


def test_a_relays_chunker_waits_for_each_selected_chunk_to_land_in_any_order():
    plan, arena, _, _ = make_plan(ARRAYS)
    asked = []
    frames = Chunker(plan, arena, known=[""] * 10).frames(ChunkRange(stride=2, phase=1), asked.append)
    assert [m.offset for m, _ in frames][:-1] == [i * plan.chunk_bytes for i in asked] and asked == [1, 3, 5, 7, 9]


def test_a_request_asking_for_a_phase_beyond_its_stride_is_refused():
    plan, _, _, _ = make_plan(ARRAYS)
    with pytest.raises(ProtocolError, match="chunk phase 2 of stride 2"):
        ChunkRange.of(pb.WorkerRef(chunk_stride=2, chunk_phase=2), plan)
    assert ChunkRange.of(pb.WorkerRef(), plan) == ChunkRange()
    assert ChunkRange(stride=2, phase=1).ask(pb.WorkerRef()).chunk_stride == 2
    # the whole stream leaves the fields unset: an older sender reads the request as before
    assert ChunkRange().ask(pb.WorkerRef()).ByteSize() == 0


@pytest.mark.parametrize("own", [False, True])
def test_selections_within_a_stripe_fill_its_span_and_end_at_its_stop(own):
    """One Receiver, two designs at once: the stripe 3..7 (chunks) received as two selections,
    into the whole arena or a buffer holding the stripe only (``base``)."""
    plan, arena, _, _ = make_plan(ARRAYS)
    size = plan.chunk_bytes
    a, b = 3 * size, 7 * size
    buf = np.zeros(b - a, np.uint8) if own else worker_arena(plan)
    r = Receiver(plan, buf, span=ChunkRange(a, b), base=a if own else 0)
    parts = [r.part(ChunkRange(stride=2, phase=j)) for j in (1, 0)]
    assert [p.resume_from for p in parts] == [3 * size, 4 * size]  # each from its first chunk in the span
    assert [p.range for p in parts] == [ChunkRange(a, b, 2, 1), ChunkRange(4 * size, b, 2, 0)]  # what each asks for
    streams = [list(with_bytes(Chunker(plan, arena).frames(p.range))) for p in parts]
    assert [[c.offset // size for c in s[:-1]] for s in streams] == [[3, 5], [4, 6]]
    assert all(s[-1].end.total_bytes == b for s in streams)  # each ends with the stripe's end message
    parts[1].accept(streams[1][0])  # chunk 4 before 3: landed, but not yet verified from the start
    assert r.landed(4) and r.verified_to == a and r.digests == []
    for s, p in zip(streams, parts, strict=True):
        for c in s[1:] if p is parts[1] else s:
            p.accept(c)
    r.finish()
    want = arena.reshape(-1).view(np.uint8)[a:b]
    assert (buf if own else buf[a:b]).tobytes() == want.tobytes()
    assert r.verified_to == b and r.digests == list(plan.chunk_digests[3:7]) and r.bytes_received == b - a
    assert not r.landed(2) and not r.landed(7)


def test_a_stripes_part_whose_stream_stops_short_names_the_missing_chunk():
    plan, arena, _, _ = make_plan(ARRAYS)
    size = plan.chunk_bytes
    r = Receiver(plan, worker_arena(plan), span=ChunkRange(2 * size, 6 * size))
    a, b = r.part(ChunkRange(stride=2, phase=0)), r.part(ChunkRange(stride=2, phase=1))
    for c in with_bytes(Chunker(plan, arena).frames(a.range)):
        a.accept(c)
    b.accept(next(with_bytes(Chunker(plan, arena).frames(b.range))))  # chunk 3
    with pytest.raises(IntegrityError, match=f"stream ended early: {5 * size} of {6 * size} bytes"):
        r.finish()
    assert r.verified_to == 5 * size  # chunks 2, 3, 4 from the start; 5 never came


# --- Lockstep: a sender's selected streams kept in step (they race for one link) ----------------

def _paced(step: Lockstep, plan, arena, rng: ChunkRange, expected: int = 2):
    return Lockstep.frames(step, Chunker(plan, arena), rng, expected=expected)


def _pull(gen, got: list, chunk_bytes: int) -> threading.Thread:
    """Take every message from ``gen`` in a thread (a transport sending them), each chunk's
    index into ``got``; started, a daemon: the test joins it with a deadline."""
    def run() -> None:
        got.extend(msg.offset // chunk_bytes for msg, _ in gen if not msg.HasField("end"))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_selected_stream_waits_for_its_sibling_before_its_first_chunk_then_both_run_to_the_end():
    plan, arena, _, _ = make_plan(ARRAYS)
    step = Lockstep(hold=30.0)  # far beyond the test: only the sibling can release it
    a, b = [], []
    ta = _pull(_paced(step, plan, arena, ChunkRange(stride=2, phase=0)), a, plan.chunk_bytes)
    ta.join(0.3)
    assert a == []  # its sibling has not asked yet
    tb = _pull(_paced(step, plan, arena, ChunkRange(stride=2, phase=1)), b, plan.chunk_bytes)
    for t in (ta, tb):
        t.join(10)
        assert not t.is_alive()
    assert a == list(range(0, 10, 2)) and b == list(range(1, 10, 2))


def test_a_stream_runs_ahead_of_a_stuck_sibling_by_lead_chunks_only_then_for_hold_seconds_at_most():
    plan, arena, _, _ = make_plan(ARRAYS)
    step = Lockstep(lead=2, hold=1.0)
    a = []
    ta = _pull(_paced(step, plan, arena, ChunkRange(stride=2, phase=0)), a, plan.chunk_bytes)
    stuck = _paced(step, plan, arena, ChunkRange(stride=2, phase=1))
    next(stuck)  # chunk 1 taken; the transport never hands it over (a link held by the other stream)
    ta.join(0.3)
    assert a == [0, 2]  # chunk 4 waits for chunk 1 to be handed over
    ta.join(15)  # the sibling has not moved for hold seconds: not waited for any more
    assert not ta.is_alive() and a == list(range(0, 10, 2))
    stuck.close()  # a stream that ends leaves: nobody waits for it


def test_a_whole_stream_and_a_sender_with_one_selected_stream_never_wait():
    plan, arena, _, _ = make_plan(ARRAYS)
    step = Lockstep(hold=30.0)
    assert len(list(_paced(step, plan, arena, ChunkRange()))) == 11
    assert len(list(_paced(step, plan, arena, ChunkRange(stride=2, phase=0), expected=1))) == 6


def test_sibling_streams_counts_a_double_tree_senders_streams():
    a, b = dtree_parents(6)
    plan = pb.Plan(workers=[pb.WorkerInfo(worker_id=f"w{r}", rank=r, parent=a[r], parent_b=b[r]) for r in range(6)])

    def tree(t: int) -> ChunkRange:
        return ChunkRange(stride=2, phase=t)
    for r in range(6):
        for t, parents in enumerate((a, b)):  # a sender's streams: its children in both trees
            assert sibling_streams(plan, f"w{r}", tree(t)) == a.count(parents[r]) + b.count(parents[r]) <= 2
    root_a = a.index(-1)
    assert sibling_streams(plan, f"w{root_a}", tree(0)) == 2  # the chief: one root in each tree
    assert sibling_streams(plan, "w0", ChunkRange()) == 1  # the whole stream
    assert sibling_streams(plan, "nobody", tree(0)) == 1  # not in the plan
