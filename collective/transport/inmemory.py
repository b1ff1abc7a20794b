"""In-memory backend: a whole cluster inside one process, for unit tests of the logic.

Messages still go through protobuf serialization so the codec is exercised; errors raised by
the handler reach the worker unchanged. Never a substitute for an integration test.
"""

from __future__ import annotations

from collections.abc import Iterator

from collective._proto import collective_pb2 as pb
from collective.errors import ChiefUnreachableError
from collective.transport.api import ChiefEndpoint, ChiefHandler, ChiefLink


def _wire(msg, cls):
    return cls.FromString(msg.SerializeToString())


class InMemoryEndpoint(ChiefEndpoint):
    def __init__(self, name: str = "inmemory") -> None:
        self.name = name
        self.handler: ChiefHandler | None = None

    def start(self, handler: ChiefHandler) -> str:
        self.handler = handler
        return self.name

    def stop(self, grace: float) -> None:
        self.handler = None

    def link(self) -> InMemoryLink:
        return InMemoryLink(self)


class InMemoryLink(ChiefLink):
    def __init__(self, endpoint: InMemoryEndpoint, peer: str = "inmemory-worker") -> None:
        self._endpoint = endpoint
        self.address = endpoint.name
        self._peer = peer

    def _handler(self) -> ChiefHandler:
        if self._endpoint.handler is None:
            raise ChiefUnreachableError(f"chief at {self.address} is not serving")
        return self._endpoint.handler

    def join(self, req: pb.JoinRequest, timeout: float) -> pb.JoinReply:
        return _wire(self._handler().join(_wire(req, pb.JoinRequest), self._peer), pb.JoinReply)

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        return _wire(self._handler().get_plan(_wire(ref, pb.WorkerRef), timeout), pb.Plan)

    def await_prepared(self, ref: pb.WorkerRef, timeout: float) -> pb.PreparedReply:
        return _wire(self._handler().await_prepared(_wire(ref, pb.WorkerRef), timeout), pb.PreparedReply)

    def fetch(self, ref: pb.WorkerRef, stall_timeout: float) -> Iterator[pb.Chunk]:
        for chunk in self._handler().fetch(_wire(ref, pb.WorkerRef)):
            yield _wire(chunk, pb.Chunk)

    def report_ready(self, req: pb.ReadyRequest, timeout: float) -> pb.ReadyReply:
        return _wire(self._handler().report_ready(_wire(req, pb.ReadyRequest)), pb.ReadyReply)

    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply:
        return _wire(self._handler().await_start(_wire(ref, pb.WorkerRef), timeout), pb.StartReply)

    def report_failure(self, req: pb.FailureReport, timeout: float) -> None:
        try:
            self._handler().report_failure(_wire(req, pb.FailureReport))
        except Exception:  # noqa: BLE001 - best effort by contract
            pass

    def heartbeat(self, ref: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        return _wire(self._handler().heartbeat(_wire(ref, pb.HeartbeatRequest)), pb.HeartbeatReply)

    def status(self, timeout: float, brief: bool = False) -> pb.StatusReply:
        return _wire(self._handler().status(brief), pb.StatusReply)
