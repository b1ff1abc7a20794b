"""gRPC backend: the chief serves ``collective.v1.Collective``; workers are clients.

A worker calls Join, GetPlan, AwaitPrepared (the barrier before the first byte), FetchRaw (the
data stream as raw frames; Fetch is the same stream as protobuf messages), ReportReady and
AwaitStart; from join until start it sends Heartbeat and holds a Presence call (both on a
connection of their own), and ReportFailure when it fails. Status serves ``collective status``.
FetchRaw is a generic handler outside the .proto; the other ten are the service's RPCs.

Guarantees: every client call has a deadline; a silent data stream is cancelled after the stall
timeout; the chief's errors arrive as the same ``CollectiveError`` class with the same message;
a wrong or missing cluster token gets UNAUTHENTICATED on every Collective RPC before any
handler runs (constant-time comparison; the log names the peer, never the token). The standard
health service reports SERVING while the chief serves and NOT_SERVING once it stops.
"""

from __future__ import annotations

import hmac
import logging
import struct
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective._proto import collective_pb2_grpc as pb_grpc
from collective.plan import MAX_CHUNK_BYTES
from collective.transport.api import ChiefEndpoint, ChiefHandler, ChiefLink

log = logging.getLogger(__name__)

TOKEN_HEADER = "x-collective-token"
SERVICE = "collective.v1.Collective"
MAX_MESSAGE = MAX_CHUNK_BYTES + (1 << 20)
_MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
CLIENT_OPTIONS = _MESSAGE_OPTIONS + [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
SERVER_OPTIONS = _MESSAGE_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]

# One table, read both ways: the chief's error class <-> the status code on the wire.
_CODES: list[tuple[type[E.CollectiveError], grpc.StatusCode]] = [
    (E.AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (E.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (E.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (E.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (E.ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (E.DeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (E.IntegrityError, grpc.StatusCode.DATA_LOSS),
    (E.AbortedError, grpc.StatusCode.ABORTED),
]
_CLASS_OF = {code: cls for cls, code in _CODES}


def status_code(exc: E.CollectiveError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.ABORTED  # any other failure of the round aborts it


# --- raw frames -------------------------------------------------------------------------------

# FetchRaw is not in the .proto: a generic handler with identity serialisation, so a chunk's
# bytes are not wrapped in (and copied by) a protobuf message on either side.
RAW_FETCH = f"/{SERVICE}/FetchRaw"
# DataPath (generic, like FetchRaw) answers the port of the raw TCP data path (``rawtcp``) as
# ASCII digits, or nothing when this endpoint has none; the token interceptor guards it.
DATA_PATH = f"/{SERVICE}/DataPath"
_LEN = struct.Struct("<I")


def frame(msg: pb.Chunk, data) -> bytes:
    meta = msg.SerializeToString()
    return b"".join((_LEN.pack(len(meta)), meta, data))


def split_frame(raw: bytes) -> tuple[pb.Chunk, memoryview]:
    """Metadata and bytes of a raw frame. Raises ProtocolError for a malformed frame."""
    if len(raw) < _LEN.size:
        raise E.ProtocolError(f"raw frame of {len(raw)} bytes is shorter than its length prefix")
    (n,) = _LEN.unpack_from(raw, 0)
    if _LEN.size + n > len(raw):
        raise E.ProtocolError(f"raw frame says its metadata has {n} bytes; the frame has {len(raw)}")
    view = memoryview(raw)
    try:
        meta = pb.Chunk.FromString(view[_LEN.size : _LEN.size + n])
    except DecodeError as exc:
        raise E.ProtocolError(f"raw frame metadata is not a Chunk: {exc}") from None
    if meta.data:
        raise E.ProtocolError("raw frame metadata carries bytes of its own")
    return meta, view[_LEN.size + n :]


# --- TLS -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """PEM files. Chief: cert+key (its own), ca (clients' CA: mutual TLS, client auth required).
    Worker: ca (the CA of the chief's certificate), cert+key (its client certificate, for mTLS)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None  # worker: the name the chief's certificate must carry

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def read(self, which: str) -> bytes | None:
        path = getattr(self, which)
        if not path:
            return None
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise E.UsageError(f"--tls-{which} {path}: cannot read it ({exc.strerror})") from None
        if b"-----BEGIN" not in data:
            raise E.UsageError(f"--tls-{which} {path}: not a PEM file")
        return data

    def server_credentials(self) -> grpc.ServerCredentials:
        """Refuses a half-configured chief: cert without key, or a client CA without a cert."""
        if bool(self.cert) != bool(self.key):
            raise E.UsageError("--tls-cert and --tls-key go together: give the chief's certificate and its key")
        if self.ca and not self.cert:
            raise E.UsageError(
                "--tls-ca (the CA of client certificates) needs the chief's own --tls-cert and --tls-key"
            )
        return grpc.ssl_server_credentials(
            [(self.read("key"), self.read("cert"))],
            root_certificates=self.read("ca"),
            require_client_auth=bool(self.ca),  # a client CA always means client auth is required
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise E.UsageError("--tls-cert and --tls-key go together: give this worker's certificate and its key")
        if not self.ca:
            raise E.UsageError("--tls-ca is required with TLS: the CA that signed the chief's certificate")
        return grpc.ssl_channel_credentials(
            root_certificates=self.read("ca"), private_key=self.read("key"), certificate_chain=self.read("cert")
        )


def peer_identities(context) -> set[str]:
    """Names in the verified client certificate (CN and SANs); empty without mutual TLS."""
    auth = context.auth_context() or {}
    names = list(auth.get("x509_common_name", [])) + list(auth.get("x509_subject_alternative_name", []))
    return {n.decode() if isinstance(n, bytes) else n for n in names}


# --- server ------------------------------------------------------------------------------


class _Servicer(pb_grpc.CollectiveServicer):
    def __init__(self, handler: ChiefHandler, *, bind_identity: bool = False) -> None:
        self._h = handler
        self._bind_identity = bind_identity

    def _identity(self, context, worker_id: str) -> None:
        """With mutual TLS, a worker may only act under the id its certificate names."""
        if not self._bind_identity:
            return
        names = peer_identities(context)
        if worker_id not in names:
            log.warning("refused worker id %r from %s: its certificate names %s", worker_id, context.peer(), sorted(names))
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"worker id {worker_id!r} refused: the client certificate names {', '.join(sorted(names)) or 'nobody'}",
            )

    def _call(self, context, fn, *args):
        try:
            return fn(*args)
        except E.CollectiveError as exc:
            context.abort(status_code(exc), str(exc))

    def _watch(self, context, ref: pb.WorkerRef, what: str) -> list[bool]:
        """Tell the handler if this call ends before we answered: the worker is gone."""
        answered = [False]

        def on_end() -> None:
            if not answered[0]:
                self._h.lost(ref, f"its {what} call was cut off (process gone or connection lost)")

        context.add_callback(on_end)
        return answered

    def _long_call(self, context, ref, what, fn, *args):
        answered = self._watch(context, ref, what)
        try:
            return fn(*args)
        except E.CollectiveError as exc:
            answered[0] = True
            context.abort(status_code(exc), str(exc))
        finally:
            answered[0] = True

    def Join(self, request, context):  # noqa: N802 - gRPC method names
        self._identity(context, request.worker_id)
        return self._call(context, self._h.join, request, context.peer())

    def GetPlan(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._long_call(context, request, "plan", self._h.get_plan, request, _remaining(context))

    def AwaitPrepared(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._long_call(context, request, "prepared", self._h.await_prepared, request, _remaining(context))

    def FetchRaw(self, request, context):  # noqa: N802
        """Fetch as raw frames (see ``frame``): the chunk's bytes are copied once, into the frame."""
        self._identity(context, request.worker_id)
        answered = self._watch(context, request, "data stream")
        try:
            for msg, data in self._h.stream_views([request]):
                yield frame(msg, data)
        except E.CollectiveError as exc:
            answered[0] = True
            context.abort(status_code(exc), str(exc))
        answered[0] = True

    def Fetch(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        answered = self._watch(context, request, "data stream")
        try:
            yield from self._h.fetch(request)
        except E.CollectiveError as exc:
            answered[0] = True
            context.abort(status_code(exc), str(exc))
        answered[0] = True

    def ReportReady(self, request, context):  # noqa: N802
        self._identity(context, request.worker.worker_id)
        return self._call(context, self._h.report_ready, request)

    def AwaitStart(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._long_call(context, request, "start", self._h.await_start, request, _remaining(context))

    def Heartbeat(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._call(context, self._h.heartbeat, request)

    def ReportFailure(self, request, context):  # noqa: N802
        self._identity(context, request.worker.worker_id)
        return self._call(context, self._h.report_failure, request)

    def Status(self, request, context):  # noqa: N802
        return self._call(context, self._h.status)

    def Presence(self, request, context):  # noqa: N802
        self._identity(context, request.worker_id)
        return self._long_call(context, request, "presence", self._h.await_outcome, request, _remaining(context))


def _remaining(context) -> float:
    """Seconds until the caller's deadline, less a margin so our answer beats it."""
    left = context.time_remaining()
    return 3600.0 if left is None else max(0.0, left - 0.5)


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuse every Collective RPC whose token is missing or wrong, before any handler runs."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler  # the health service answers without a token
        given = dict(details.invocation_metadata).get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode(), self._token):
            return handler
        reason = "no cluster token" if not given else "a wrong cluster token"
        method = details.method.rsplit("/", 1)[-1]

        def refuse(request, context):
            log.warning("refused %s from %s: %s", method, context.peer(), reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} refused: {reason}")

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                refuse, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )


class GrpcEndpoint(ChiefEndpoint):
    """Serves the chief on ``bind`` (``HOST:PORT``; port 0 picks a free one)."""

    def __init__(
        self, bind: str, *, token: str | None = None, max_workers: int = 16, tls: TlsFiles | None = None
    ) -> None:
        self.bind = bind
        self.token = token
        self.tls = tls if tls is not None and tls.enabled else None
        self._credentials = self.tls.server_credentials() if self.tls else None  # refuse bad setups early
        self.max_workers = max_workers
        self.port = 0
        self._server: grpc.Server | None = None
        self._data = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self._health: health.HealthServicer | None = None

    def start(self, handler: ChiefHandler) -> str:
        interceptors = [_TokenInterceptor(self.token)] if self.token else []
        self._pool = futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="chief-rpc")
        server = grpc.server(
            self._pool,
            interceptors=interceptors,
            options=SERVER_OPTIONS,
        )
        bind_identity = bool(self.tls and self.tls.ca)
        servicer = _Servicer(handler, bind_identity=bind_identity)
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
                port = server.add_secure_port(self.bind, self._credentials)
            else:
                port = server.add_insecure_port(self.bind)
        except RuntimeError as exc:
            raise E.UsageError(f"cannot listen on {self.bind}: {exc}; is the port in use?") from exc
        if not port:
            raise E.UsageError(f"cannot listen on {self.bind}: the port is in use or the address is not local")
        server.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
        host = self.bind.rpartition(":")[0]
        return f"{host}:{port}"

    def _data_server(self, handler: ChiefHandler, bind_identity: bool):
        """The raw TCP data path beside this server (None with COLLECTIVE_DATA_PATH=grpc)."""
        from collective.transport import rawtcp

        if not rawtcp.enabled():
            return None
        try:
            return rawtcp.DataServer(
                self.bind.rpartition(":")[0], handler, token=self.token, status=status_code,
                tls=rawtcp.server_context(self.tls) if self.tls else None,
                identities=rawtcp.certificate_names if bind_identity else None,
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


# --- client ------------------------------------------------------------------------------


class _NoDataPort(Exception):
    """The sender's raw TCP data port cannot be reached: FetchRaw over gRPC instead."""


class GrpcChiefLink(ChiefLink):
    """A worker's channel to the chief at ``address``."""

    def __init__(
        self, address: str, *, token: str | None = None, tls: TlsFiles | None = None, name: str = "chief"
    ) -> None:
        """``name`` is who serves at ``address`` in messages: the chief, or a relay worker."""
        self.address = address
        self.name = name
        self._metadata = ((TOKEN_HEADER, token),) if token else ()
        self._token = token
        self.tls = tls if tls is not None and tls.enabled else None
        self._channel = self._open("data")
        self._stub = pb_grpc.CollectiveStub(self._channel)
        # Heartbeats get a TCP connection of their own: on a slow link a reply queued behind
        # megabytes of chunks in the data connection would arrive too late and look like death.
        self._hb_channel = self._open("heartbeat")
        self._hb_stub = pb_grpc.CollectiveStub(self._hb_channel)
        self._lock = threading.Lock()
        self._active: set = set()
        self._interrupted: E.CollectiveError | None = None
        self.retry_window = 0.0  # set by the worker to its heartbeat lease

    def _open(self, purpose: str) -> grpc.Channel:
        # A local subchannel pool keeps the two channels from sharing one connection.
        options = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1), ("collective.purpose", purpose)]
        if self.tls is None:
            return grpc.insecure_channel(self.address, options=options)
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.secure_channel(self.address, self.tls.channel_credentials(), options=options)

    def interrupt(self, error: E.CollectiveError) -> None:
        with self._lock:
            if self._interrupted is None:
                self._interrupted = error
            active = list(self._active)
        for call in active:
            call.cancel()

    def _track(self, call) -> None:
        with self._lock:
            if self._interrupted is not None:
                call.cancel()
            self._active.add(call)

    def _untrack(self, call) -> None:
        with self._lock:
            self._active.discard(call)

    def _error(self, exc: Exception, phase: str, timeout: float) -> E.CollectiveError:
        if not isinstance(exc, grpc.RpcError):
            return E.ChiefUnreachableError(f"{self.name} at {self.address}: {phase} was cancelled")
        return self._error_of(exc.code(), exc.details() or "", phase, timeout)

    def _error_of(self, code: grpc.StatusCode, details: str, phase: str, timeout: float) -> E.CollectiveError:
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return E.AuthError(
                f"{self.name} at {self.address} refused the cluster token during {phase} ({details}); "
                f"pass the chief's token with --token or COLLECTIVE_TOKEN"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            return E.ChiefUnreachableError(f"{self.name} at {self.address} unreachable during {phase}: {details}{self._tls_hint(details)}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            return E.ChiefUnreachableError(f"{self.name} at {self.address} did not answer within {timeout:g} s during {phase}")
        if code == grpc.StatusCode.CANCELLED:
            return E.ChiefUnreachableError(f"{self.name} at {self.address}: {phase} was cancelled ({details})")
        cls = _CLASS_OF.get(code, E.AbortedError)
        return cls(f"{self.name} at {self.address}: {details}" if cls is not E.AbortedError else f"round aborted by the chief at {self.address}: {details}")

    def _tls_hint(self, details: str) -> str:
        low = details.lower()
        if self.tls is None and ("ssl" in low or "handshake" in low or "socket closed" in low):
            return "; if the chief uses TLS, pass --tls-ca (and --tls-cert/--tls-key for mutual TLS)"
        if self.tls is not None and any(w in low for w in ("ssl", "handshake", "certificate", "socket closed")):
            return (
                "; TLS handshake failed: check that --tls-ca is the CA that signed the chief's certificate, "
                "that the chief's certificate names the host you dial (or set --tls-server-name), and that "
                "your --tls-cert is signed by the CA the chief trusts"
            )
        return ""

    def _unary(self, method, request, phase: str, timeout: float, *, retry: bool = False):
        """One call with a deadline. ``retry``: an idempotent long-poll that rides out a dropped
        connection for up to ``retry_window`` s (the chief restarting, a network blip); the
        heartbeat thread interrupts it sooner if the chief is really gone or restarted."""
        deadline = time.monotonic() + timeout
        down_since = None
        while True:
            if self._interrupted is not None:
                raise self._interrupted
            future = method.future(request, timeout=max(0.01, deadline - time.monotonic()), metadata=self._metadata)
            self._track(future)
            try:
                return future.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                if self._interrupted is not None:
                    raise self._interrupted from None
                now = time.monotonic()
                unavailable = isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
                if retry and unavailable and now < deadline:
                    down_since = down_since or now
                    if now - down_since < self.retry_window:
                        time.sleep(0.2)
                        continue
                raise self._error(exc, phase, timeout) from None
            finally:
                self._untrack(future)

    def join(self, req: pb.JoinRequest, timeout: float) -> pb.JoinReply:
        deadline = time.monotonic() + timeout
        last = "no answer"
        backoff, refusals = 0.1, 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise E.ChiefUnreachableError(
                    f"{self.name} at {self.address} unreachable for {timeout:g} s while joining ({last}); "
                    f"check --chief / COLLECTIVE_CHIEF and that the chief is running{self._tls_hint(last)}"
                )
            try:
                # Fail fast (no wait_for_ready) so a refused handshake shows its real reason.
                return self._stub.Join(req, timeout=min(left, 5.0), metadata=self._metadata)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    last = exc.details() or exc.code().name
                    hint = self._tls_hint(last)
                    refusals = refusals + 1 if hint else 0
                    if refusals >= 3:  # a listening chief that keeps closing on us: not a start-up race
                        raise E.AuthError(f"{self.name} at {self.address} refused the connection during join: {last}{hint}") from None
                    log.info("chief at %s not reachable yet (%s); retrying for %.0f s more", self.address, last, left)
                    time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                    backoff = min(1.0, backoff * 2)
                    continue
                raise self._error(exc, "join", timeout) from None

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        return self._unary(self._stub.GetPlan, ref, "join (waiting for the plan)", timeout, retry=True)

    def await_prepared(self, ref: pb.WorkerRef, timeout: float) -> pb.PreparedReply:
        return self._unary(self._stub.AwaitPrepared, ref, "waiting for every worker to prepare", timeout, retry=True)

    def fetch(self, ref: pb.WorkerRef, stall_timeout: float) -> Iterator[pb.Chunk]:
        return self._stream(self._stub.Fetch, ref, stall_timeout)

    def receive_into(self, ref: pb.WorkerRef, receiver, stall_timeout: float) -> None:
        """The data stream as raw frames: each chunk's bytes are written once, into the arena.

        A frame is a 4-byte little-endian length, the chunk's metadata (a Chunk without data)
        and its bytes, carried by FetchRaw without protobuf around the bytes.
        """
        port, unix_name = self._data_port(stall_timeout)
        if port:
            try:
                return self._receive_raw_tcp(port, unix_name, ref, receiver, stall_timeout)
            except _NoDataPort as exc:
                log.warning("%s at %s: its data port %d cannot be reached (%s); receiving over gRPC",
                            self.name, self.address, port, exc)
        raw = self._channel.unary_stream(
            RAW_FETCH, request_serializer=pb.WorkerRef.SerializeToString, response_deserializer=None
        )
        for frame in self._stream(raw, ref, stall_timeout):
            meta, data = split_frame(frame)
            view = receiver.view(meta.offset, len(data))  # checks offset and length first
            if len(data):
                view[...] = np.frombuffer(data, dtype=np.uint8)
            receiver.accept(meta, placed=True)

    def _data_port(self, timeout: float) -> tuple[int, str | None]:
        """The sender's raw data path: its TCP port (0: none, switched off or an older sender)
        and the name of its abstract unix socket, if it has one."""
        from collective.transport import rawtcp

        if not rawtcp.enabled():
            return 0, None
        ask = self._channel.unary_unary(DATA_PATH, request_serializer=None, response_deserializer=None)
        if self._interrupted is not None:
            raise self._interrupted
        future = ask.future(b"", timeout=timeout, metadata=self._metadata)
        self._track(future)
        try:
            answer = future.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            if self._interrupted is not None:
                raise self._interrupted from None
            if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0, None
            raise self._error(exc, "receive", timeout) from None
        finally:
            self._untrack(future)
        port, _, unix_name = answer.decode(errors="replace").partition(" ")
        return (int(port), unix_name or None) if port.isdigit() else (0, None)

    def _receive_raw_tcp(self, port: int, unix_name: str | None, ref: pb.WorkerRef, receiver,
                         stall_timeout: float) -> None:
        """The data stream over the raw TCP data path (see ``rawtcp``), errors mapped as for gRPC."""
        import socket
        import ssl

        from collective.transport import rawtcp

        if self._interrupted is not None:
            raise self._interrupted
        host = rawtcp.split_host(self.address)[0]
        server_name = self.tls.server_name if self.tls else None
        try:
            sock = rawtcp.connect(host, port, timeout=stall_timeout, server_name=server_name,
                                  unix_name=unix_name if rawtcp.mode() == "auto" else None,
                                  tls=rawtcp.client_context(self.tls) if self.tls else None)
        except rawtcp.Refused as exc:
            raise _NoDataPort(str(exc)) from None
        except (OSError, ssl.SSLError) as exc:
            raise E.ChiefUnreachableError(
                f"{self.name} at {self.address} unreachable during receive: data port {port}: {exc}"
                f"{self._tls_hint(str(exc))}"
            ) from None
        log.info("receiving from %s at %s over its raw data path (%s)", self.name, self.address,
                 "unix socket, same host" if sock.family == socket.AF_UNIX else f"TCP port {port}")
        try:
            rawtcp.receive(
                sock, ref, self._token, receiver, stall_timeout=stall_timeout,
                track=self._track, untrack=self._untrack,
                fail=lambda code, message: self._error_of(
                    getattr(grpc.StatusCode, code, grpc.StatusCode.ABORTED), message, "receive", stall_timeout),
            )
        except (OSError, ssl.SSLError) as exc:
            if self._interrupted is not None:
                raise self._interrupted from None
            if isinstance(exc, socket.timeout):
                raise E.ChiefUnreachableError(
                    f"{self.name} at {self.address} sent nothing for {stall_timeout:g} s during receive"
                ) from None
            raise E.ChiefUnreachableError(
                f"{self.name} at {self.address} unreachable during receive: the data stream broke off ({exc})"
            ) from None
        except E.CollectiveError:
            if self._interrupted is not None:
                raise self._interrupted from None
            raise

    def _stream(self, method, ref: pb.WorkerRef, stall_timeout: float) -> Iterator:
        """A server stream with a stall watchdog; errors mapped as for every call."""
        if self._interrupted is not None:
            raise self._interrupted
        call = method(ref, metadata=self._metadata)
        self._track(call)
        last = [time.monotonic()]
        stalled = threading.Event()
        done = threading.Event()

        def watchdog() -> None:
            while not done.wait(min(1.0, stall_timeout / 4)):
                if time.monotonic() - last[0] > stall_timeout:
                    stalled.set()
                    call.cancel()
                    return

        threading.Thread(target=watchdog, name="stall-watchdog", daemon=True).start()
        try:
            for message in call:
                last[0] = time.monotonic()
                yield message
        except grpc.RpcError as exc:
            if self._interrupted is not None:
                raise self._interrupted from None
            if stalled.is_set():
                raise E.ChiefUnreachableError(
                    f"{self.name} at {self.address} sent nothing for {stall_timeout:g} s during receive"
                ) from None
            raise self._error(exc, "receive", stall_timeout) from None
        finally:
            done.set()
            call.cancel()
            self._untrack(call)

    def report_ready(self, req: pb.ReadyRequest, timeout: float) -> pb.ReadyReply:
        return self._unary(self._stub.ReportReady, req, "ready", timeout)

    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply:
        return self._unary(self._stub.AwaitStart, ref, "waiting for start", timeout + 1.0, retry=True)

    def report_failure(self, req: pb.FailureReport, timeout: float) -> None:
        try:
            self._stub.ReportFailure(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            log.debug("could not tell the chief about the failure: %s", exc.details())

    def heartbeat(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply:
        try:
            return self._hb_stub.Heartbeat(ref, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, "heartbeat", timeout) from None

    def status(self, timeout: float) -> pb.StatusReply:
        return self._unary(self._stub.Status, pb.StatusRequest(), "status", timeout)

    def presence(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply:
        """On the heartbeat connection, which carries no data, so nothing queues ahead of it."""
        return self._unary(self._hb_stub.Presence, ref, "presence", timeout)

    def close(self) -> None:
        self._channel.close()
        self._hb_channel.close()
