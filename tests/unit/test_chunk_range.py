"""``ChunkRange``: which chunks a stream carries (start, stop, stride, phase), read from a
request by one check against the plan, and honoured alike by every sender: the chief, a
worker's relay and a snapshot holder (the wire's ``WorkerRef.resume_from``, ``stop_at``,
``chunk_stride``, ``chunk_phase``, each documented for every data stream)."""

from __future__ import annotations

import numpy as np
import pytest

from collective._proto import collective_pb2 as pb
from collective.errors import ProtocolError
from collective.plan import Chunker, ChunkRange, Receiver, with_bytes
from collective.snapshot import holder
from collective.worker.relay import RelayHandler
from tests.clusters import inmemory_cluster
from tests.unit.test_plan import make_plan

SIZE = 4096
ARRAYS = {"w": np.arange(40_000, dtype=np.uint8), "b": np.arange(100, dtype=np.float32)}  # 10 chunks, the last short


def _ref(start=0, stop=0, stride=0, phase=0, worker_id="w0") -> pb.WorkerRef:
    return pb.WorkerRef(worker_id=worker_id, resume_from=start, stop_at=stop, chunk_stride=stride, chunk_phase=phase)


def _plan():
    plan, arena, _, _ = make_plan(ARRAYS, chunk_bytes=SIZE)
    assert plan.total_bytes % SIZE and -(-plan.total_bytes // SIZE) == 10
    return plan, arena


def _bad(total: int) -> list[tuple]:
    """(start, stop, stride, phase) of requests that are no range of the plan's chunks."""
    return [
        (0, 0, 2, 2), (0, 0, 0, 1), (0, 0, 1, 1), (0, 0, 3, 7),  # a phase not below its stride
        (1, 0, 0, 0), (SIZE + 1, 0, 0, 0), (total - 1, 0, 0, 0),  # a start inside a chunk
        (total + 1, 0, 0, 0), (total + SIZE, 0, 0, 0), (10 * SIZE, 0, 0, 0),  # a start past the end
        (0, 1, 0, 0), (0, 2 * SIZE + 7, 0, 0),  # a stop inside a chunk
        (0, total, 0, 0), (0, total + 1, 0, 0), (0, 10 * SIZE, 0, 0),  # a stop at or past the end
        (3 * SIZE, 2 * SIZE, 0, 0), (total, SIZE, 0, 0),  # a stop before the start
        (SIZE, 5 * SIZE, 2, 2),  # a good stripe, a bad phase
    ]


def test_every_request_that_is_no_range_of_the_plans_chunks_is_refused_in_one_form():
    plan, _ = _plan()
    for start, stop, stride, phase in _bad(plan.total_bytes):
        with pytest.raises(ProtocolError, match=rf"stream request asks for bytes {start}\.\.{stop or plan.total_bytes}, "
                           rf"chunk phase {phase} of stride {stride or 1}: not a range of chunks of this "
                           rf"{plan.total_bytes}-byte stream \({SIZE}-byte chunks\)"):
            ChunkRange.of(_ref(start, stop, stride, phase), plan)


def _good(total: int) -> list[ChunkRange]:
    return [ChunkRange(), ChunkRange(3 * SIZE), ChunkRange(total), ChunkRange(9 * SIZE),  # a resume; the end; the last chunk
            ChunkRange(0, SIZE), ChunkRange(2 * SIZE, 6 * SIZE), ChunkRange(9 * SIZE - SIZE, 9 * SIZE),  # stripes
            ChunkRange(2 * SIZE, 2 * SIZE),  # an empty stripe: its end message only
            ChunkRange(stride=2, phase=1), ChunkRange(4 * SIZE, 0, 2, 0), ChunkRange(3 * SIZE, 8 * SIZE, 3, 2),
            ChunkRange(5 * SIZE, 0, 2, 0), ChunkRange(0, 0, 20, 19)]  # a start off its phase; a stride past the chunks


def test_a_range_written_into_a_request_reads_back_the_same_and_the_whole_stream_writes_nothing():
    plan, _ = _plan()
    for rng in _good(plan.total_bytes):
        assert ChunkRange.of(rng.ask(pb.WorkerRef(worker_id="w0")), plan) == rng
    assert ChunkRange().ask(pb.WorkerRef()).ByteSize() == 0  # an older sender reads the request as before
    assert ChunkRange.of(pb.WorkerRef(chunk_stride=1), plan) == ChunkRange.of(pb.WorkerRef(), plan) == ChunkRange()


def _expected(plan: pb.Plan, rng: ChunkRange) -> list[int]:
    """The offsets of the messages a stream of ``rng`` carries, from the rule itself: each chunk
    index from the start's to the stop's with ``i % stride == phase``, then the end (at stop)."""
    n = -(-plan.total_bytes // plan.chunk_bytes)
    last = rng.stop // plan.chunk_bytes if rng.stop else n
    return [i * plan.chunk_bytes for i in range(-(-rng.start // plan.chunk_bytes), last)
            if i % rng.stride == rng.phase] + [rng.stop or plan.total_bytes]


def test_a_chunker_cuts_each_range_by_the_rule_and_a_receiver_of_that_range_takes_it():
    plan, arena = _plan()
    for rng in _good(plan.total_bytes):
        msgs = list(with_bytes(Chunker(plan, arena).frames(rng)))
        assert [m.offset for m in msgs] == _expected(plan, rng), rng
        assert msgs[-1].HasField("end") and msgs[-1].end.total_bytes == (rng.stop or plan.total_bytes)
    # A receiver's part asks for what it lacks, and takes exactly what it asked for.
    for stripe in (ChunkRange(), ChunkRange(2 * SIZE, 6 * SIZE), ChunkRange(7 * SIZE)):
        receiver = Receiver(plan, np.zeros(plan.total_bytes, np.uint8), span=stripe)
        parts = [receiver.part(ChunkRange(stride=2, phase=t)) for t in (0, 1)]
        for part in parts:
            for m in with_bytes(Chunker(plan, arena).frames(part.range)):
                part.accept(m)
        receiver.finish()


# --- every sender reads and honours a request the same way -------------------------------------

def _chief():
    service, endpoint, _ = inmemory_cluster(ARRAYS, [["cpu:0"]], chunk_bytes=SIZE)
    link = endpoint.link()
    ref = pb.WorkerRef(worker_id="w0", incarnation="i1")
    ref.secret = link.join(pb.JoinRequest(worker_id="w0", incarnation="i1", devices=["cpu:0"], preferred_rank=-1),
                           5).secret
    plan = link.get_plan(ref, 5)

    def stream(rng_ref: pb.WorkerRef):
        rng_ref.incarnation, rng_ref.secret = ref.incarnation, ref.secret
        return service.stream_views([rng_ref])
    return plan, stream


def _relay():
    plan, arena = _plan()
    relay = RelayHandler(stall_timeout=5.0)
    relay.feed(plan, arena)  # every chunk here
    return plan, lambda ref: relay.stream_views([ref])


def _holder():
    plan, arena, _keep = holder.build(ARRAYS, 1, copy=False, chunk_bytes=SIZE)
    handler = holder.SnapshotHandler(plan, arena)
    return plan, lambda ref: handler.stream_views([ref])


SENDERS = {"chief": _chief, "relay": _relay, "holder": _holder}


@pytest.mark.parametrize("sender", SENDERS)
def test_the_chief_a_relay_and_a_holder_honour_start_stop_stride_and_phase_alike(sender):
    """The chief honours a stripe's ``stop_at`` and the holder a double tree's stride and phase:
    each sender streams exactly the chunks of the range, ending with the range's end message."""
    plan, stream = SENDERS[sender]()
    total = plan.total_bytes
    n = -(-total // SIZE)
    assert n >= 10
    ranges = [ChunkRange(), ChunkRange(3 * SIZE), ChunkRange(2 * SIZE, 6 * SIZE), ChunkRange(stride=2, phase=1),
              ChunkRange(SIZE, 8 * SIZE, 2, 0), ChunkRange(4 * SIZE, 0, 3, 2), ChunkRange(total),
              ChunkRange(5 * SIZE, 5 * SIZE)]
    for rng in ranges:
        msgs = [m for m, _ in stream(rng.ask(pb.WorkerRef(worker_id="w0")))]
        assert [m.offset for m in msgs] == _expected(plan, rng), (sender, rng)
        assert msgs[-1].end.total_bytes == (rng.stop or total)


@pytest.mark.parametrize("sender", SENDERS)
def test_the_chief_a_relay_and_a_holder_refuse_a_bad_range_alike(sender):
    plan, stream = SENDERS[sender]()
    for start, stop, stride, phase in _bad(plan.total_bytes):
        with pytest.raises(ProtocolError, match=r"not a range of chunks of this"):
            next(iter(stream(_ref(start, stop, stride, phase))))


# --- a fetch names a bad variable as the broadcast does ----------------------------------------

def test_a_fetch_and_the_broadcast_blame_the_same_variable_for_the_same_bytes():
    from collective.snapshot.stripes import differing
    from collective.stream import culprit

    arrays = {"a": np.arange(3000, dtype=np.float32), "b": np.arange(500, dtype=np.float32),
              "c": np.arange(3000, dtype=np.float32)}
    plan, arena, _, _ = make_plan(arrays, chunk_bytes=SIZE)
    v = {x.name: x for x in plan.variables}
    bad = arena.reshape(-1).view(np.uint8).copy()
    bad[v["b"].offset + 3] ^= 1
    lo, hi = v["b"].offset // SIZE * SIZE, min(v["b"].offset // SIZE * SIZE + SIZE, plan.total_bytes)
    # The whole arena held: "b" hashed on its own and named by both.
    assert differing(plan, bad, 0, lo, hi) == "b"
    assert culprit(plan, bad, lo, hi).startswith("variable 'b': digest of received bytes")
    # A stripe's buffer from inside "b" on: no variable of the chunk held whole, the first one
    # only partly held named as the owner of the bytes, by both.
    a = v["b"].offset + 1024
    own = bad[a:]
    first = next(x.name for x in plan.variables if x.offset + x.nbytes > lo)
    assert differing(plan, own, a, lo, hi) == first
    assert culprit(plan, own, lo, hi, base=a).startswith(f"variable {first!r}: its bytes")
    # Only padding differs: both say so.
    pad = arena.reshape(-1).view(np.uint8).copy()
    gap = v["a"].offset + v["a"].nbytes
    assert gap < v["b"].offset  # the layout pads "a" to the next alignment
    pad[gap] ^= 1
    assert differing(plan, pad, 0, gap, gap + 1) == "the padding between variables"
    assert culprit(plan, pad, gap, gap + 1).startswith("the padding between variables")
