"""The worker's logic: join, check the plan, prepare, receive into one arena, make one arena per
further device, verify every replica chunk by chunk, report ready, start.

``WorkerAgent`` talks to the chief only through a ``ChiefLink``, so the same code runs over
gRPC, MPI or in memory. ``run`` blocks until start is released and raises a ``CollectiveError``
naming the phase and the culprit otherwise; every wait in it has a deadline.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collective import logs
from collective._proto import collective_pb2 as pb
from collective.arena import new_arena
from collective.config import Timeouts
from collective.digest import chunk_digests, worker_digest
from collective.errors import (
    AbortedError,
    ChiefUnreachableError,
    CollectiveError,
    DeadlineError,
    IntegrityError,
    RelayError,
    StopSignal,
)
from collective.keys import local_devices
from collective.model import VariableSpec
from collective.plan import (
    ChunkRange,
    Receiver,
    check_completes,
    declared,
    differing_chunk,
    parent_in,
    validate_plan,
)
from collective.replicas import make_replicas, verify_replicas
from collective.transport.api import ChiefLink
from collective.variables import VariableStore
from collective.worker.heartbeat import PROGRESS_INTERVAL, ChiefWatch

log = logging.getLogger(__name__)

@dataclass
class WorkerResult:
    """What a worker holds once training may start."""

    rank: int
    worker_id: str
    devices: list[str]
    variables: VariableStore
    plan: pb.Plan
    worker_digest: str
    broadcast_seconds: float
    bytes_received: int = 0  # the arena's bytes this worker took (its shard's, with shards)

    def log_started(self) -> None:
        """The line every entry point ends a worker's successful round with."""
        log.info(
            "training started: %d variables x %d replicas, worker digest %s",
            len(self.variables), len(self.devices), self.worker_digest,
        )


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class _Watched:
    """One stream of a Receiver (``Receiver.part``; a ``transport.api.StreamSink``, what a link
    writes into) that records progress for the heartbeat, wakes the relay's streams as each
    chunk lands, and reports a bad chunk at once.

    Reporting from inside ``accept`` matters: the stream is still open then, so the chief hears
    the real cause (say a digest mismatch) before it sees the stream cut off.
    """

    def __init__(self, receiver: Receiver, rng: ChunkRange, agent: WorkerAgent) -> None:
        self._whole, self._agent = receiver, agent
        self._r = receiver.part(rng)
        self.relay: tuple[str, str] | None = None  # (name, worker id) of the relay feeding it, if any

    @property
    def resume_from(self) -> int:
        return self._r.resume_from

    @property
    def range(self) -> ChunkRange:
        return self._r.range

    @property
    def plan(self) -> pb.Plan:
        return self._r.plan

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self._r.view(offset, nbytes)

    def span(self, start: int, end: int) -> np.ndarray:
        return self._r.span(start, end)

    @property
    def bytes_received(self) -> int:
        return self._r.bytes_received

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None:
        try:
            self._r.accept(chunk, placed=placed)
        except IntegrityError as exc:
            # The plan's digests are the chief's (or, while they follow, the chief's trailers),
            # and the relay's own copy is checked against them as it lands: bytes that differ
            # here were changed by the relay or its link.
            self._blame(exc, "its relay or the link from it changed them")
        except CollectiveError as exc:
            self._agent._report_failure(exc)
            raise
        self._agent.bytes_received = self._r.bytes_received
        if self.relay is None:  # data from a relay says nothing of the chief's health
            self._agent._last_data = time.monotonic()
        if self._agent.relay is not None:
            self._agent.relay.progress()

    def complete(self, plan: pb.Plan) -> None:
        """The chief's digests, once they followed the stream (``Receiver.complete``)."""
        try:
            self._whole.complete(plan)
        except IntegrityError as exc:
            # Every chunk matched the trailer it came with, not the chief's digest: the sender
            # made the trailers up (a relay), or the chief read other bytes than it sent.
            if self.relay is not None:
                self._blame(exc, "its trailers agree with those bytes, the chief's digests do not")
            blamed = IntegrityError(f"{exc}; the chief's own stream carried these bytes, its trailers agreeing: it "
                                    f"read other bytes from the model's files than it sent", culprit="chief",
                                    phase="receive")
            self._agent._report_failure(blamed)
            raise blamed from exc

    def _blame(self, exc: IntegrityError, how: str) -> None:
        """Report ``exc`` to the chief and raise it, naming the relay the bytes came from."""
        if self.relay is None:
            self._agent._report_failure(exc)
            raise exc
        name, relay_id = self.relay
        blamed = IntegrityError(f"{exc}; the bytes came from {name}: {how}", culprit=relay_id, phase="receive")
        self._agent._report_failure(blamed)
        raise blamed from exc


class WorkerAgent(ChiefWatch):
    """One worker process's part in a round. Not reusable: one ``run`` per agent."""

    def __init__(
        self,
        link: ChiefLink,
        *,
        worker_id: str | None = None,
        devices: Sequence[str] | str = ("cpu:0",),
        preferred_rank: int = -1,
        timeouts: Timeouts | None = None,
        host: str | None = None,
        expected: Sequence[VariableSpec] | None = None,
        shm: bool = True,
        relay=None,
        connect=None,
    ) -> None:
        """``relay``: this worker's relay server (``collective.worker.relay.Relay``) for tree and chain
        topologies; ``connect(parent, name)``: a ChiefLink to the relay of ``parent`` (the plan's
        WorkerInfo of the worker this one receives from). Without them (MPI, in-memory) the
        chief streams to this worker itself."""
        self.link = link
        self.use_shm = shm
        self.relay = relay
        self.connect = connect
        self.link.retry_window = (timeouts or Timeouts()).lease
        self.expected = list(expected) if expected else []
        self.worker_id = worker_id or default_worker_id()
        self.devices = local_devices(devices)
        self.preferred_rank = preferred_rank
        self.timeouts = timeouts or Timeouts()
        self.host = host or socket.gethostname()
        self.incarnation = uuid.uuid4().hex[:12]
        # Never sent but in Join: proves a retried join comes from this process (JoinRequest.join_key).
        self._join_key = secrets.token_hex(16)
        self.ref = pb.WorkerRef(worker_id=self.worker_id, incarnation=self.incarnation)  # + its secret, at join
        self.rank = -1
        self.bytes_received = 0
        self._last_data = 0.0
        self._init_watch()  # the heartbeat's view of the chief (ChiefWatch)
        self._halted: CollectiveError | None = None  # a stream failed: the other tree's ends too

    def run(self) -> WorkerResult:
        """Join, receive, verify, report ready and wait for start. Blocks; see the module doc."""
        self._reported = False
        self._is_prepared = False
        self._prepare_from = time.monotonic()  # when the plan came (the prepare phase's start)
        self._prepared_at: float | None = None  # when every worker was prepared (the first byte may come)
        outcome = "the round is over"
        self._served = None
        self._aborted: CollectiveError | None = None
        try:
            return self._run()
        except StopSignal as stop:  # SIGTERM (``_waits.stop_on_sigterm``): a failure like any other
            self._report_failure(stop.error, stopped=True)
            outcome = f"worker {self.worker_id} stopped: {stop.error}"
            raise stop.error from None
        except CollectiveError as exc:
            # The chief must hear of our failure at once, not at its ready deadline.
            self._report_failure(exc)
            outcome = f"worker {self.worker_id} stopped: {exc}"
            raise
        except Exception as exc:
            # A bug or an exhausted resource here (MemoryError, OSError): the chief still hears
            # it now, rather than at the end of a lease or of the ready timeout.
            self._report_failure(CollectiveError(f"internal error in the worker: {type(exc).__name__}: {exc}"))
            outcome = f"worker {self.worker_id} stopped: internal error"
            raise
        finally:
            self._stop_beats()
            if self.relay is not None:
                self.relay.stop(outcome)  # children hear why their stream ended
            if self._served is not None:
                self._served.close()

    def _me(self, plan: pb.Plan) -> pb.WorkerInfo:
        return next(w for w in plan.workers if w.rank == self.rank)

    def _attach_shared(self, plan: pb.Plan) -> np.ndarray | None:
        """The arena of whom we receive from, mapped copy-on-write, when it shares our host:
        the chief's, or a host leader's (a worker that receives from the network for its host).
        None otherwise, or when the mapping cannot be had (then we take the network).

        Not verified here: every replica's digest is checked below, replica 0 being this view.
        """
        if not (self.use_shm and plan.shm_socket):
            return None
        from collective.transport.shm import attach, peer_socket

        me = self._me(plan)
        if me.HasField("parent_b"):  # a double tree's receiver takes its two halves from the network
            return None
        if me.parent < 0:
            name, whose, wait = plan.shm_socket, "the chief", None
        else:
            parent = next(w for w in plan.workers if w.rank == me.parent)
            if parent.host != me.host:
                return None
            # It answers once its arena is complete: within the round's ready deadline.
            name, wait = peer_socket(plan.shm_socket, parent.rank), self.timeouts.ready
            whose = f"worker {parent.worker_id} (rank {parent.rank})"
        self._prepared(plan)

        # The model's files (--from-file) only from the chief; a host leader's must be a sealed memfd.
        arena = attach(name, plan.shm_secret, self.worker_id, self.incarnation, plan.total_bytes, wait=wait,
                       whose=whose, cancelled=lambda: self._aborted is not None, files=me.parent < 0)
        if self._aborted is not None:
            raise self._aborted
        if arena is not None:
            self.bytes_received = plan.total_bytes
            self._last_data = time.monotonic()
        return arena

    def _serve_peers(self, plan: pb.Plan):
        """A ``ServedArena`` when workers on our host receive from us (we are its leader) and
        shared memory is on; None otherwise."""
        if not (self.use_shm and plan.shm_socket):
            return None
        me = self._me(plan)
        peers = {w.worker_id: w.incarnation for w in plan.workers if w.parent == self.rank and w.host == me.host}
        if not peers:
            return None
        from collective.transport.shm import ServedArena, peer_socket

        def admit(worker_id: str, incarnation: str) -> str | None:
            if peers.get(worker_id) != incarnation:
                return f"worker {worker_id!r} (incarnation {incarnation}) does not receive from rank {self.rank} in this plan"
            return None

        self._served = ServedArena(plan.total_bytes, name=peer_socket(plan.shm_socket, self.rank),
                                   secret=plan.shm_secret, admit=admit, wait=self.timeouts.ready)
        return self._served

    def _receive(self, plan: pb.Plan, served) -> tuple[np.ndarray, list[str], pb.Plan]:
        """The data stream into one pre-allocated arena, checked chunk by chunk; the arena, its
        verified chunk digests and the plan they were verified against (a provisional plan's
        complete one: ``_complete``).

        From the chief, or from the relay of the worker the plan names as this one's parent; in
        a double tree, each tree's chunks from that tree's parent, in two streams at once.
        A host leader receives into shared memory and hands it to its same-host peers once
        complete (``served``, from ``_serve_peers``).
        """
        # The relay serves from a read-only view of a served arena, which does not stop the seal.
        arena = new_arena(plan.total_bytes) if served is None else None
        receiver = Receiver(plan, arena if served is None else served.writable)
        if self.relay is not None:  # chunks go out as they land, with the digests they were verified against
            # Not receiver.landed: the relay must not keep the receiver (its writable view) alive.
            self.relay.feed(plan, arena if served is None else served.reader(), known=receiver.verified,
                            landed=receiver.landed_mask.__getitem__)
        self._prepared(plan)
        parts = [_Watched(receiver, ChunkRange(stride=2, phase=t) if self._trees(plan) == 2 else ChunkRange(), self)
                 for t in range(self._trees(plan))]
        if len(parts) == 1:
            self._stream(plan, 0, parts[0])
        else:
            self._streams(plan, parts)
        receiver.finish()
        if plan.digests_follow:
            plan = self._complete(plan)
            # Blamed on the stream that carried the first chunk that differs (a double tree's two).
            differs = differing_chunk(plan, receiver.digests, plan.chunk_digests)
            parts[differs[0] // plan.chunk_bytes % len(parts) if differs else 0].complete(plan)
        digests = receiver.digests
        if served is None:
            return arena, digests, plan
        del receiver, parts  # the last views of the writable mapping: the seal needs them gone
        return served.complete(), digests, plan

    def _trees(self, plan: pb.Plan) -> int:
        """How many streams this worker receives: two (one per tree) with a second parent."""
        return 2 if self._me(plan).HasField("parent_b") else 1

    def _streams(self, plan: pb.Plan, parts: list[_Watched]) -> None:
        """A double tree's two streams at once, tree B's in a thread. The first to fail ends the
        other (``_halt``) and is what this raises: the relay it names, or the bad chunk."""
        failed: list[BaseException] = []

        def tree_b() -> None:
            try:
                self._stream(plan, 1, parts[1])
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, raised there
                failed.append(exc)
                self._halt(exc)

        thread = threading.Thread(target=tree_b, name="receive-tree-b", daemon=True)
        thread.start()
        try:
            self._stream(plan, 0, parts[0])
        except BaseException as exc:
            self._halt(exc)
            failed.insert(0, exc)
        # Tree B's stream may still be landing chunks; without progress it ends by itself within
        # the stall timeout and a lost parent's lease, like A's: wait that long after the last byte.
        t = self.timeouts
        quiet = t.stall + t.lease + 2 * t.heartbeat + t.rpc
        held, since = -1, time.monotonic()
        while thread.is_alive():
            thread.join(timeout=min(1.0, quiet))
            if parts[1].bytes_received != held:
                held, since = parts[1].bytes_received, time.monotonic()
            elif thread.is_alive() and time.monotonic() - since > quiet:
                raise DeadlineError(f"tree B's stream neither ended nor moved for {quiet:g} s after tree A's ended",
                                    phase="receive")
        if failed:  # the cause, not the other tree's stream ended because of it
            raise next((e for e in failed if e is not self._halted), failed[0])

    def _halt(self, exc: BaseException) -> None:
        """One tree's stream failed: report it now (the chief hears the cause, not the other
        stream cut off) and end the other tree's stream."""
        if isinstance(exc, CollectiveError):
            self._report_failure(exc)
        error = AbortedError(f"the other tree's stream failed: {exc}")
        with self._beat:
            if self._halted is None:
                self._halted = error
            sources = list(self._sources.values())
            self._beat.notify_all()
        for source in sources:
            source.interrupt(error)

    def _stream(self, plan: pb.Plan, tree: int, part: _Watched) -> None:
        """One tree's chunks (``part.range``): from its parent, and from the parent the chief
        names next each time one is lost, at the first chunk this tree still lacks."""
        parent, first = self._parent(plan, tree), True
        which = f" (tree {'AB'[tree]})" if part.range.stride > 1 else ""
        while parent is not None:
            # The secret goes to the chief only: a relay is another member, which must not learn it.
            ref = part.range.ask(pb.WorkerRef(
                worker_id=self.worker_id, incarnation=self.incarnation,
                secret=self.ref.secret if parent.rank < 0 else ""))
            if not first:
                log.info("resuming the stream at byte %d from %s%s", ref.resume_from,
                         f"worker {parent.worker_id} (rank {parent.rank})" if parent.rank >= 0 else "the chief", which)
            first = False
            if parent.rank < 0:
                part.relay = None
                self.link.receive_into(ref, part, stall_timeout=self.timeouts.stall)
                return
            name = f"relay worker {parent.worker_id} (rank {parent.rank}{', tree ' + 'AB'[tree] if which else ''})"
            source = self.connect(parent, name)
            part.relay = (name, parent.worker_id)
            with self._beat:
                self._sources[tree] = source
                verdict = self._verdict or self._halted
            if verdict is not None:
                source.interrupt(verdict)
            try:
                source.receive_into(ref, part, stall_timeout=self.timeouts.stall)
                return
            except (ChiefUnreachableError, AbortedError, DeadlineError) as exc:
                if self._halted is not None:
                    raise self._halted from exc
                parent = self._relay_failed(name, parent, exc, tree)  # the new parent, or raises
            finally:
                with self._beat:
                    self._sources.pop(tree, None)
                source.close()

    def _complete(self, plan: pb.Plan) -> pb.Plan:
        """A provisional plan's complete one (``Plan.digests_follow``): asked of the chief once
        this worker holds every byte, answered once the chief has read the model's files."""
        t0 = time.monotonic()
        log.info("holds every byte, checked against the trailers; asking the chief for its digests")
        ref = pb.WorkerRef(worker_id=self.worker_id, incarnation=self.incarnation, secret=self.ref.secret,
                           want_digests=True)
        complete = self.link.get_plan(ref, timeout=self.timeouts.ready)
        validate_plan(complete)
        check_completes(plan, complete)
        log.info("the chief's digests came %.3f s after the last byte", time.monotonic() - t0)
        return complete

    def _parent(self, plan: pb.Plan, tree: int = 0) -> pb.WorkerInfo | None:
        """Whom this worker receives tree ``tree``'s chunks from under ``plan`` (``parent_in``):
        a worker's ``WorkerInfo``, or one with rank -1 for the chief (also without relays: MPI,
        in-memory without ``connect``)."""
        rank = parent_in(self._me(plan), tree)
        if not plan.topology or rank < 0 or self.connect is None:
            return pb.WorkerInfo(rank=-1)
        return next(w for w in plan.workers if w.rank == rank)

    def _relay_failed(self, name: str, parent: pb.WorkerInfo, exc: CollectiveError, tree: int = 0) -> pb.WorkerInfo:
        """The relay this worker receives from failed: whom to receive from now, or raise who
        is to blame.

        A parent fails when the chief is gone as well (it found out first) or when the round
        failed, and then the chief is the news, not the relay. So ask for a heartbeat now and
        wait, within a lease, for the chief's answer after the failure or the heartbeat's
        verdict: the verdict (chief unresponsive, restarted, round aborted naming the culprit)
        if there is one. A parent the chief has declared lost (``collective.chief.rejoin``) is no
        longer our parent in the chief's current plan: the one it names instead is returned.
        Else the relay is to blame.
        """
        t = self.timeouts
        failed_at = time.monotonic()
        deadline = failed_at + t.lease + 2 * t.heartbeat
        while True:
            asked = time.monotonic()
            with self._beat:
                self._beat_now = True
                self._beat.notify_all()
                self._beat.wait_for(
                    lambda asked=asked: (self._verdict is not None or self._halted is not None
                                         or self._last_ok > asked or self._stopped),
                    timeout=max(0.0, deadline - asked),
                )
                if self._verdict is not None or self._halted is not None:
                    raise self._verdict or self._halted
            if time.monotonic() < deadline and not self._stopped:
                now = self._parent(self.link.get_plan(self.ref, timeout=t.rpc), tree)
                if now.rank != parent.rank or now.incarnation != parent.incarnation:
                    log.warning("%s failed (%s); the chief now names %s as this worker's parent", name, exc,
                                f"worker {now.worker_id} (rank {now.rank})" if now.rank >= 0 else "the chief")
                    return now
            left = deadline - time.monotonic()
            if left <= 0 or self._stopped:
                raise RelayError(f"{name}, which this worker receives from, failed during receive: {exc}",
                                 culprit=parent.worker_id, phase="receive") from exc
            with self._beat:  # ask again in a while: the chief may not have noticed yet
                self._beat.wait_for(lambda: self._verdict is not None or self._halted is not None or self._stopped,
                                    timeout=min(left, t.heartbeat, PROGRESS_INTERVAL))

    def _prepared(self, plan: pb.Plan) -> None:
        """Once: tell the chief this worker is ready for bytes, and wait until every worker is.
        Logs both times: preparing a large arena (its pages faulted in) takes seconds, and they
        are not the transfer's."""
        if not self._is_prepared:
            self._is_prepared = True
            t0 = time.monotonic()
            self.link.await_prepared(self.ref, timeout=self.timeouts.ready)
            self._prepared_at = time.monotonic()
            log.info("prepared to receive %d bytes in %.3f s (plan checked, arena allocated); every worker "
                     "prepared %.3f s later", plan.total_bytes, t0 - self._prepare_from, self._prepared_at - t0)

    def _run(self) -> WorkerResult:
        t = self.timeouts
        logs.set_context(worker_id=self.worker_id)
        self._enter("join")
        t0 = time.monotonic()
        reply = self.link.join(
            pb.JoinRequest(
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                devices=self.devices,
                host=self.host,
                preferred_rank=self.preferred_rank,
                pid=os.getpid(),
                declared=declared(self.expected),
                relay_port=self.relay.port if self.relay is not None else 0,
                relay_cert=self.relay.cert_pem if self.relay is not None else b"",
                join_key=self._join_key,
            ),
            timeout=t.join,
        )
        self.rank = reply.rank
        self.ref.secret = reply.secret  # every later call names this worker with it
        logs.set_context(rank=self.rank)
        threading.Thread(
            target=self._heartbeat_loop, args=(reply.chief_incarnation,), name="heartbeat", daemon=True
        ).start()
        threading.Thread(target=self._presence, name="presence", daemon=True).start()
        log.info(
            "joined chief at %s as rank %d of %d (incarnation %s); waiting for the plan",
            self.link.address, reply.rank, reply.num_workers, self.incarnation,
        )
        plan = self.link.get_plan(self.ref, timeout=max(1.0, t.join - (time.monotonic() - t0)) + t.rpc)
        validate_plan(plan)
        self._enter("receive")
        log.info(
            "plan: %d variables, %d bytes in chunks of %d bytes, group key %s, topology %s",
            len(plan.variables), plan.total_bytes, plan.chunk_bytes,
            ",".join(str(g.group_key) for g in plan.groups), plan.topology or "star",
        )
        if plan.HasField("shard"):
            log.info("shard %d of %d: %d of the model's %d bytes", plan.shard.index, plan.shard.world,
                     plan.total_bytes, plan.shard.model_bytes)
        self._prepare_from = time.monotonic()
        # Before the prepared barrier: our same-host peers may ask for our arena right after it.
        served = self._serve_peers(plan)
        arena, verified = self._attach_shared(plan), None
        via = "shared memory"
        if arena is None:
            (arena, verified, plan), via = self._receive(plan, served), "the network"
        else:
            if self.relay is not None:
                self.relay.feed(plan, arena)  # every chunk here at once
            if plan.digests_follow:  # hashed now, while the chief may still be reading its files
                verified = chunk_digests(arena.reshape(-1).view(np.uint8), plan.chunk_bytes)
                plan = self._complete(plan)
        t_verify = time.monotonic()
        self._enter("verify")
        store, arenas = make_replicas(plan, arena, self.devices)
        devices = verify_replicas(plan, arenas, self.devices, first=verified)
        digest = worker_digest(plan.manifest_digest, [d.chunk_digests for d in devices])
        log.info(
            "%s %d bytes through %s in %.3f s (from every worker prepared to the last byte); %d replicas on "
            "%d device(s) made and verified in %.3f s; worker digest %s",
            "mapped" if via == "shared memory" else "received", plan.total_bytes, via,
            t_verify - (self._prepared_at or self._prepare_from), len(plan.variables) * len(self.devices),
            len(self.devices), time.monotonic() - t_verify, digest,
        )
        self._enter("ready")
        self.link.report_ready(pb.ReadyRequest(worker=self.ref, devices=devices, worker_digest=digest), timeout=t.rpc)
        start = self.link.await_start(self.ref, timeout=t.start)
        self._stop_beats()
        store.start()
        self._enter("started")
        return WorkerResult(
            rank=self.rank,
            worker_id=self.worker_id,
            devices=list(self.devices),
            variables=store,
            plan=plan,
            worker_digest=digest,
            broadcast_seconds=start.broadcast_seconds,
            bytes_received=self.bytes_received,
        )
