"""The worker's logic: join, receive into one arena, make replicas, verify, report ready, start.

``WorkerAgent`` talks to the chief only through a ``ChiefLink``, so the same code runs over
gRPC, MPI or in memory. ``run`` blocks until start is released and raises a ``CollectiveError``
naming the phase and the culprit otherwise; every wait in it has a deadline.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collective import logs
from collective._proto import collective_pb2 as pb
from collective.config import Timeouts
from collective.digest import array_digest, combined_digest
from collective.errors import (
    AbortedError,
    ChiefUnreachableError,
    CollectiveError,
    DeadlineError,
    IntegrityError,
    RelayError,
)
from collective.keys import parse_devices
from collective.model import VariableSpec
from collective.plan import Receiver, declared, new_arena, spec_of, validate_plan
from collective.transport.api import ChiefLink
from collective.variables import VariableStore, create_variable

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

    def log_started(self) -> None:
        """The line every entry point ends a worker's successful round with."""
        log.info(
            "training started: %d variables x %d replicas, worker digest %s",
            len(self.variables), len(self.devices), self.worker_digest,
        )


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def make_replicas(plan: pb.Plan, arena: np.ndarray, devices: Sequence[str]) -> VariableStore:
    """One replica of every variable per device; replica 0 is a view of the arena (no copy)."""
    store = VariableStore()
    flat = arena.reshape(-1).view(np.uint8)
    for v in plan.variables:
        spec = spec_of(v)
        value = flat[v.offset : v.offset + v.nbytes].view(spec.np_dtype).reshape(spec.shape)
        create_variable(
            spec.name,
            value,
            list(devices),
            synchronization=spec.synchronization,
            aggregation=spec.aggregation,
            trainable=spec.trainable,
            store=store,
            share_first=True,
        )
    return store


def replica_digests(plan: pb.Plan, store: VariableStore, *, first_verified: bool = False) -> list[pb.ReplicaDigest]:
    """Digest every replica and compare it with the chief's digest of the variable.

    ``first_verified``: replica 0 is the arena view whose bytes the Receiver already checked
    against the chief's digest, so it is not hashed twice. Raises IntegrityError naming the
    variable and replica on the first difference.
    """
    out = []
    for v in plan.variables:
        var = store.get(v.name)
        for i, (replica, name, device) in enumerate(zip(var.replicas, var.replica_names, var.devices, strict=True)):
            digest = v.digest if (i == 0 and first_verified) else array_digest(replica)
            if digest != v.digest:
                raise IntegrityError(
                    f"variable {v.name!r}: replica {name!r} on {device} has digest {digest}, "
                    f"the chief's is {v.digest}"
                )
            out.append(pb.ReplicaDigest(variable=v.name, replica=name, device=device, digest=digest))
    return out


class _Watched:
    """A Receiver that records progress for the heartbeat and reports a bad chunk at once.

    Reporting from inside ``accept`` matters: the stream is still open then, so the chief hears
    the real cause (say a digest mismatch) before it sees the stream cut off.
    """

    def __init__(self, receiver: Receiver, agent: WorkerAgent) -> None:
        self._r, self._agent = receiver, agent

    @property
    def plan(self) -> pb.Plan:
        return self._r.plan

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self._r.view(offset, nbytes)

    def span(self, start: int, end: int) -> np.ndarray:
        return self._r.span(start, end)

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None:
        try:
            self._r.accept(chunk, placed=placed)
        except CollectiveError as exc:
            self._agent._report_failure(exc)
            raise
        self._agent.bytes_received = self._r.bytes_received
        self._agent._last_data = time.monotonic()
        if self._agent.relay is not None:
            self._agent.relay.progress(self._r.bytes_received)

    def finish(self) -> None:
        self._r.finish()


class WorkerAgent:
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
        """``relay``: this worker's relay server (``worker.relay.Relay``) for tree and chain
        topologies; ``connect(address, name)``: a ChiefLink to the relay of the worker this one
        receives from. Without them (MPI, in-memory) the chief streams to this worker itself."""
        self.link = link
        self.use_shm = shm
        self.relay = relay
        self.connect = connect
        self.link.retry_window = (timeouts or Timeouts()).lease
        self.expected = list(expected) if expected else []
        self.worker_id = worker_id or default_worker_id()
        self.devices = parse_devices(devices)
        self.preferred_rank = preferred_rank
        self.timeouts = timeouts or Timeouts()
        self.host = host or socket.gethostname()
        self.incarnation = uuid.uuid4().hex[:12]
        self.ref = pb.WorkerRef(worker_id=self.worker_id, incarnation=self.incarnation)
        self.rank = -1
        self.bytes_received = 0
        self._last_data = 0.0

    def run(self) -> WorkerResult:
        """Join, receive, verify, report ready and wait for start. Blocks; see the module doc."""
        self._stop_heartbeat = threading.Event()
        self._reported = False
        try:
            return self._run()
        except CollectiveError as exc:
            # The chief must hear of our failure at once, not at its ready deadline.
            self._report_failure(exc)
            raise
        finally:
            self._stop_heartbeat.set()
            if self.relay is not None:
                self.relay.stop()

    def _attach_shared(self, plan: pb.Plan) -> np.ndarray | None:
        """The chief's arena mapped copy-on-write when we share its host, else None.

        Not verified here: every replica's digest is checked below, replica 0 being this view.
        """
        if not (self.use_shm and plan.shm_socket):
            return None
        from collective.transport.shm import attach

        arena = attach(plan.shm_socket, plan.shm_secret, self.worker_id, self.incarnation, plan.total_bytes)
        if arena is not None:
            self.bytes_received = plan.total_bytes
            self._last_data = time.monotonic()
        return arena

    def _receive(self, plan: pb.Plan) -> np.ndarray:
        """The data stream into one pre-allocated arena, checked chunk by chunk.

        From the chief, or from the relay of the worker the plan names as this one's parent.
        """
        arena = new_arena(plan.total_bytes)
        if self.relay is not None:
            self.relay.feed(plan, arena)  # children may connect now; chunks go out as they land
        receiver = _Watched(Receiver(plan, arena), self)
        me = next(w for w in plan.workers if w.rank == self.rank)
        # A plan without a topology (a star, or an older chief) streams from the chief.
        if plan.topology in ("", "star") or me.parent < 0 or self.connect is None:
            self.link.receive_into(self.ref, receiver, stall_timeout=self.timeouts.stall)
        else:
            parent = next(w for w in plan.workers if w.rank == me.parent)
            name = f"relay worker {parent.worker_id} (rank {parent.rank})"
            source = self.connect(parent.relay_address, name)
            try:
                source.receive_into(self.ref, receiver, stall_timeout=self.timeouts.stall)
            except (ChiefUnreachableError, AbortedError, DeadlineError) as exc:
                raise RelayError(f"{name}, which this worker receives from, failed during receive: {exc}") from exc
            finally:
                source.close()
        receiver.finish()
        return arena

    def _report_failure(self, exc: CollectiveError) -> None:
        """Tell the chief once; never raises. A failure it announced itself needs no echo."""
        if self._reported or self.rank < 0 or isinstance(exc, (AbortedError, ChiefUnreachableError)):
            return
        self._reported = True
        self.link.report_failure(
            pb.FailureReport(worker=self.ref, phase=logs.current("phase"), message=str(exc)),
            timeout=min(5.0, self.timeouts.rpc),
        )

    def _heartbeat_loop(self, chief_incarnation: str) -> None:
        """Every interval: prove we are alive, and learn early if the chief is gone or failed.

        The chief's silence for a whole lease, a different chief incarnation or a failed round
        interrupts the main thread's call in progress with the reason.
        """
        t = self.timeouts
        last_ok = time.monotonic()
        while not self._stop_heartbeat.wait(t.heartbeat):
            try:
                reply = self.link.heartbeat(self.ref, timeout=min(t.heartbeat, t.lease / 2))
            except (ChiefUnreachableError, DeadlineError) as exc:
                # Data still arriving proves the chief alive, whatever became of the heartbeat.
                silent = time.monotonic() - max(last_ok, self._last_data)
                if silent > t.lease:
                    # Refused connections mean the chief is gone; unanswered ones that it is frozen.
                    frozen = isinstance(exc, DeadlineError) or "did not answer" in str(exc)
                    how = "unresponsive" if frozen else "unreachable"
                    self.link.interrupt(ChiefUnreachableError(
                        f"chief at {self.link.address} {how}: no heartbeat answer for {silent:.1f} s "
                        f"(lease {t.lease:g} s) during {logs.current('phase')}; last error: {exc}"
                    ))
                    return
                continue
            except CollectiveError as exc:
                self.link.interrupt(exc)
                return
            if reply is None:
                return  # this backend has no heartbeats
            last_ok = time.monotonic()
            if reply.chief_incarnation != chief_incarnation:
                self.link.interrupt(AbortedError(
                    f"chief at {self.link.address} restarted (incarnation {reply.chief_incarnation}, "
                    f"we joined {chief_incarnation}); this round is over"
                ))
                return
            if reply.phase == "failed":
                self.link.interrupt(AbortedError(f"round aborted by the chief at {self.link.address}: {reply.error}"))
                return

    def _run(self) -> WorkerResult:
        t = self.timeouts
        logs.set_context(worker_id=self.worker_id, phase="join")
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
            ),
            timeout=t.join,
        )
        self.rank = reply.rank
        logs.set_context(rank=self.rank)
        threading.Thread(
            target=self._heartbeat_loop, args=(reply.chief_incarnation,), name="heartbeat", daemon=True
        ).start()
        log.info(
            "joined chief at %s as rank %d of %d (incarnation %s); waiting for the plan",
            self.link.address, reply.rank, reply.num_workers, self.incarnation,
        )
        plan = self.link.get_plan(self.ref, timeout=max(1.0, t.join - (time.monotonic() - t0)) + t.rpc)
        validate_plan(plan)
        logs.phase("receive")
        log.info(
            "plan: %d variables, %d bytes in chunks of %d bytes, group key %s, topology %s",
            len(plan.variables), plan.total_bytes, plan.chunk_bytes,
            ",".join(str(g.group_key) for g in plan.groups), plan.topology or "star",
        )
        t_recv = time.monotonic()
        arena = self._attach_shared(plan)
        via = "shared memory"
        if arena is None:
            arena, via = self._receive(plan), "the network"
        elif self.relay is not None:
            self.relay.feed(plan, arena)
            self.relay.progress(plan.total_bytes)
        recv_s = time.monotonic() - t_recv
        logs.phase("verify")
        store = make_replicas(plan, arena, self.devices)
        digests = replica_digests(plan, store, first_verified=via == "the network")
        worker_digest = combined_digest((d.replica, d.digest) for d in digests)
        log.info(
            "received %d bytes through %s in %.3f s; %d replicas on %d device(s) verified; worker digest %s",
            plan.total_bytes, via, recv_s, len(digests), len(self.devices), worker_digest,
        )
        logs.phase("ready")
        self.link.report_ready(
            pb.ReadyRequest(worker=self.ref, replicas=digests, worker_digest=worker_digest), timeout=t.rpc
        )
        start = self.link.await_start(self.ref, timeout=t.start)
        self._stop_heartbeat.set()
        store.start()
        logs.phase("started")
        return WorkerResult(
            rank=self.rank,
            worker_id=self.worker_id,
            devices=list(self.devices),
            variables=store,
            plan=plan,
            worker_digest=worker_digest,
            broadcast_seconds=start.broadcast_seconds,
        )
