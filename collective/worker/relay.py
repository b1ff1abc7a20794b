"""A worker's relay: serves the chunks it has received to the workers below it in the plan.

For the tree and chain topologies each worker runs a small gRPC server speaking the same
Collective service, of which only the data stream (``Fetch`` and its raw-frame form ``FetchRaw``)
is answered, and its raw TCP data port (`collective.transport.rawtcp`). The stream it serves is cut from its
own arena by the same ``Chunker`` as the chief's, each chunk released as soon as its bytes have
arrived here and matched the plan's digest (``progress``), in whatever order they land, so a
chain or a double tree pipelines: every link carries the model about once. A child may ask for
a range of the chunks (``ChunkRange``): a double tree's child takes each tree's half from that
tree's parent.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np

from collective._proto import collective_pb2 as pb
from collective.errors import AbortedError, DeadlineError, PreconditionError
from collective.logs import printable
from collective.plan import Chunker, ChunkRange, Lockstep, sibling_streams, with_bytes
from collective.transport.api import stream_server

log = logging.getLogger(__name__)


def host_towards(chief: str) -> str:
    """This host's address on the interface that reaches ``chief`` (HOST:PORT), for a relay to
    bind: children reach it where the chief saw this worker, and no other interface is opened
    ("localhost", both families, for a chief on this host's loopback). It is the kernel's own
    route choice, read from a UDP socket connected towards the chief (nothing is sent). If the
    chief's name does not resolve yet, every interface ("0.0.0.0") is the fallback."""
    host, _, port = chief.rpartition(":")
    host = host.strip("[]")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, int(port or 0) or 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            local = probe.getsockname()[0]
    except (OSError, ValueError) as exc:
        log.info("no route to the chief at %s yet (%s); the relay listens on every interface", chief, exc)
        return "0.0.0.0"
    if ipaddress.ip_address(local).is_loopback:
        return "localhost"  # both loopbacks: gRPC may reach "localhost" over either family
    return f"[{local}]" if ":" in local else local


class RelayHandler:
    """The ``StreamSource`` of a worker's relay server: the data stream, nothing else (its server
    refuses every other call: ``transport.api.stream_server``). Thread-safe; every wait is bounded."""

    num_workers = 0  # the few children of a tree or chain: their streams fit the server's pool
    refusal = ("this is a worker's relay: it serves only the data stream (Fetch, FetchRaw); "
               "send every other call to the chief")

    def __init__(self, stall_timeout: float) -> None:
        self._cond = threading.Condition()
        self._plan: pb.Plan | None = None
        self._arena: np.ndarray | None = None
        self._known: list[str] | None = None
        self._landed = lambda i: False
        self._failed: str | None = None
        self._stall = stall_timeout
        self._lockstep = Lockstep()

    def feed(self, plan: pb.Plan, arena: np.ndarray, known: list[str] | None = None, landed=None) -> None:
        """Serve ``arena`` under ``plan``; ``known``: the chunk digests this worker verified so
        far by index (its Receiver's ``verified``, growing), the trailers sent while the plan's
        digests follow; ``landed(i)``: whether chunk i is here, verified (its Receiver's). Each
        chunk goes out once it has landed, whatever the order the chunks land in (a double
        tree's two streams); one that failed its check never lands, so it is never forwarded.
        Without ``landed``: every chunk is here (an arena mapped whole)."""
        with self._cond:
            self._plan, self._arena, self._known = plan, arena, known
            self._landed = landed or (lambda i: True)
            self._cond.notify_all()

    def progress(self) -> None:
        """A chunk landed: wake the streams waiting for it."""
        with self._cond:
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        with self._cond:
            self._failed = reason
            self._cond.notify_all()

    def _wait(self, ready, what: str) -> None:
        if not self._cond.wait_for(lambda: ready() or self._failed is not None, timeout=self._stall):
            raise DeadlineError(f"relay had nothing new for {self._stall:g} s while {what}")
        if self._failed is not None:
            raise AbortedError(f"relay stopped: {self._failed}")

    def fetch(self, ref: pb.WorkerRef) -> Iterator[pb.Chunk]:
        return with_bytes(self.stream_views([ref]))

    def stream_views(self, refs: list[pb.WorkerRef]) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """Each chunk the child asked for (``ChunkRange.of``) without its bytes and a view of
        them, released once it has landed here."""
        [ref] = refs
        with self._cond:
            self._wait(lambda: self._plan is not None, "waiting for the plan")
            plan, arena, known = self._plan, self._arena, self._known
            # By id: a worker restarted mid-broadcast (``collective.chief.rejoin``) has an
            # incarnation this plan has never seen.
            if not any(w.worker_id == ref.worker_id for w in plan.workers):
                raise PreconditionError(f"worker {ref.worker_id!r} is not in this round's plan")
        rng = ChunkRange.of(ref, plan)
        resumed = rng.start > rng.phase * plan.chunk_bytes  # past the selection's first chunk
        log.info("relaying to worker %s%s%s", printable(ref.worker_id),
                 f" from byte {rng.start}" if resumed else "",
                 f" chunks {rng.phase} mod {rng.stride}" if rng.stride > 1 else "")

        def landed(i: int) -> None:
            with self._cond:
                self._wait(lambda: self._landed(i), f"relaying to {ref.worker_id}")

        # A double tree's relay with two children keeps their streams in step (``Lockstep``).
        chunker = Chunker(plan, arena, known)
        yield from self._lockstep.frames(chunker, rng, landed, sibling_streams(plan, ref.worker_id, rng))

    def lost(self, ref: pb.WorkerRef, reason: str) -> None:
        log.info("relay stream to worker %s ended early: %s", printable(ref.worker_id), reason)



class Relay:
    """A relay server on ``bind`` (port 0: any). ``port`` is known once constructed."""

    def __init__(self, bind: str, *, token: str | None, tls, stall_timeout: float) -> None:
        from collective.transport.grpc import GrpcEndpoint, relay_server_tls

        self.handler = RelayHandler(stall_timeout)
        served = relay_server_tls(tls)  # mutual TLS: the worker's certificate; server-only: its own
        # The certificate to hand the chief, which puts it in the plan for this relay's children.
        self.cert_pem = (served.cert_pem or b"") if served is not None else b""
        self._endpoint = GrpcEndpoint(bind, token=token, tls=served, name="relay")
        try:
            self._endpoint.start(stream_server(self.handler))
        except BaseException:  # Ctrl-C mid-start: no half-started server left to grpc's finaliser
            self._endpoint.stop(grace=0)
            raise
        self.port = self._endpoint.port
        self._started = time.monotonic()

    def feed(self, plan: pb.Plan, arena: np.ndarray, known: list[str] | None = None, landed=None) -> None:
        self.handler.feed(plan, arena, known, landed)

    def progress(self) -> None:
        self.handler.progress()

    def stop(self, reason: str = "the round is over") -> None:
        self.handler.fail(reason)
        self._endpoint.stop(grace=0.5)
