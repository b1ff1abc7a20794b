"""MPI backend: rank 0 serves the chief's handler, ranks 1..N are workers.

The worker's calls (join, plan, data, ready, start) happen in the same order on every rank, so
each maps onto collectives: a request is gathered at rank 0, the chief's handler answers every
rank's request, and the answers (or errors) are broadcast back. Tensor bytes move with the
buffer-based ``Bcast`` straight from the chief's arena into each worker's, never through
pickle, in spans of whole chunks of at most ``SPAN_BYTES`` (256 MiB; ``--split-bytes``), so no
call moves 2 GiB or more. Both sides derive every chunk's keys and digest from the plan
(``frame_messages``): only the bytes move, and each worker checks every chunk of a span as if
it had arrived alone. Control messages are the protobuf messages of ``protos/collective.proto``,
framed by hand (no pickle).

There is no ``AwaitPrepared`` call: ``settle()``, a non-blocking barrier polled with short
sleeps, runs before the data and before every control collective. It plays the part of that
barrier (every worker's arena is ready before the first byte leaves), and ranks waiting in it
sleep instead of spinning in a blocking collective on cores that other ranks need.

MPI collectives have no deadlines of their own: ``PhaseWatchdog`` aborts the whole job, naming
the phase and, on rank 0, the ranks not yet at its step, when a phase overruns its timeout. A rank that fails on its own (corrupt
data, a bad model file) cannot rejoin the sequence of collectives, so it aborts the job too, after
logging one line that names it and the cause.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
from mpi4py import MPI

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.limits import peer_error
from collective.plan import frame_messages
from collective.transport.api import ChiefHandler, ChiefLink, StreamSink

log = logging.getLogger(__name__)

_OK, _ERR = 0, 1
# A worker's message at the ready step: its ready report, or the failure it found in the data.
_READY, _FAILED = b"R", b"F"


# --- framing --------------------------------------------------------------------------------


def encode_outcome(fn: Callable[[], object]) -> bytes:
    """Run ``fn``; frame its protobuf answer, or the CollectiveError it raised."""
    try:
        msg = fn()
    except E.CollectiveError as exc:
        return encode_error(exc)
    return bytes([_OK]) + (msg.SerializeToString() if msg is not None else b"")


def encode_error(exc: E.CollectiveError, *, refused: bool = False) -> bytes:
    """``refused``: rank 0 failed before serving (``refuse_joins``); the error raised from the
    frame carries ``refused`` too."""
    info = {**E.describe(exc), "code": exc.code, "message": str(exc)}
    if refused:
        info["refused"] = True
    return bytes([_ERR]) + json.dumps(info).encode()


def decode_outcome(data: bytes, cls):
    """The message an outcome frames, or raise the error it carries (same class, same text)."""
    if not data:
        raise E.ProtocolError("empty outcome frame from the chief")
    if data[0] == _OK:
        return cls.FromString(data[1:])
    info = json.loads(data[1:].decode())
    message, culprit, phase = peer_error(info.get("message", "the chief reported an error"), info)  # bounded
    error = E.rebuild({**info, "culprit": culprit, "phase": phase}, info.get("code"), message)
    error.refused = bool(info.get("refused"))
    raise error


def pack(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(i)) + i for i in items)


def unpack(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        if pos + n > len(data):
            raise E.ProtocolError("outcome batch frame runs past its end")
        out.append(data[pos : pos + n])
        pos += n
    return out


POLL_SECONDS = 0.0005  # the first sleeps of a wait: a step the other ranks reach at once costs little
POLL_MAX_SECONDS = 0.01  # a long wait (rank 0 still loading) wakes 100 times a second, not 2,000
ABORT_GRACE = 0.5  # seconds between a rank's last line and its MPI_Abort (see abort)


def _asleep(req: MPI.Request, deadline: float | None = None) -> bool:
    """Wait for ``req`` asleep, polling with sleeps that grow from ``POLL_SECONDS`` to
    ``POLL_MAX_SECONDS``: never a spin, and a signal's handler runs between two polls. False if
    ``deadline`` (a ``time.monotonic()``) passed first."""
    pause = POLL_SECONDS
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_SECONDS)
    return True


def settle(comm: MPI.Comm, timeout: float | None = None, what: str = "this step", phase: str | None = None) -> None:
    """Wait, asleep, until every rank has reached this point.

    MPI ranks spin while they wait in a collective. When ranks outnumber cores, a rank spinning
    in the next step steals the core of a rank still working on this one (a worker checking its
    digests, say). A non-blocking barrier polled with short sleeps gives that core back, and the
    collective that follows finds everyone already there.

    ``timeout``: give up after that many seconds with a DeadlineError naming ``what`` and
    ``phase`` (the barrier stays posted: the job cannot go on with its collectives). Without
    it, the phase watchdog bounds the wait.
    """
    if not _asleep(comm.Ibarrier(), None if timeout is None else time.monotonic() + timeout):
        raise E.DeadlineError(f"not every one of the {comm.size} MPI ranks reached {what} within "
                              f"{timeout:g} s (rank {comm.rank} waited)", phase=phase)


def recv_asleep(comm: MPI.Comm, buf, source: int = 0, tag: int = 0) -> None:
    """``Recv`` that waits asleep: a rank waiting its turn (another rank's stream goes first)
    leaves its core to the ranks at work, as ``settle`` does. The phase watchdog bounds it."""
    _asleep(comm.Irecv(buf, source=source, tag=tag))


def bcast_bytes(comm: MPI.Comm, data: bytes | None, root: int = 0) -> bytes:
    settle(comm)
    n = np.array([len(data) if comm.rank == root and data is not None else 0], dtype=np.int64)
    comm.Bcast([n, MPI.INT64_T], root=root)
    if comm.rank == root:
        buf = np.frombuffer(data or b"", dtype=np.uint8)
    else:
        buf = np.empty(int(n[0]), dtype=np.uint8)
    if n[0]:
        comm.Bcast([buf, MPI.BYTE], root=root)
    return data if comm.rank == root else buf.tobytes()


def gather_bytes(comm: MPI.Comm, data: bytes, root: int = 0) -> list[bytes] | None:
    settle(comm)
    sizes = np.zeros(comm.size, dtype=np.int64) if comm.rank == root else None
    comm.Gather([np.array([len(data)], dtype=np.int64), MPI.INT64_T], [sizes, MPI.INT64_T] if sizes is not None else None, root=root)
    send = np.frombuffer(data, dtype=np.uint8)
    if comm.rank != root:
        comm.Gatherv([send, MPI.BYTE], None, root=root)
        return None
    counts = sizes.astype(np.int64)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    recv = np.empty(int(counts.sum()), dtype=np.uint8)
    comm.Gatherv([send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE], root=root)
    return [recv[d : d + c].tobytes() for d, c in zip(displs, counts, strict=True)]


# --- watchdog -------------------------------------------------------------------------------


# The steps of a round in the order every rank reaches them, and the tag of a rank's note to
# rank 0 that it reached one (``PhaseWatchdog.reached``).
STEPS = ("join", "plan", "broadcast", "ready", "start", "done")
_REACHED = 0x7A7


class PhaseWatchdog:
    """Aborts the MPI job when a phase overruns its deadline, naming the phase and, on rank 0,
    the ranks that had not reached this rank's step (each rank tells rank 0 of every step it
    reaches; rank 0 reads those notes as it goes, and once more before it aborts)."""

    def __init__(self, comm: MPI.Comm) -> None:
        self._comm = comm
        self._lock = threading.Lock()
        self._phase: tuple[str, float, float] | None = None
        self._step = ""  # the last step this rank reached
        self._seen: dict[int, str] = {}  # rank 0: the last step each rank said it reached
        self._notes: list = []  # other ranks: (request, buffer) of notes in flight
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mpi-watchdog", daemon=True)
        self._thread.start()

    def phase(self, name: str, timeout: float) -> None:
        with self._lock:
            self._phase = (name, timeout, time.monotonic() + timeout)

    @property
    def current(self) -> str | None:
        """The phase this rank is in, for the line a signal leaves."""
        phase = self._phase
        return phase[0] if phase else None

    def step(self, name: str, timeout: float) -> None:
        """A phase that begins at one of the round's collective steps (STEPS), reached now."""
        self.phase(name, timeout)
        self.reached(name)

    def reached(self, step: str) -> None:
        """This rank reached ``step`` (one of STEPS): rank 0 can name the ranks that did not."""
        with self._lock:
            self._step = step
            if self._comm.rank == 0:
                self._read_notes()
                return
            if step == STEPS[-1]:
                return  # nothing follows it that rank 0 could wait for
            self._notes = [(r, b) for r, b in self._notes if not r.Test()]
            buf = np.frombuffer(step.encode(), dtype=np.uint8)
            self._notes.append((self._comm.Isend([buf, MPI.BYTE], dest=0, tag=_REACHED), buf))

    def _read_notes(self) -> None:
        """Rank 0, the lock held: every note that arrived (MPI_THREAD_MULTIPLE: the watchdog's
        thread may read them while the main thread waits in a collective)."""
        status = MPI.Status()
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REACHED, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            self._comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=_REACHED)
            self._seen[status.Get_source()] = buf.tobytes().decode(errors="replace")

    def laggards(self, phase: str) -> str:
        """Rank 0: which ranks had not reached its step, and where each was last heard of."""
        if self._step not in STEPS:
            return f"rank 0 itself did not get past {phase}"
        with self._lock:
            self._read_notes()
            at = STEPS.index(self._step)
            late = [(r, self._seen.get(r, "")) for r in range(1, self._comm.size)
                    if (STEPS.index(self._seen[r]) if self._seen.get(r) in STEPS else -1) < at]
        if not late:
            return f"every rank reached {self._step}: one hung or died inside it"
        where = ", ".join(f"rank {r} ({'last at ' + s if s else 'never heard from'})" for r, s in late)
        return f"not yet at {self._step}: {where}"

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for request, _ in self._notes:
                request.Wait()  # a few bytes: sent eagerly, complete already or at once
            self._notes = []

    def _watch(self) -> None:
        # Rank 0 names who it waits for: the other ranks give it a moment to say so first.
        slack = 0.0 if self._comm.rank == 0 else 2 * ABORT_GRACE
        while not self._stop.wait(0.1):
            with self._lock:
                current = self._phase
            if current is not None and time.monotonic() > current[2] + slack:
                name, timeout, _ = current
                who = (self.laggards(name) if self._comm.rank == 0
                       else f"this rank is at {self._step or name}; rank 0 names the ranks it waits for")
                log.error(
                    "rank %d on %s: %s did not finish within %g s (%s); aborting the job",
                    self._comm.rank, socket.gethostname(), name, timeout, who,
                )
                abort(self._comm, 1)


def forget_shm_names(comm: MPI.Comm) -> None:
    """Unlink the names of MPICH's ``/dev/shm/mpich_shm_*`` segments once every rank holds them.

    MPICH removes its segment only in MPI_Finalize, so every aborted or killed job would leave
    ~3 MB in /dev/shm. After MPI_Init and one barrier every rank of this host has mapped it and
    the name is needed no more: each rank unlinks the names it has mapped (never another job's),
    and the memory goes when the last rank exits, however it exits. Waits (asleep) for the barrier.
    """
    settle(comm)  # asleep, not MPI_Barrier's spin: a rank may still be starting
    with open("/proc/self/maps") as fh:
        paths = {f[5].strip() for f in (line.split(None, 5) for line in fh) if len(f) > 5}
    for path in paths:
        if path.startswith("/dev/shm/mpich_shm_") and not path.endswith("(deleted)"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another rank of this host was first


def abort(comm: MPI.Comm, code: int) -> None:
    """End every rank of the job. Never returns. Says so first, in our own line: MPICH's own
    "called MPI_Abort" text comes through mpiexec's forwarding, which may drop it as the job dies."""
    log.error("rank %d: aborting the job (MPI_Abort, exit code %d)", comm.rank, code)
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()
    # mpiexec forwards a rank's output from a pipe and drops what is still in it once the abort
    # tears the job down: a moment first, so the line that names the cause reaches the user
    # (once, under load, a refused sync ended with exit 2 and no output at all).
    time.sleep(ABORT_GRACE)
    try:
        comm.Abort(code)
    finally:
        os._exit(code)


def refuse_joins(comm: MPI.Comm, watchdog: PhaseWatchdog, timeouts, error: E.CollectiveError) -> None:
    """Rank 0 failed before serving (its values, its shards, its model, an option): answer every
    other rank's join, the step each of them starts with, with ``error``, so every rank raises
    the chief's own cause at once and ends normally, as a refused join over gRPC does
    (``chief/pending.py``). The wait for the ranks to get there is the join phase's, bounded by
    the watchdog. Marks ``error.refused``."""
    watchdog.step("join", timeouts.join)
    gather_bytes(comm, b"")
    log.info("rank 0 failed before serving; every rank's join is answered with its error")
    told = E.rebuild(E.describe(error), error.code, f"rank 0: {error}")
    bcast_bytes(comm, pack([encode_error(told, refused=True)] * (comm.size - 1)))
    error.refused = True


# --- chief side -----------------------------------------------------------------------------


class MpiChiefDriver:
    """Rank 0: answers the workers' calls with ``handler``, one collective step at a time."""

    def __init__(self, comm: MPI.Comm, handler: ChiefHandler, watchdog: PhaseWatchdog, timeouts,
                 split_bytes: int = None, local: Callable[[], object] | None = None) -> None:
        """``local``: when the chief trains too, makes and reports its own replicas; called once
        the data is out and before the workers' ready reports are answered (a failure there
        fails the round, and every rank hears it at the ready step)."""
        self.comm, self.h, self.watchdog, self.t = comm, handler, watchdog, timeouts
        self.local = local
        self.split_bytes = split_bytes or SPAN_BYTES
        self.refs: list[pb.WorkerRef] = []
        self.sharded = bool(getattr(handler, "sharded", False))

    def _answer_each(self, requests: list[bytes], fn: Callable[[int, bytes], object]) -> bool:
        """Answer every worker's request; False if the round failed (everyone was told)."""
        outcomes = [encode_outcome(lambda r=r, d=d: fn(r, d)) for r, d in enumerate(requests[1:], start=1)]
        if any(o[0] == _ERR for o in outcomes):
            # One rank's refusal must not leave the others in a different step: fail the round.
            first = next(decode_error(o) for o in outcomes if o[0] == _ERR)
            self.h.fail(E.AbortedError(str(first)))
            outcomes = [o if o[0] == _ERR else encode_error(first) for o in outcomes]
        bcast_bytes(self.comm, pack(outcomes))
        return all(o[0] == _OK for o in outcomes)

    def serve(self) -> None:
        """Run the round's steps; stop after the first step whose answer was a failure.

        Every worker gets the same failing step, so no rank is left waiting in a collective.
        """
        t = self.t
        self.watchdog.step("join", t.join)
        joins = gather_bytes(self.comm, b"")

        def join(rank: int, data: bytes):
            req = pb.JoinRequest.FromString(data)
            self.refs.append(ref := pb.WorkerRef(worker_id=req.worker_id, incarnation=req.incarnation))
            reply = self.h.join(req, f"mpi rank {rank}")
            ref.secret = reply.secret  # the chief's calls on this rank's behalf are the member's
            return reply

        if not self._answer_each(joins, join):
            return
        self.watchdog.step("plan", t.join)
        # At once, unless the chief still reads the model's files (--from-file): the workers wait
        # asleep in bcast_bytes' settle meanwhile.
        # With shards each rank has a plan of its own: all of them go out, each rank takes its own.
        refs = self.refs if self.sharded else self.refs[:1]
        plans = [encode_outcome(lambda ref=ref: self.h.get_plan(ref, t.join)) for ref in refs]
        bcast_bytes(self.comm, pack(plans))
        if any(p[0] != _OK for p in plans):
            return
        self.plan = pb.Plan.FromString(plans[0][1:])
        self.watchdog.step("broadcast", t.ready)
        if not (self._stream_each() if self.sharded else self._stream()):
            return
        if self.local is not None:
            try:
                self.local()
            except E.CollectiveError:
                pass  # the round failed with it: the ready answers below carry it to every rank
        self.watchdog.reached("ready")
        readies = gather_bytes(self.comm, b"")
        if not self._answer_each(readies, self._ready):
            return
        self.watchdog.step("start", t.start)
        self._answer_each([b""] * (len(self.refs) + 1), lambda r, d: self.h.await_start(self.refs[r - 1], 0.0))
        self.watchdog.step("done", t.start)

    def _ready(self, rank: int, data: bytes):
        if data[:1] == _FAILED:  # the rank found its data bad: it names the variable and the digest
            req = pb.FailureReport.FromString(data[1:])
            self.h.report_failure(req)  # fails the round, naming the worker
            # Answered as any report after a failure is: with the round's error, the same text
            # every rank gets and the chief logs.
            return self.h.report_ready(pb.ReadyRequest(worker=req.worker))
        return self.h.report_ready(pb.ReadyRequest.FromString(data[1:]))

    def _stream(self) -> bool:
        """The arena in a few large Bcasts (each below 2 GiB), straight from the chief's memory.

        Both sides derive every chunk's keys and trailers from the plan (``frame_messages``),
        so only the bytes move; before each span a one-int status says whether the round still
        stands (else the error follows). Few calls matter: every collective costs a
        synchronisation, dear when ranks outnumber cores.
        """
        status = np.zeros(1, dtype=np.int64)
        settle(self.comm)  # every worker's arena is ready before the first byte leaves
        views = self.h.stream_views(self.refs)
        try:
            for start, end in spans(self.plan, self.split_bytes):
                for _msg, data in views:  # advances the chief's bookkeeping and checks for failure
                    if _msg.offset + len(data) >= end:
                        break
                status[0] = 0
                self.comm.Bcast([status, MPI.INT64_T], root=0)
                if end > start:
                    self.comm.Bcast([self.h.arena[start:end], MPI.BYTE], root=0)
                    self.h.sent(start, end)  # served from files: the span's pages leave rank 0
            for _ in views:  # the end message: marks every worker's stream complete
                pass
        except E.CollectiveError as exc:
            meta = encode_error(exc)
            status[0] = len(meta)
            self.comm.Bcast([status, MPI.INT64_T], root=0)
            self.comm.Bcast([np.frombuffer(meta, np.uint8), MPI.BYTE], root=0)
            return False
        return True

    def _stream_each(self) -> bool:
        """Shards: each worker its own stream (a Bcast is one stream to all), point to point and
        in rank order, one MPI message per chunk straight from the chief's arena. Before each
        chunk a one-int status: 0, its bytes follow; n, the round's error follows in n bytes
        (then the stream ends, for this rank and every later one). Ranks waiting their turn
        sleep (``recv_asleep``)."""
        status = np.zeros(1, dtype=np.int64)
        settle(self.comm)
        error: E.CollectiveError | None = None
        for rank, ref in enumerate(self.refs, start=1):
            if error is None:
                try:
                    for _msg, data in self.h.stream_views([ref]):
                        self.comm.Send([status, MPI.INT64_T], dest=rank, tag=_STREAM)
                        if len(data):
                            self.comm.Send([data, MPI.BYTE], dest=rank, tag=_STREAM)
                    continue
                except E.CollectiveError as exc:
                    error = exc
            meta = encode_error(error)
            self.comm.Send([np.array([len(meta)], dtype=np.int64), MPI.INT64_T], dest=rank, tag=_STREAM)
            self.comm.Send([np.frombuffer(meta, np.uint8), MPI.BYTE], dest=rank, tag=_STREAM)
        return error is None


SPAN_BYTES = 256 << 20  # per Bcast call: far below MPI's 2 GiB count limit
_STREAM = 7  # the tag of a shard's point-to-point stream


def spans(plan: pb.Plan, span_bytes: int = SPAN_BYTES) -> list[tuple[int, int]]:
    """Consecutive ranges of whole chunks, each at most ``span_bytes`` (or one chunk)."""
    out, start = [], 0
    for _msg, _s, end in frame_messages(plan):
        if end - start > span_bytes and _s > start:
            out.append((start, _s))
            start = _s
    out.append((start, plan.total_bytes))
    return out


def decode_error(outcome: bytes) -> E.CollectiveError:
    try:
        decode_outcome(outcome, pb.JoinReply)
    except E.CollectiveError as exc:
        return exc
    return E.AbortedError("unknown failure")


# --- worker side ----------------------------------------------------------------------------


class MpiChiefLink(ChiefLink):
    """Ranks 1..N: the worker's calls as the matching collectives with rank 0."""

    def __init__(self, comm: MPI.Comm, watchdog: PhaseWatchdog, timeouts, split_bytes: int = None) -> None:
        self.comm, self.watchdog, self.t = comm, watchdog, timeouts
        self.split_bytes = split_bytes or SPAN_BYTES
        self.address = "mpi rank 0"
        # The chief's failure answers reach every rank at the same step; such a failure ends
        # this rank normally. So does this rank's own failure found while or after the data
        # streamed (a chunk's or a replica's digest): it goes to the chief in place of the ready
        # report (``failure_heard``). Any other failure leaves the ranks out of step and must abort.
        self.announced: E.CollectiveError | None = None
        self.failure_heard = False
        self._streaming = False     # inside receive_into's collectives
        self._stream_failed: E.CollectiveError | None = None  # a bad chunk found there, reported at ready
        self._ready_next = False    # the stream is done; the ready step is this rank's next
        self._failure: pb.FailureReport | None = None

    def _decode(self, data: bytes, cls):
        try:
            return decode_outcome(data, cls)
        except E.CollectiveError as exc:
            self.announced = exc
            raise

    def _mine(self, batch: bytes, cls):
        return self._decode(unpack(batch)[self.comm.rank - 1], cls)

    def join(self, req: pb.JoinRequest, timeout: float) -> pb.JoinReply:
        self.watchdog.step("join", self.t.join)
        gather_bytes(self.comm, req.SerializeToString())
        return self._mine(bcast_bytes(self.comm, None), pb.JoinReply)

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        """The round's plan, or with shards this rank's own (one plan per rank in the batch)."""
        self.watchdog.step("plan", self.t.join)
        plans = unpack(bcast_bytes(self.comm, None))
        return self._decode(plans[0] if len(plans) == 1 else plans[self.comm.rank - 1], pb.Plan)

    def receive_into(self, ref: pb.WorkerRef, receiver: StreamSink, stall_timeout: float) -> None:
        """The data stream straight into the receiver's memory, every chunk checked as if it had
        arrived alone (keys, trailers, digests): the chief's large Bcasts, or with shards this
        rank's own stream (``_receive_own``). A bad chunk this rank has reported keeps it in
        the stream's collectives to the end (the ranks must stay in step); it goes to the chief
        at the ready step."""
        self.watchdog.step("broadcast", self.t.ready)
        self._stream_failed = None
        settle(self.comm)
        self._streaming = True
        try:
            (self._receive_own if receiver.plan.HasField("shard") else self._receive_spans)(receiver)
        finally:
            self._streaming = False
        self._ready_next = True
        if self._stream_failed is not None:
            self._send_failure(self._failure)
            raise self._stream_failed

    def _accept(self, receiver, msg: pb.Chunk) -> None:
        """Check one chunk that landed in place; after a failure, nothing (see receive_into)."""
        if self._stream_failed is not None:
            return
        try:
            receiver.accept(msg, placed=True)
        except E.CollectiveError as exc:
            if self._failure is None:  # not reported to the chief: nothing to send in step
                raise
            self._stream_failed = exc

    def _chief_error(self, n: int, receive: Callable[[np.ndarray], None]) -> None:
        """A status word of ``n`` > 0: the chief's error follows in ``n`` bytes; raise it."""
        if n:
            meta = np.empty(n, dtype=np.uint8)
            receive(meta)
            self._decode(meta.tobytes(), pb.Chunk)

    def _receive_spans(self, receiver) -> None:
        """The arena in the chief's large Bcasts, a status word before each span."""
        messages = list(frame_messages(receiver.plan))
        status = np.zeros(1, dtype=np.int64)
        i = 0
        for start, end in spans(receiver.plan, self.split_bytes):
            self.comm.Bcast([status, MPI.INT64_T], root=0)
            self._chief_error(int(status[0]), lambda buf: self.comm.Bcast([buf, MPI.BYTE], root=0))
            if end > start:
                self.comm.Bcast([receiver.span(start, end), MPI.BYTE], root=0)
            while i < len(messages) and messages[i][2] <= end:  # whole chunks, end included
                self._accept(receiver, messages[i][0])
                i += 1

    def _receive_own(self, receiver) -> None:
        """A shard's own stream (``MpiChiefDriver._stream_each``), point to point, a status word
        before each chunk; waiting its turn asleep. After a reported failure the rest is still
        taken (into scratch memory), so rank 0 is never left sending to no one."""
        status = np.zeros(1, dtype=np.int64)
        for msg, start, end in frame_messages(receiver.plan):
            recv_asleep(self.comm, [status, MPI.INT64_T], tag=_STREAM)
            self._chief_error(int(status[0]), lambda buf: self.comm.Recv([buf, MPI.BYTE], source=0, tag=_STREAM))
            if end > start:
                into = receiver.view(start, end - start) if self._stream_failed is None else np.empty(end - start, np.uint8)
                self.comm.Recv([into, MPI.BYTE], source=0, tag=_STREAM)
            self._accept(receiver, msg)

    def fetch(self, ref: pb.WorkerRef, stall_timeout: float) -> Iterator[pb.Chunk]:
        raise E.ProtocolError("over MPI the data stream is received in place: use receive_into")

    def report_ready(self, req: pb.ReadyRequest, timeout: float) -> pb.ReadyReply:
        self._ready_next = False
        self.watchdog.reached("ready")
        gather_bytes(self.comm, _READY + req.SerializeToString())
        return self._mine(bcast_bytes(self.comm, None), pb.ReadyReply)

    def _send_failure(self, req: pb.FailureReport) -> None:
        """At the ready step, in place of the ready report: the chief fails the round naming this
        rank, and every rank hears it in the same answer."""
        self._ready_next = False
        self.watchdog.reached("ready")
        gather_bytes(self.comm, _FAILED + req.SerializeToString())
        try:
            self._mine(bcast_bytes(self.comm, None), pb.ReadyReply)
        except E.CollectiveError:
            pass  # the round failed with our report, as it must
        self.failure_heard = True

    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply:
        self.watchdog.step("start", self.t.start)
        reply = self._mine(bcast_bytes(self.comm, None), pb.StartReply)
        self.watchdog.step("done", self.t.start)
        return reply

    def report_failure(self, req: pb.FailureReport, timeout: float) -> None:
        """A failure found while the data streams is sent once the stream's collectives are over;
        one found after it (a replica's check), at once: both in place of the ready report, so
        the ranks stay in step and the job ends normally with the culprit named. Anywhere else
        there is nothing to send: a rank that fails on its own aborts the job (see module doc)."""
        if self._streaming:
            self._failure = req
        elif self._ready_next:
            self._send_failure(req)

    def status(self, timeout: float, brief: bool = False) -> pb.StatusReply:
        raise E.UsageError("status is not available over MPI; read rank 0's output")
