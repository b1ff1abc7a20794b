"""The chief's logic: rendezvous, plan and keys, the data streams, the readiness barrier.

``ChiefService`` implements ``collective.transport.api.ChiefHandler``: it never opens a
connection, and gRPC or MPI never appear here. Where the model's bytes live (memory, a shared-memory
memfd, the model's files, shards) is ``chief/arena.py``'s ``ChiefArena``, which also serves the
same-host shortcut. All state lives behind one condition variable; every wait is bounded. The round moves
JOINING -> BROADCASTING -> STARTED, or to FAILED from anywhere; the first failure wins and is
what every worker is told.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from collective import logs
from collective._proto import collective_pb2 as pb
from collective.chief import reports
from collective.chief.admission import Admission, not_its_secret
from collective.chief.arena import ChiefArena
from collective.chief.members import Member, Phase, _ChiefReplicas, report_problem
from collective.chief.rejoin import Rejoins
from collective.chief.state import RoundState
from collective.chief.supervise import Supervisor
from collective.config import Timeouts
from collective.errors import (
    AbortedError,
    CollectiveError,
    DeadlineError,
    IntegrityError,
    ModelError,
    PreconditionError,
    UsageError,
)
from collective.keys import parse_devices
from collective.limits import check_ref
from collective.model import ModelSource
from collective.plan import (
    MAX_CHUNK_BYTES,
    Chunker,
    ChunkRange,
    Lockstep,
    complete_plan,
    sibling_streams,
    with_bytes,
)
from collective.topology import Layout, arrange, choose, chunk_bytes_for

log = logging.getLogger(__name__)

class ChiefService(Admission):
    """One broadcast round for ``num_workers`` workers. Thread-safe."""

    result_file = None  # a Path: the round's summary goes there once its outcome is decided (reports.write_outcome)

    def __init__(
        self,
        source: ModelSource,
        num_workers: int,
        *,
        timeouts: Timeouts | None = None,
        chunk_bytes: int | None = None,
        incarnation: str | None = None,
        transport: str = "grpc",
        heartbeats: bool = True,
        shm: bool = False,
        topology: str = "auto",
        local_devices: Sequence[str] | str | None = None,
        spmd: bool = False,
        max_model_bytes: int | None = None,
        host: str | None = None,
        shards=None,
        from_file: bool = False,
    ) -> None:
        """``local_devices``: the chief trains too and holds one replica per device; start waits
        until they are verified (``await_plan`` then ``report_local_ready``, from the driver).
        ``spmd``: every process has a fixed rank (``collective.sync``): a worker's preferred rank
        is its rank, and a worker whose declared variables differ, or whose rank is taken or out
        of range, fails the whole round (every rank must hear it) instead of only its own join
        being refused. ``host``: this chief's host name as workers report theirs (default: the
        machine's), so the plan can tell which workers share the chief's host. ``shards``: each
        training rank gets a part of the model, not a replica (``collective.shards``: ``"dim0"``
        or a mapping name -> placement); the round is then a star without the shared arena.
        ``from_file``: serve a .safetensors model straight from its file(s), mapped read-only
        (``arena.map_files``), instead of a copy in memory; with ``shm`` same-host workers are
        handed the files to map (not with ``shards``)."""
        if num_workers < 1:
            raise UsageError(f"the number of workers must be at least 1, got {num_workers}")
        if chunk_bytes is not None and not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise UsageError(f"--chunk-bytes {chunk_bytes} must be between 1 and {MAX_CHUNK_BYTES} bytes")
        self.num_workers = num_workers
        self.timeouts = timeouts or Timeouts()
        self.chunk_bytes = chunk_bytes
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.transport = transport
        choose(topology, 1, 0)  # an unknown name is a usage error before any work
        self.topology = topology
        self.host = host or socket.gethostname()
        # Collective transports (MPI) have their own failure detection and no heartbeats.
        self.heartbeats = heartbeats
        self.source = source
        self.spmd = spmd
        local = (
            _ChiefReplicas(-1, "chief", self.incarnation, socket.gethostname(), parse_devices(local_devices), "local",
                           os.getpid())
            if local_devices else None
        )
        t0 = time.monotonic()
        self._arena = ChiefArena(source, ranks=num_workers, trains=local is not None, chunk_bytes=chunk_bytes,
                                 shm=shm, from_file=from_file, shards=shards, max_bytes=max_model_bytes)
        self.materialize_seconds = time.monotonic() - t0
        # Who joined, the phase, the plan, the error, the clock: one object (chief/state.py) that
        # the supervisor, the rejoin window and the reports take too.
        self.state = RoundState(local, created_at=t0)
        self._lockstep = Lockstep()
        self._arena.serve(self._shm_admit)
        # Comparing a declaration takes time and memory in proportion to it (100,000 variables:
        # about 2 s and 100 MB): two at once at most, so concurrent big joins queue, not pile up.
        self._declaring = threading.BoundedSemaphore(2)
        self.rejoins = Rejoins(self, self.state)  # a worker lost mid-broadcast may come back (chief/rejoin.py)
        self._chunker: Chunker | None = None
        self.supervisor = Supervisor(self, self.state)  # deadlines, leases, whom the round waits for (chief/supervise.py)
        log.info(
            "model %s: %d variables, %d bytes, %s in %.2f s",
            source.description, len(self.specs), self.arena.nbytes,
            "its files mapped (read while workers join)" if self._arena.file else "materialized",
            self.materialize_seconds,
        )
        # Served from its files, the plan need not wait for them to be read: it goes out without
        # its digests, which follow (Plan.digests_follow), so reading overlaps with sending.
        # Not with MPI, whose ranks derive each chunk's trailer from the plan alone.
        self._follow = self._arena.file is not None and transport != "mpi" and not self.sharded
        if self._arena.file is not None:
            self._hasher = threading.Thread(target=self._hash_files, name="hash-files", daemon=True)
            self._hasher.start()

    # --- the arena (chief/arena.py): the model's bytes, whole or each training rank's shard --

    @property
    def arena(self) -> np.ndarray:
        return self._arena.array

    @property
    def specs(self) -> list:
        return self._arena.specs

    @property
    def digests(self) -> list[str] | None:
        return self._arena.digests

    @property
    def sharded(self) -> bool:
        return self._arena.sharded

    @property
    def shard_request(self):
        """The shards asked for (``collective.shards``), or None."""
        return self._arena.shard_request

    @property
    def from_file(self) -> bool:
        """Served straight from the model's files (``--from-file``)."""
        return self._arena.file is not None

    def _shard_of(self, m: Member) -> int:
        return 0 if m is self.state.local else m.rank + self._arena.shard_base

    def plan_of(self, m: Member) -> pb.Plan:
        """The plan ``m`` receives and is checked against: the round's, or with shards its own
        (rebuilt when a rejoin revised the round's plan). Call with the lock held, after release."""
        return self._arena.plan_of(self._shard_of(m), self.state.plan)

    def _chunker_of(self, m: Member) -> Chunker:
        return self._arena.chunker_of(self._shard_of(m), self.state.plan) if self.sharded else self._chunker

    def bytes_total(self, m: Member) -> int:
        """The bytes ``m`` receives: the arena, or its shard's."""
        return self._arena.bytes_total(self._shard_of(m))

    def local_arena(self) -> np.ndarray:
        """What the chief's own replicas are copies of: the arena, or shard 0's."""
        return self._arena.local()

    # --- state helpers (call with the lock held) -------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def error(self) -> CollectiveError | None:
        return self.state.error

    def fail(self, error: CollectiveError) -> None:
        """End the round with ``error`` unless it already ended. Wakes every waiter."""
        with self.state.cond:
            if self.state.phase in (Phase.STARTED, Phase.FAILED):
                return
            self.state.phase, self.state.phase_at = Phase.FAILED, time.monotonic()
            self.state.error = error
            logs.phase("failed")
            log.error("round aborted: %s", error)
            self.state.cond.notify_all()

    # --- ChiefHandler --------------------------------------------------------------------

    def _release_plan(self) -> None:
        members = sorted(self.state.members.values(), key=lambda m: m.rank)
        lay = self._layout(members)
        topology, parent_of = lay.topology, lay.parents
        workers = [
            pb.WorkerInfo(rank=m.rank, worker_id=m.worker_id, host=m.host, devices=m.devices, incarnation=m.incarnation,
                          parent=parent_of[m.rank], relay_address=m.relay_address(),
                          relay_cert=m.relay_cert)
            for m in members
        ]
        for w, b in zip(workers, lay.parents_b or [None] * len(workers), strict=True):
            if b is not None:  # a double tree: tree B's parent (topology.carrier)
                w.parent_b = b
        chunk_bytes = self.chunk_bytes or chunk_bytes_for(topology)  # a chain fills its pipeline one chunk per hop
        self._check_files()
        self.state.plan = self._arena.plan(workers, chunk_bytes=chunk_bytes, chief_incarnation=self.incarnation)
        self.state.plan.topology = topology
        self._chunker = Chunker(self.state.plan, self.arena)
        self.state.phase, self.state.phase_at = Phase.BROADCASTING, time.monotonic()
        self.state.marks["plan"] = self.state.phase_at
        logs.phase("broadcast")
        hosts = len({m.host for m in members})
        log.info(
            "all %d workers joined; plan released (%d chunk(s) per worker, topology %s over %d network "
            "receiver(s); workers on %d host(s); plan of %d bytes)",
            self.num_workers, len(self._chunker) - 1, topology, lay.receivers, hosts, self.state.plan.ByteSize(),
        )
        if self.sharded:
            log.info("sharded over %d training rank(s): %s bytes each (of %d)", self._arena.shards.world,
                     ",".join(str(v.nbytes) for v in self._arena.shards.views), self.arena.nbytes)
        self.state.cond.notify_all()

    def _layout(self, members: list[Member]) -> Layout:
        """Who receives from whom, by host (``topology.arrange``); a star when a worker that
        would relay to another cannot (it has no relay: MPI, in-memory). Shards: a star, since a
        relay forwards its own stream and each worker's differs."""
        if self.sharded:
            return Layout("star", [-1] * len(members), len(members))
        lay = arrange(self.topology, [m.host for m in members], self.host, int(self.arena.nbytes),
                      share=self._arena.server is not None)
        relaying = {p for p in [*lay.parents, *(lay.parents_b or [])] if p is not None and p >= 0}
        if any(not members[r].relay_address() for r in relaying):
            if self.topology not in ("auto", "star"):
                log.info("topology %s needs its workers to relay; some cannot, so: star", lay.topology)
            return Layout("star", [-1] * len(members), len(members))
        return lay

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        """The round's plan once released; with ``ref.want_digests``, once complete (the files
        read: ``Plan.digests_follow``)."""
        with self.state.cond:
            self._member(ref)
            if ref.want_digests:
                self.state.wait(lambda: self.state.phase is Phase.FAILED or self.state.plan_complete(),
                                timeout, "plan-complete")
            else:
                self.state.wait(lambda: self.state.phase is not Phase.JOINING, timeout, "plan")
            m = self._member(ref)  # raises the failure if the round failed meanwhile
            if self.state.plan is None:
                raise DeadlineError(
                    f"plan not released within {timeout:g} s: "
                    f"{len(self.state.members)}/{self.num_workers} workers joined"
                )
            if ref.want_digests and self.state.plan.digests_follow:
                raise DeadlineError(f"the chief had not read the model's files within {timeout:g} s: "
                                    f"{self.source.description}")
            return self.plan_of(m)

    def fetch(self, ref: pb.WorkerRef) -> Iterator[pb.Chunk]:
        return self.stream([ref])

    def stream(self, refs: list[pb.WorkerRef]) -> Iterator[pb.Chunk]:
        """The data stream, once, for every worker in ``refs``: ``stream_views`` with the bytes
        copied into each message, for transports that send whole messages (gRPC)."""
        return with_bytes(self.stream_views(refs))

    def stream_views(self, refs: list[pb.WorkerRef]) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """Each message of the data stream without its bytes, and a view of them in the arena.

        A point-to-point transport calls it per worker (``fetch``); a collective transport
        (MPI) calls it once for all workers and broadcasts each message. Raises AbortedError
        between two messages once the round has failed.
        """
        with self.state.cond:
            members = [self._member(ref) for ref in refs]
            if self._chunker is None:
                raise PreconditionError(f"{members[0].name()} asked for data before the plan was released")
            if self.sharded and len(members) > 1:
                raise PreconditionError("a sharded plan streams each worker its own bytes, never one stream to many")
            chunker = self._chunker_of(members[0])
            shard = self._shard_of(members[0]) if self.sharded else None
            for m, ref in zip(members, refs, strict=True):
                m.phase, m.bytes_sent = "receiving", ref.resume_from  # resumed: it holds the bytes before
            if self.state.first_byte_at is None:
                self.state.first_byte_at = time.monotonic()
            # One stream to many (MPI) is always the whole stream, from the least a worker holds.
            ranges = [ChunkRange.of(ref, self.plan_of(m)) for m, ref in zip(members, refs, strict=True)]
            rng = replace(ranges[0], start=min(r.start for r in ranges))
            if any(replace(r, start=rng.start) != rng for r in ranges):
                raise PreconditionError("one stream to many workers must carry the same chunks to each")
            siblings = sibling_streams(self.state.plan, refs[0].worker_id, rng)
        # A double tree's two root streams kept in step (``Lockstep``: they race for this link).
        for chunk, data in self._lockstep.frames(chunker, rng, expected=siblings):
            if self.state.phase is Phase.FAILED:
                with self.state.cond:
                    for m in members:
                        m.told = True
                raise self.state.error.same_round()
            self._check_files(chunk.offset, chunk.offset + len(data), shard)
            yield chunk, data
            self._arena.drop(chunk.offset, chunk.offset + len(data), shard)
            for m in members:
                m.bytes_sent += len(data)
        with self.state.cond:
            for m in members:
                # The worker may already have verified and reported ready: a sender resumes
                # this generator only after its transport took the last message.
                if m.phase == "receiving":
                    m.phase, self.state.marks["sent"] = "verifying", time.monotonic()

    def sent(self, start: int, end: int) -> None:
        """Bytes ``start..end`` of the arena went out in one collective call (MPI's Bcast of a
        span, which ``stream_views`` does not see): served from files, their pages leave this
        process."""
        self._arena.drop(start, end)

    def _hash_files(self) -> None:
        """Read the model's files once (``ChiefArena.hash``) while workers join; then release the
        plan if every worker is in. A file that changes meanwhile fails the round naming it."""
        try:
            digests = self._arena.hash()
        except ModelError as exc:
            self.fail(ModelError(str(exc), culprit="chief", phase="join"))
            return
        with self.state.cond:
            self._arena.digests = digests
            self.materialize_seconds = time.monotonic() - self.state.created_at
            log.info("model %s: read and hashed in %.2f s", self.source.description, self.materialize_seconds)
            try:
                if self.state.phase is Phase.JOINING and len(self.state.members) == self.num_workers:
                    self._release_plan()
                elif self.state.phase is Phase.BROADCASTING and self.state.plan.digests_follow:
                    self._check_files()
                    plan = self.state.plan
                    self.state.plan = complete_plan(plan, digests, self._arena.file.chunk_digests[plan.chunk_bytes])
                    self._chunker = Chunker(self.state.plan, self.arena)  # streams from now on: the complete plan's
                    log.info("the plan's digests are complete; workers check what they received against them")
                    self.state.cond.notify_all()
            except CollectiveError:
                pass  # a file changed: _check_files failed the round, every waiter hears it

    def _check_files(self, start: int = 0, end: int | None = None, shard: int | None = None) -> None:
        """A model served from its files: fail the round, naming the file, if one (with bytes in
        ``start..end`` of the arena, default all) changed since it was hashed (its bytes would no
        longer be the plan's, or fault past a cut end)."""
        try:
            self._arena.check(start, end, shard)
        except ModelError as exc:
            self.fail(ModelError(str(exc), culprit="chief", phase=self.state.phase.value))
            raise self.state.error.same_round() from None

    def _shm_admit(self, worker_id: str, incarnation: str) -> str | None:
        """A member on this host asks for the shared arena: admit it (None) or say why not."""
        with self.state.cond:
            m = self.state.members.get(worker_id)
            if m is None or m.incarnation != incarnation:
                return f"worker {worker_id!r} (incarnation {incarnation}) is not a member"
            if self.state.phase is not Phase.BROADCASTING:
                return f"the round is {self.state.phase.value}"
            if self.state.first_byte_at is None:
                self.state.first_byte_at = time.monotonic()
            m.phase, m.bytes_sent, m.last_seen, m.mapped = "verifying", int(self.arena.nbytes), time.monotonic(), True
            self.state.marks["sent"] = m.last_seen
            log.info("%s takes the arena through shared memory", m.name())
            return None

    def close(self) -> None:
        """Release the shared arena's socket and descriptor (workers keep their mappings)."""
        self._arena.close()

    def report_ready(self, req: pb.ReadyRequest) -> pb.ReadyReply:
        with self.state.cond:
            m = self._member(req.worker)
            if self.state.plan is None:
                raise PreconditionError(f"{m.name()} reported ready before the plan was released; "
                                        f"ReportReady comes after GetPlan and the data stream")
            if self.state.plan.digests_follow:
                raise PreconditionError(f"{m.name()} reported ready before the plan was complete; with digests_follow "
                                        f"ReportReady comes after GetPlan with want_digests")
            problem = report_problem(self.plan_of(m), m, req)
            if problem is not None:
                err = IntegrityError(f"{m.name()}: {problem}", culprit=m.worker_id, phase="ready")
                self.fail(err)  # the lock is reentrant
                m.told = True
                raise err.same_round()
            m.phase, m.worker_digest = "ready", req.worker_digest
            m.bytes_reported = self.bytes_total(m)  # its digests prove it holds every byte
            ready = sum(1 for x in self.state.members.values() if x.phase == "ready")
            log.info("%s is ready with digest %s (%d/%d ready; report of %d bytes)",
                     m.name(), req.worker_digest[:12], ready, self.num_workers, req.ByteSize())
            self._maybe_start()
            return pb.ReadyReply(ready=ready)

    def _maybe_start(self) -> None:
        """Release start once every worker, and the chief's own replicas if it trains, is ready."""
        ready = sum(1 for x in self.state.members.values() if x.phase == "ready")
        local_ready = self.state.local is None or self.state.local.phase == "ready"
        if ready == self.num_workers and local_ready and self.state.phase is Phase.BROADCASTING:
            self.state.ready_at = time.monotonic()
            self.state.phase, self.state.phase_at = Phase.STARTED, time.monotonic()
            logs.phase("start")
            log.info(
                "every worker is ready and every digest agrees; start released "
                "(broadcast %.3f s)", self.broadcast_seconds(),
            )
            self.state.cond.notify_all()

    @property
    def local_devices(self) -> list[str]:
        """The chief's own devices when it trains too, else []."""
        return list(self.state.local.devices) if self.state.local is not None else []

    def await_plan(self, timeout: float) -> pb.Plan:
        """For the chief's own replicas: block until the plan is released; raise the round's
        error if it failed, DeadlineError naming who is missing after ``timeout`` seconds."""
        with self.state.cond:
            # The replicas are checked against the complete plan: wait for it (Plan.digests_follow).
            self.state.wait(lambda: self.state.phase is Phase.FAILED or self.state.plan_complete(), timeout)
            if self.state.phase is Phase.FAILED:
                raise self.state.error.same_round()
            if self.state.plan is None or self.state.plan.digests_follow:
                raise DeadlineError(f"plan not released within {timeout:g} s: {self.supervisor.joined_summary()}")
            return self.state.plan if self.state.local is None else self.plan_of(self.state.local)

    def report_local_ready(self, req: pb.ReadyRequest) -> None:
        """The chief's own replicas, hashed like a worker's: checked against the plan by the same
        rule; a difference fails the round naming the replica."""
        with self.state.cond:
            m = self.state.local
            if m is None:
                raise PreconditionError("this chief does not train: it holds no replicas of its own")
            if self.state.phase is Phase.FAILED:
                raise self.state.error.same_round()
            problem = report_problem(self.plan_of(m), m, req)
            if problem is not None:
                err = IntegrityError(f"{m.name()}: {problem}", culprit=m.worker_id, phase="ready")
                self.fail(err)
                raise err
            m.phase, m.worker_digest = "ready", req.worker_digest
            log.info("%s verified with digest %s", m.name(), req.worker_digest[:12])
            self._maybe_start()

    def await_prepared(self, ref: pb.WorkerRef, timeout: float) -> pb.PreparedReply:
        """A barrier before the first byte: every worker has checked the plan and prepared its
        arena (its receiver, its relay) before any of them takes bytes. So the data stream is not
        shared with other workers' setup (checking a plan of 20,000 variables takes each worker
        tens of milliseconds), and all streams start together, as a collective's do."""
        with self.state.cond:
            m = self._member(ref)
            if self.state.phase is not Phase.BROADCASTING:
                raise PreconditionError(f"{m.name()} is prepared while the round is {self.state.phase.value}")
            self.state.mark_prepared(m)
            if m.phase == "joined":
                m.phase = "prepared"
            self.state.cond.notify_all()
            prepared = self.state.all_prepared
            self.state.wait(lambda: self.state.phase is not Phase.BROADCASTING or prepared(), timeout, "prepared")
            if self.state.phase is Phase.FAILED:
                m.told = True
                raise self.state.error.same_round()
            if not prepared():
                late = ", ".join(x.name() for x in self.state.members.values() if not x.prepared)
                raise DeadlineError(f"not every worker prepared within {timeout:g} s; waiting for: {late}")
            return pb.PreparedReply(prepared=len(self.state.members))

    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply:
        with self.state.cond:
            m = self._member(ref)
            self.state.wait(lambda: self.state.phase in (Phase.STARTED, Phase.FAILED), timeout, "outcome")
            m = self._member(ref)
            if self.state.phase is not Phase.STARTED:
                raise DeadlineError(f"start not released within {timeout:g} s; waiting for: {self.supervisor.waiting_for()}")
            m.told, m.phase = True, "started"
            self.state.cond.notify_all()
            return pb.StartReply(start=True, broadcast_seconds=self.broadcast_seconds())

    def await_outcome(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply:
        """A worker's presence call: answered when the round has started or failed. The
        transport reports it as ``lost`` if it ends unanswered (the process is gone)."""
        with self.state.cond:
            self._member(ref)
            self.state.wait(lambda: self.state.phase in (Phase.STARTED, Phase.FAILED), timeout, "outcome")
            return pb.HeartbeatReply(
                chief_incarnation=self.incarnation, phase=self.state.phase.value, error=str(self.state.error or "")
            )

    def report_failure(self, req: pb.FailureReport) -> pb.FailureReply:
        with self.state.cond:
            m = self._member(req.worker)
            stopped = logs.stopped_by(req.stop_signal, logs.printable(req.phase))  # the field, not the words
            if stopped and self.rejoins.waits() and m.phase != "lost":
                # Stopped (preempted) mid-broadcast: a restart may take its rank, as for a
                # process lost outright; the chief names it in its own words.
                self.lost(req.worker, f"it was {stopped}", after_grace=True)
                return pb.FailureReply()
            m.phase, m.told = "failed", True
            # In the worker's own words for its phase ("while waiting for start"), as its line says.
            said = stopped or (f"failed {logs.doing(logs.printable(req.phase))}: "
                               f"{logs.printable(req.message, limit=4000)}")
            self.fail(AbortedError(f"{m.name()} {said}", culprit=req.culprit or m.worker_id, phase=req.phase or None))
            return pb.FailureReply()

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        check_ref(req)
        with self.state.cond:
            m = self.state.members.get(req.worker_id)
            if m is not None and (m.phase == "lost" or m.incarnation != req.incarnation) and \
                    self.state.phase is Phase.BROADCASTING:
                self._member(req)  # raises: that process was declared lost, or replaced
            if m is not None and m.incarnation == req.incarnation and self._holds(req) is None:
                raise not_its_secret(req.worker_id)
            if m is None or m.incarnation != req.incarnation:
                if self.state.phase is not Phase.FAILED:
                    raise PreconditionError(
                        f"chief {self.incarnation} does not know worker {req.worker_id!r} "
                        f"(in that incarnation); was the chief restarted?"
                    )
            else:
                m.last_seen = time.monotonic()
                if self.state.phase is Phase.FAILED:
                    m.told = True
                self._progress(m, req.bytes_received)
            return pb.HeartbeatReply(
                chief_incarnation=self.incarnation, phase=self.state.phase.value, error=str(self.state.error or "")
            )

    def _progress(self, m: Member, nbytes: int) -> None:
        """A worker's own count of the bytes it holds (heartbeats): the progress of a worker fed
        by a relay, which the chief's streams cannot see."""
        total = self.bytes_total(m)
        m.bytes_reported = max(m.bytes_reported, min(int(nbytes), total))
        if self.state.phase is Phase.BROADCASTING and m.bytes_reported:
            if m.phase in ("joined", "prepared"):
                m.phase = "receiving"
            if m.phase == "receiving" and m.bytes_reported == total:
                m.phase, self.state.marks["sent"] = "verifying", time.monotonic()

    def restarted(self, old) -> None:
        """A restart of member ``old`` is joining: if its calls were cut and the chief still gives
        it time to say why (``Supervisor.await_cause``), that wait ends now: the old process is gone."""
        self.supervisor.cut_now(old)

    def lost(self, ref: pb.WorkerRef, reason: str, *, after_grace: bool = False) -> None:
        """A worker's call ended without an answer: the process is gone or its link is cut.

        Before the broadcast its slot is freed for a restarted worker; during the broadcast it
        may rejoin within the rejoin window (``chief/rejoin.py``), else the round is aborted
        naming it; after the outcome the chief no longer waits for it to hear it (``Supervisor.linger``).
        """
        with self.state.cond:
            self.supervisor.stopped()  # woken from a stop, the chief names itself, not the workers it lost
            m = self._holds(ref)  # a call cut under another's name is no news of that member
            if m is None or m.told:
                return
            if self.state.phase in (Phase.STARTED, Phase.FAILED):
                # Its process is gone (or its link): the chief's linger need not wait for it to hear.
                m.gone = True
                self.state.cond.notify_all()
                return
            if self.state.phase is Phase.BROADCASTING and m.phase != "lost" and "cut off" in reason and not after_grace:
                self.supervisor.await_cause(m, ref, reason)  # its own report may yet say why
                return
            if self.state.phase is Phase.JOINING:
                del self.state.members[m.worker_id]
                log.warning("%s left before the broadcast (%s); its slot is free again", m.name(), reason)
                self.state.cond.notify_all()
            elif self.state.phase is Phase.BROADCASTING and m.phase != "lost":
                m.phase = "lost"
                # A process that is gone cannot be told; one that is only silent (frozen, link
                # cut) may come back within the linger time and hear the outcome.
                m.told = "no heartbeat" not in reason
                if self.rejoins.lost_member(m, reason):
                    return
                self.fail(AbortedError(f"{m.name()} was lost during the broadcast: {reason}",
                                       culprit=m.worker_id, phase="broadcast"))

    def status(self, brief: bool = False) -> pb.StatusReply:
        """Who has joined, each worker's phase and progress (unless ``brief``), and whom the chief waits for."""
        return reports.status_reply(self, self.state, brief)

    # --- supervision (chief/supervise.py) -----------------------------------------------------

    def supervise(self) -> None:
        """Block until the round has an outcome, enforcing the join and ready deadlines
        (``Supervisor.run``). Returns when start was released; raises the round's error otherwise."""
        self.supervisor.run()

    def broadcast_seconds(self) -> float:
        if self.state.first_byte_at is None or self.state.ready_at is None:
            return 0.0
        return self.state.ready_at - self.state.first_byte_at

    def result(self) -> dict:
        """The summary of a round, as ``collective launch --json`` prints it."""
        return reports.summary(self, self.state)
