"""The gRPC server: the servicer over a ``ChiefHandler`` and the endpoint that runs it (with the raw data port)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import itertools
import logging
import socket
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective._proto import collective_pb2_grpc as pb_grpc
from collective.config import TlsFiles
from collective.limits import MAX_ERROR_CHARS, join_fields_limit
from collective.logs import printable
from collective.plan import MAX_PIECED_BYTES, from_pieces, to_pieces
from collective.transport.api import ChiefEndpoint, ChiefHandler
from collective.transport.grpc.admission import BODY_TIMEOUT, RefusalLog, _Admission, _BodyWatch
from collective.transport.grpc.tls import peer_identities, server_credentials
from collective.transport.grpc.wire import (
    SERVER_OPTIONS,
    SERVICE,
    error_metadata,
    frame,
    status_code,
)

log = logging.getLogger(__name__)


# --- server ------------------------------------------------------------------------------


class _Servicer(pb_grpc.CollectiveServicer):
    """The service boundary: every handler error becomes a status the client maps back.

    A ``CollectiveError`` keeps its class (the ``errors`` table); anything else is a bug in this process:
    INTERNAL naming the method and the exception, with the traceback in this process's log.
    """

    def __init__(self, handler: ChiefHandler, *, bind_identity: bool = False, name: str = "chief") -> None:
        self._h = handler
        self._bind_identity = bind_identity
        self._plan_lock = threading.Lock()
        self._plan_bytes: tuple[pb.Plan | None, bytes] = (None, b"")
        self._name = name

    def _identity(self, context, worker_id: str) -> None:
        """With mutual TLS, a worker may only act under the id its certificate names."""
        if not self._bind_identity:
            return
        names = peer_identities(context)
        if worker_id not in names:
            log.warning("refused worker id %s from %s: its certificate names %s",
                        printable(repr(worker_id)), printable(context.peer()), printable(sorted(names)))
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"worker id {worker_id!r} refused: the client certificate names {', '.join(sorted(names)) or 'nobody'}",
            )

    @contextlib.contextmanager
    def _boundary(self, context, method: str, ref: pb.WorkerRef | None = None, what: str = ""):
        """Map what the handler raises to a status. With ``ref``, a call that ends before it was
        answered (process gone, link cut) is reported to the handler as lost."""
        answered = [ref is None]
        if ref is not None:

            def on_end() -> None:
                if not answered[0]:
                    self._h.lost(ref, f"its {what} call was cut off (process gone or connection lost)")

            context.add_callback(on_end)
        try:
            yield
        except E.CollectiveError as exc:
            answered[0] = True
            context.set_trailing_metadata(error_metadata(exc))
            # Cut here, where every refusal leaves: a message quoting a peer's 10 MB name must
            # still fit the status (else the peer gets RESOURCE_EXHAUSTED, not the reason).
            context.abort(status_code(exc), printable(str(exc), limit=MAX_ERROR_CHARS))
        except Exception as exc:
            answered[0] = True
            log.exception("%s from %s failed inside the %s", method, printable(context.peer()), self._name)
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"{method} failed inside the {self._name} ({type(exc).__name__}: {printable(exc)}); "
                f"this is a bug: the {self._name}'s log has the traceback",
            )
        finally:
            answered[0] = True

    def _call(self, context, method: str, fn, *args):
        with self._boundary(context, method):
            return fn(*args)

    def _long_call(self, context, method: str, ref, what: str, fn, *args):
        with self._boundary(context, method, ref, what):
            return fn(*args, _remaining(context))

    def Join(self, request, context):  # noqa: N802 - gRPC method names
        self._identity(context, request.worker_id)
        return self._call(context, "Join", self._h.join, request, context.peer())

    def GetPlan(self, request, context):  # noqa: N802
        """The plan in pieces (``collective.plan.to_pieces``): a plan of any size fits."""
        self._identity(context, request.worker_id)
        plan = self._long_call(context, "GetPlan", request, "plan", self._h.get_plan, request)
        yield from to_pieces(self._serialized(plan))

    def _serialized(self, plan: pb.Plan) -> bytes:
        """Every worker gets the same plan: serialize it once (20 MiB of names take 0.1 s)."""
        with self._plan_lock:
            if self._plan_bytes[0] is not plan:
                self._plan_bytes = (plan, plan.SerializeToString())
            return self._plan_bytes[1]

    def AwaitPrepared(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._long_call(context, "AwaitPrepared", request, "prepared", self._h.await_prepared, request)

    def FetchRaw(self, request, context):  # noqa: N802
        """Fetch as raw frames (see ``frame``): the chunk's bytes are copied once, into the frame."""
        self._identity(context, request.worker_id)
        with self._boundary(context, "FetchRaw", request, "data stream"):
            for msg, data in self._h.stream_views([request]):
                yield frame(msg, data)

    def Fetch(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        with self._boundary(context, "Fetch", request, "data stream"):
            yield from self._h.fetch(request)

    def ReportReady(self, request_iterator, context):  # noqa: N802
        """A ReadyRequest in pieces: every device's chunk digests of a model of any size fit.

        The first piece names the sender (``Piece.worker``, with its secret): a call from anyone
        but a member is refused there, and a member's stops at what its report can be
        (``ready_bytes``), so no one makes the chief hold more than that. Each piece comes within
        the body deadline (``admission``)."""
        pieces = iter(request_iterator)
        first = self._call(context, "ReportReady", _first_piece, pieces)
        self._identity(context, first.worker.worker_id)
        request = self._call(context, "ReportReady", self._ready_request, first, pieces, context.peer())
        return self._call(context, "ReportReady", self._h.report_ready, request)

    def _ready_request(self, first: pb.Piece, pieces, peer: str) -> pb.ReadyRequest:
        # Raises for a non-member or a wrong secret; never past MAX_PIECED_BYTES, whatever a member joined with.
        limit = min(self._h.ready_bytes(first.worker), MAX_PIECED_BYTES)
        sender = f"worker {printable(first.worker.worker_id)} at {printable(peer)}"
        request = from_pieces(pb.ReadyRequest, itertools.chain([first], pieces), sender, max_bytes=limit)
        if request.worker != first.worker:
            raise E.ProtocolError(f"{sender} sent a ready report whose worker is not the one its first piece names")
        return request

    def AwaitStart(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._long_call(context, "AwaitStart", request, "start", self._h.await_start, request)

    def Heartbeat(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._call(context, "Heartbeat", self._h.heartbeat, request)

    def ReportFailure(self, request, context):  # noqa: N802
        self._identity(context, request.worker.worker_id)
        return self._call(context, "ReportFailure", self._h.report_failure, request)

    def Status(self, request, context):  # noqa: N802
        return self._call(context, "Status", self._h.status)

    def Presence(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._long_call(context, "Presence", request, "presence", self._h.await_outcome, request)


def _first_piece(pieces) -> pb.Piece:
    first = next(pieces, None)
    if first is None or not first.HasField("worker"):
        raise E.ProtocolError("ReportReady refused: its first piece must name the worker (Piece.worker)")
    return first


def _remaining(context) -> float:
    """Seconds until the caller's deadline, less a margin so our answer beats it."""
    left = context.time_remaining()
    return 3600.0 if left is None else max(0.0, left - 0.5)


def pool_size(handler) -> int:
    """Threads a server needs for ``handler``: a worker holds at most CALLS_PER_WORKER calls at
    once (a long-poll or stream on its data connection, Heartbeat and Presence on its own, and
    ReportFailure), plus 8 for Status and what arrives while calls end."""
    return CALLS_PER_WORKER * max(int(getattr(handler, "num_workers", 0)), 0) + 8


CALLS_PER_WORKER = 4


def _model_variables(handler) -> int:
    """How many variables the served model has: 0 while a chief bound first still loads it
    (``chief/pending.py`` stands in for the service until then)."""
    served = getattr(handler, "service", None) or handler
    return len(getattr(served, "specs", None) or ())


class GrpcEndpoint(ChiefEndpoint):
    """Serves ``handler`` on ``bind`` (``HOST:PORT``; port 0 picks a free one).

    The thread pool is sized from the handler (``pool_size``) unless ``max_workers`` is given;
    ``name`` says who serves (chief, relay) in statuses and logs.
    """

    def __init__(
        self,
        bind: str,
        *,
        token: str | None = None,
        max_workers: int | None = None,
        tls: TlsFiles | None = None,
        name: str = "chief",
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
        self.bind = bind
        self.token = token
        self.tls = tls if tls is not None and tls.enabled else None
        self._credentials = server_credentials(self.tls) if self.tls else None  # refuse bad setups early
        self.max_workers = max_workers
        self.name = name
        self.body_timeout = body_timeout
        self.port = 0
        self._server: grpc.Server | None = None
        self._data = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self._health: health.HealthServicer | None = None
        self._refusals = RefusalLog()
        self._body: _BodyWatch | None = None

    def start(self, handler: ChiefHandler) -> str:
        _check_bindable(self.bind)
        self.max_workers = self.max_workers or pool_size(handler)
        self._warn_if_open()
        # Half the pool may wait for requests that never come; the other half serves the rest.
        self._body = _BodyWatch(self.body_timeout, self._refusals, max_waiting=self.max_workers // 2)
        self._pool = futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=f"{self.name}-rpc")
        server = grpc.server(
            self._pool,
            interceptors=[_Admission(self.token, self._refusals, self._body,
                                     fields={"Join": lambda: join_fields_limit(_model_variables(handler))})],
            options=SERVER_OPTIONS,
        )
        bind_identity = bool(self.tls and self.tls.has("ca"))
        servicer = _Servicer(handler, bind_identity=bind_identity, name=self.name)
        pb_grpc.add_CollectiveServicer_to_server(servicer, server)
        raw = grpc.unary_stream_rpc_method_handler(
            servicer.FetchRaw, request_deserializer=pb.WorkerRef.FromString, response_serializer=None
        )
        self._data = self._data_server(handler, bind_identity)
        port_answer = f"{self._data.port} {self._data.unix_name or ''}".strip().encode() if self._data else b""
        data_path = grpc.unary_unary_rpc_method_handler(
            lambda request, context: port_answer, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"FetchRaw": raw, "DataPath": data_path}),)
        )
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            if self._credentials is not None:
                port = server.add_secure_port(_same_port_everywhere(self.bind), self._credentials)
            else:
                port = server.add_insecure_port(_same_port_everywhere(self.bind))
        except RuntimeError as exc:
            self._body.close()
            raise E.UsageError(f"cannot listen on {self.bind}: {exc}; is the port in use?") from exc
        if not port:
            self._body.close()
            raise E.UsageError(f"cannot listen on {self.bind}: the port is in use or the address is not local")
        self._server = server  # before start: a Ctrl-C landing in start still leaves stop() a server to stop
        server.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.port = port
        host = self.bind.rpartition(":")[0]
        return f"{host}:{port}"

    def _warn_if_open(self) -> None:
        """Anyone who can reach a non-loopback address may join a server without a token."""
        host = self.bind.rpartition(":")[0].strip("[]")
        if self.token or is_loopback(host):
            return
        log.warning(
            "the %s listens on %s WITHOUT a cluster token: anyone who can reach this address can join "
            "and read the model; set COLLECTIVE_TOKEN (or --token) or bind 127.0.0.1", self.name, self.bind,
        )

    def _data_server(self, handler: ChiefHandler, bind_identity: bool):
        """The raw TCP data path beside this server (None with COLLECTIVE_DATA_PATH=grpc)."""
        from collective.transport import rawtcp

        if not rawtcp.enabled():
            return None
        try:
            return rawtcp.DataServer(
                self.bind.rpartition(":")[0], handler, token=self.token,
                tls=rawtcp.server_context(self.tls) if self.tls else None,
                identities=rawtcp.certificate_names if bind_identity else None, refused=self._refusals.refused,
            )
        except OSError as exc:  # the stream still works, over gRPC
            log.warning("no raw data port on %s (%s): workers receive over gRPC", self.bind, exc)
            return None

    def stop(self, grace: float) -> None:
        if getattr(self, "_data", None) is not None:
            self._data.close()
            self._data = None
        if self._health is not None:
            self._health.enter_graceful_shutdown()  # NOT_SERVING for every service
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # grpc does not own its pool
            self._pool = None
        if self._body is not None:
            self._body.close()
            self._body = None
        self._refusals.flush()


def _check_bindable(bind: str) -> None:
    """Bind ``bind`` once with a plain socket, as gRPC is about to, so a port in use or an
    address not on this host is one line naming it (gRPC's own failure prints a C-core log line
    and a message that points at GRPC_VERBOSITY). Port 0 and names that do not resolve are left
    to gRPC."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    for family, kind, proto, _, address in infos[:1]:  # gRPC binds the first (dual-stack for ::)
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is no obstacle
            try:
                probe.bind(address)
            except OSError as exc:
                why = {errno.EADDRINUSE: "the port is in use (another chief or relay?); pick another port or stop that process",
                       errno.EADDRNOTAVAIL: "that address is not on this host; bind one of its addresses or 0.0.0.0",
                       errno.EACCES: "permission denied (ports below 1024 need privileges); pick a port above 1023"}
                raise E.UsageError(f"cannot listen on {bind}: {why.get(exc.errno, exc.strerror or str(exc))}") from None


def _same_port_everywhere(bind: str, tries: int = 50, first: tuple[int, ...] = ()) -> str:
    """``bind``, or for port 0 on a name with several addresses (``localhost``: 127.0.0.1 and
    ::1) ``host:P`` with a port P free on every one of them.

    gRPC binds such a name by taking a free port on the first address and then the same port on
    the others; when another process holds that port on one of them, gRPC only warns and serves
    on the rest, and a peer dialling that address reaches the other process (seen under load:
    a chain's child connected to a stranger where its relay should have been). ``first``:
    ports to try before free ones the kernel picks (for tests)."""
    host, _, port = bind.rpartition(":")
    if port != "0":
        return bind
    if host == "localhost":  # gRPC's own rule, whatever /etc/hosts says: both loopbacks
        addresses = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    else:
        try:
            infos = socket.getaddrinfo(host.strip("[]") or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError:
            return bind
        addresses = list(dict.fromkeys((family, address[0]) for family, _, _, _, address in infos))
    if len(addresses) < 2:
        return bind
    for candidate in (*first, *([0] * tries)):
        probes: list[socket.socket] = []
        try:
            for family, address in addresses:
                try:
                    probe = socket.socket(family, socket.SOCK_STREAM)
                except OSError:  # no such family here (no IPv6): gRPC will not bind it either
                    continue
                probes.append(probe)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    probe.bind((address, probes[0].getsockname()[1] if len(probes) > 1 else candidate))
                except OSError as exc:
                    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) and len(probes) > 1:
                        continue  # an address this host lacks (::1 without IPv6)
                    raise
            return f"{host}:{probes[0].getsockname()[1]}"
        except OSError:
            continue  # that port is taken on one of the addresses: another one
        finally:
            for probe in probes:
                probe.close()
    return bind


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: addresses no other host can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
