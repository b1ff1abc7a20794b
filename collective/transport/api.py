"""The transport interface: how a worker talks to its chief, whatever carries the bytes.

Chief logic (``collective.chief.service.ChiefService``) implements ``ChiefHandler``: it serves the
stream (``StreamSource``, ``PlanSource``) and runs the round (``RoundHandler``); a worker's relay
is only a ``StreamSource``, a publication a ``PlanSource`` (a server answers the rest with
``stream_server`` / ``plan_server``: their refusal). Worker logic
(``collective.worker.agent``) calls a ``ChiefLink``. A backend provides both ends: a ``ChiefEndpoint`` that
exposes a handler to workers, and the matching ``ChiefLink``. Backends: ``inmemory`` (unit
tests: a whole cluster in one process), ``grpc`` (across hosts; its bulk data may take the raw
TCP / unix-socket path of ``rawtcp``), ``mpi`` (under mpiexec: the plan and the values move
with MPI collectives) and ``shm`` (same host: a worker maps the chief's or its host leader's
arena). The messages are the protobuf
messages of ``protos/collective.proto`` for every backend.

Errors: handler methods raise ``CollectiveError`` subclasses; a backend carries the class and
message to the worker, whose ``ChiefLink`` re-raises the same class. A link raises
``ChiefUnreachableError`` (naming the chief's address) when the chief is gone or silent past
a deadline. Every link call takes a timeout; none blocks forever.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from collective._proto import collective_pb2 as pb
from collective.errors import CollectiveError, UnimplementedError

if TYPE_CHECKING:
    import numpy as np


class StreamSource(Protocol):
    """What serves a data stream: the chief, a worker's relay (``collective.worker.relay``), a
    publication (``collective.snapshot.holder``). Every method is thread-safe; waits are bounded.

    ``num_workers``: how many receivers it serves at once (it sizes a server's pool).
    ``refusal``: the words a server answers (UNIMPLEMENTED) to a call this source does not
    serve (``stream_server``, ``plan_server``).
    """

    num_workers: int
    refusal: str

    def fetch(self, ref: pb.WorkerRef) -> Iterator[pb.Chunk]: ...

    def stream_views(self, refs: list[pb.WorkerRef]) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """The stream for ``refs`` without the bytes in the messages, and a view of them
        (raw-frame and collective transports)."""
        ...

    def lost(self, ref: pb.WorkerRef, reason: str) -> None:
        """A call from this receiver ended without an answer (process gone, link cut)."""
        ...


class PlanSource(StreamSource, Protocol):
    """A stream source that also gives its plan and its status (a publication, the chief)."""

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan: ...

    def status(self, brief: bool = False) -> pb.StatusReply:
        """``brief``: the worker lines may be left out (``StatusRequest.brief``)."""
        ...


class RoundHandler(Protocol):
    """What runs a round: the calls of a worker that joins it. A method with a ``timeout`` may
    wait for the round: it waits with ``collective.parking.wait_for``, so a server can park it
    (no thread per waiting call; ``collective.transport.grpc.servicer``)."""

    def join(self, req: pb.JoinRequest, peer: str) -> pb.JoinReply: ...

    def await_prepared(self, ref: pb.WorkerRef, timeout: float) -> pb.PreparedReply:
        """This worker is ready to receive; block until every worker is (a barrier)."""
        ...

    def report_ready(self, req: pb.ReadyRequest) -> pb.ReadyReply: ...

    def ready_bytes(self, ref: pb.WorkerRef) -> int:
        """The most bytes ``ref``'s ready report can be; raises unless ``ref`` is a member (with
        its secret). For transports that receive the report in pieces (gRPC)."""

    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply: ...

    def report_failure(self, req: pb.FailureReport) -> pb.FailureReply: ...

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """A worker is alive and holds ``req.bytes_received`` bytes of the arena."""
        ...

    def await_outcome(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply:
        """Block until the round has started or failed (a worker's presence call)."""
        ...


class ChiefHandler(PlanSource, RoundHandler, Protocol):
    """What the chief does for each request: it serves the stream and runs the round."""


class _Refusing:
    """A ``ChiefHandler`` over a source that serves only part of it: the source's calls go to it
    (looked up at each call: a publication swaps the state it serves), every other call raises
    ``UnimplementedError`` in the source's own words (``StreamSource.refusal``)."""

    def __init__(self, source: StreamSource, *, plans: bool) -> None:
        self._source, self._plans = source, plans
        self.num_workers = source.num_workers

    @property
    def specs(self) -> list:
        """The served plan's variables (none for a relay): they size a Join's admission limit,
        as for a chief (``transport/grpc/server.py``)."""
        return getattr(self._source, "specs", None) or []

    def fetch(self, ref: pb.WorkerRef) -> Iterator[pb.Chunk]:
        return self._source.fetch(ref)

    def stream_views(self, refs: list[pb.WorkerRef]) -> Iterator[tuple[pb.Chunk, memoryview]]:
        return self._source.stream_views(refs)

    def lost(self, ref: pb.WorkerRef, reason: str) -> None:
        self._source.lost(ref, reason)

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        if not self._plans:
            self._refuse()
        return self._source.get_plan(ref, timeout)

    def status(self, brief: bool = False) -> pb.StatusReply:
        if not self._plans:
            self._refuse()
        return self._source.status(brief)

    def _refuse(self, *args, **kwargs):
        raise UnimplementedError(self._source.refusal)

    join = await_prepared = report_ready = ready_bytes = await_start = report_failure = _refuse
    heartbeat = await_outcome = _refuse


def stream_server(source: StreamSource) -> ChiefHandler:
    """What a server answers for a source of the data stream alone (a worker's relay): its
    stream, and every other call refused in its words."""
    return _Refusing(source, plans=False)


def plan_server(source: PlanSource) -> ChiefHandler:
    """What a server answers for a source of a plan and its stream (a publication): those, its
    status, and every call of a round refused in its words."""
    return _Refusing(source, plans=True)


class StreamSink(Protocol):
    """What a link writes a data stream into (``ChiefLink.receive_into``): a receiver's part
    (``collective.stream.Receiver.part``, a worker's streams), a fetcher's stripe receiver
    (``collective.stream.Receiver``). A transport writes a chunk's bytes in place (``view``,
    or ``span`` for many chunks at once) and then hands over its metadata (``accept`` with
    ``placed``), or hands over a whole message (``accept``)."""

    plan: pb.Plan
    bytes_received: int

    def view(self, offset: int, nbytes: int) -> np.ndarray: ...

    def span(self, start: int, end: int) -> np.ndarray: ...

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None: ...


class ChiefLink(abc.ABC):
    """A worker's connection to the chief."""

    address: str
    retry_window: float = 0.0  # how long an idempotent wait may ride out a dropped connection

    @abc.abstractmethod
    def join(self, req: pb.JoinRequest, timeout: float) -> pb.JoinReply:
        """Join; retries while the chief is not up yet, until ``timeout``."""

    @abc.abstractmethod
    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        """Block until the chief releases the plan (all workers joined) or fails."""

    def await_prepared(self, ref: pb.WorkerRef, timeout: float) -> pb.PreparedReply | None:
        """Say this worker has checked the plan and prepared its arena; block until every worker
        has. None: this backend synchronises its receivers itself (MPI)."""
        return None

    @abc.abstractmethod
    def fetch(self, ref: pb.WorkerRef, stall_timeout: float) -> Iterator[pb.Chunk]:
        """The data stream; raises if no message arrives for ``stall_timeout`` seconds."""

    def receive_into(self, ref: pb.WorkerRef, receiver: StreamSink, stall_timeout: float) -> None:
        """Feed the whole data stream to ``receiver``.

        The default takes ``fetch``'s messages; a backend that can write bytes in place
        (MPI's Bcast into ``receiver.view(...)``) overrides it to save a copy.
        """
        for chunk in self.fetch(ref, stall_timeout):
            receiver.accept(chunk)

    @abc.abstractmethod
    def report_ready(self, req: pb.ReadyRequest, timeout: float) -> pb.ReadyReply: ...

    @abc.abstractmethod
    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply:
        """Block until start is released, or raise the round's failure."""

    @abc.abstractmethod
    def report_failure(self, req: pb.FailureReport, timeout: float) -> None:
        """Best effort: tell the chief this worker cannot go on. Never raises."""

    @abc.abstractmethod
    def status(self, timeout: float, brief: bool = False) -> pb.StatusReply: ...

    def heartbeat(self, req: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply | None:
        """One heartbeat (with this worker's received bytes). None means this backend has no heartbeats (MPI watches its ranks)."""
        return None

    def presence(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply | None:
        """Hold a call open until the round's outcome, so the chief sees this process vanish at
        once. None: this backend needs none (in-memory threads and MPI ranks cannot vanish
        unseen)."""
        return None

    def interrupt(self, error: CollectiveError) -> None:  # noqa: B027 - optional
        """Make the call in progress (and any later one) raise ``error``. Thread-safe."""

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release the connection. Idempotent."""


class ChiefEndpoint(abc.ABC):
    """Exposes a ChiefHandler to workers (a relay's or a publication's: ``stream_server``, ``plan_server``)."""

    @abc.abstractmethod
    def start(self, handler: ChiefHandler) -> str:
        """Start serving; returns the address workers should use. Does not block."""

    @abc.abstractmethod
    def stop(self, grace: float) -> None:
        """Stop serving; in-flight calls get up to ``grace`` seconds. Releases the port."""
