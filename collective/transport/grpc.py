"""gRPC backend: the chief serves ``collective.v1.Collective``; workers are clients.

A worker calls Join, GetPlan (the plan in pieces of 4 MiB, so a plan of any size fits the
message limit), AwaitPrepared (the barrier before the first byte), FetchRaw (the
data stream as raw frames; Fetch is the same stream as protobuf messages), ReportReady (in
pieces too) and AwaitStart; from join until start it sends Heartbeat and holds a Presence call (both on a
connection of their own), and ReportFailure when it fails. Status serves ``collective status``.
FetchRaw is a generic handler outside the .proto; the other ten are the service's RPCs.

Guarantees: every client call has a deadline; a silent data stream is cancelled after the stall
timeout; the chief's errors arrive as the same ``CollectiveError`` class with the same message;
a wrong or missing cluster token gets UNAUTHENTICATED on every Collective RPC before any
handler runs (constant-time comparison; the log names the peer, never the token). The standard
health service reports SERVING while the chief serves and NOT_SERVING once it stops.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective._proto import collective_pb2_grpc as pb_grpc
from collective.logs import printable
from collective.plan import MAX_CHUNK_BYTES, from_pieces, to_pieces
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
    # A connection that has not sent its HTTP/2 preface and settings within this is closed
    # (gRPC's default: 120 s): idle strangers must not hold the server's descriptors for long.
    ("grpc.server_handshake_timeout_ms", 20_000),
]

# The error table is errors.py's: each class's ``code`` is its status code on the wire, and its
# name travels in this trailing metadata key, so the client raises the very class.
ERROR_CLASS_KEY = "collective-error"


def status_code(exc: E.CollectiveError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.ABORTED)


def _raised_class(exc: grpc.RpcError) -> str | None:
    """The error class the peer's handler raised, or None for a status gRPC made itself."""
    try:
        metadata = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - a cancelled future has none
        return None
    return next((v for k, v in metadata if k == ERROR_CLASS_KEY), None)


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
    Worker: ca (the CA of the chief's certificate), cert+key (its client certificate, for mTLS).

    ``*_pem``: the same in memory instead of a file (a relay's own certificate, see
    ``relay_server_tls``); a value here wins over the path."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None  # worker: the name the chief's certificate must carry
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    ca_pem: bytes | None = None

    def has(self, which: str) -> bool:
        return bool(getattr(self, which) or getattr(self, which + "_pem"))

    @property
    def enabled(self) -> bool:
        return any(self.has(w) for w in ("cert", "key", "ca"))

    @property
    def mutual(self) -> bool:
        """A worker with a certificate of its own and the CA: mutual TLS."""
        return self.has("cert") and self.has("ca")

    def read(self, which: str) -> bytes | None:
        inline = getattr(self, which + "_pem")
        if inline:
            return inline
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
        if self.has("cert") != self.has("key"):
            raise E.UsageError("--tls-cert and --tls-key go together: give the chief's certificate and its key")
        if self.has("ca") and not self.has("cert"):
            raise E.UsageError(
                "--tls-ca (the CA of client certificates) needs the chief's own --tls-cert and --tls-key"
            )
        return grpc.ssl_server_credentials(
            [(self.read("key"), self.read("cert"))],
            root_certificates=self.read("ca"),
            require_client_auth=self.has("ca"),  # a client CA always means client auth is required
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if self.has("cert") != self.has("key"):
            raise E.UsageError("--tls-cert and --tls-key go together: give this worker's certificate and its key")
        if not self.has("ca"):
            raise E.UsageError("--tls-ca is required with TLS: the CA that signed the chief's certificate")
        return grpc.ssl_channel_credentials(
            root_certificates=self.read("ca"), private_key=self.read("key"), certificate_chain=self.read("cert")
        )


# How a worker's relay is served and verified (children dial it by IP address, which no
# certificate names):
# - mutual TLS: the relay serves the worker's own certificate and requires client certificates
#   of the same CA; a child verifies it against the CA under the name the plan gives it, its
#   worker id (the name its certificate must carry to join at all), and the relay lets a child
#   fetch only under the id its certificate names.
# - server-only TLS (workers hold only the CA): the relay serves a certificate made by the worker
#   at start, named RELAY_NAME. The worker sends it to the chief in its join (over the chief's
#   verified TLS channel) and the chief hands it to the relay's children in the plan, so each
#   child trusts exactly that certificate for that relay. Children are admitted by the token and
#   by being in the plan.
RELAY_NAME = "collective-relay"


def self_signed_certificate(name: str = RELAY_NAME, days: int = 7) -> tuple[bytes, bytes]:
    """A new P-256 key and a self-signed certificate for ``name``: (certificate PEM, key PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def relay_server_tls(tls: TlsFiles | None) -> TlsFiles | None:
    """What a worker's relay serves with, given the worker's own TLS settings (see above)."""
    if tls is None or not tls.enabled:
        return None
    if tls.mutual:
        return tls
    cert, key = self_signed_certificate()
    return TlsFiles(cert_pem=cert, key_pem=key)


def relay_client_tls(tls: TlsFiles | None, parent: pb.WorkerInfo) -> TlsFiles | None:
    """How a child dials its parent's relay, given the child's own TLS settings and the plan's
    entry for the parent (see above). Raises ProtocolError if the plan lacks what TLS needs."""
    if tls is None or not tls.enabled:
        return None
    if tls.mutual:
        return replace(tls, server_name=parent.worker_id)
    if not parent.relay_cert:
        raise E.ProtocolError(
            f"the plan gives no TLS certificate for the relay of worker {parent.worker_id!r} "
            f"(rank {parent.rank}); is the chief older than this worker?"
        )
    return TlsFiles(ca_pem=parent.relay_cert, server_name=RELAY_NAME)


def peer_identities(context) -> set[str]:
    """Names in the verified client certificate (CN and SANs); empty without mutual TLS."""
    auth = context.auth_context() or {}
    names = list(auth.get("x509_common_name", [])) + list(auth.get("x509_subject_alternative_name", []))
    return {n.decode() if isinstance(n, bytes) else n for n in names}


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
            context.set_trailing_metadata(((ERROR_CLASS_KEY, type(exc).__name__),))
            context.abort(status_code(exc), str(exc))
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
        """A ReadyRequest in pieces: every device's chunk digests of a model of any size fit."""
        request = self._call(context, "ReportReady", from_pieces, pb.ReadyRequest, request_iterator, f"worker at {context.peer()}")
        self._identity(context, request.worker.worker_id)
        return self._call(context, "ReportReady", self._h.report_ready, request)

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


def _remaining(context) -> float:
    """Seconds until the caller's deadline, less a margin so our answer beats it."""
    left = context.time_remaining()
    return 3600.0 if left is None else max(0.0, left - 0.5)


# --- admission -----------------------------------------------------------------------------

# A pool thread must never wait on a peer. gRPC Python hands a call to a pool thread as soon as
# its headers arrive, and a unary handler's thread then waits for the request body; so a peer
# that sends headers and no body holds a thread for as long as it likes, and 4N+8 such calls
# take every thread of the chief. Hence every Collective RPC is admitted here, in the server's
# own polling thread, from its headers alone: a call without the right token gets a handler
# that never reads its body (refused at once, its body never decoded); an admitted call reads
# its one request under a deadline (BODY_TIMEOUT: a member sends it with the headers), after
# which the call is cancelled and its thread is free again.
BODY_TIMEOUT = 10.0
REFUSAL_WINDOW = 10.0


def _peer_host(peer: str) -> str:
    """``ipv4:10.0.0.5:41234`` -> ``10.0.0.5``; refusals are counted per host, not per port."""
    kind, _, rest = peer.partition(":")
    host = rest.rpartition(":")[0] if kind in ("ipv4", "ipv6") else rest
    return printable(host or peer, limit=80)


class RefusalLog:
    """Refused calls logged without flooding: the first from a host at WARNING, then one line per
    ``window`` s saying how many more came from it. Thread-safe; remembers at most 1024 hosts."""

    def __init__(self, window: float = REFUSAL_WINDOW, clock=time.monotonic) -> None:
        self._window, self._clock = window, clock
        self._lock = threading.Lock()
        self._hosts: dict[str, list] = {}  # host -> [window start, calls held back, last reason]

    def refused(self, peer: str, method: str, reason: str) -> None:
        host, now = _peer_host(peer), self._clock()
        ended = []
        with self._lock:
            entry = self._hosts.get(host)
            if entry is not None and now - entry[0] < self._window:
                entry[1], entry[2] = entry[1] + 1, reason
                return
            if entry is not None:
                ended.append((host, self._hosts.pop(host)))
            if len(self._hosts) >= 1024:  # forget the oldest host, saying what it did
                oldest = next(iter(self._hosts))
                ended.append((oldest, self._hosts.pop(oldest)))
            self._hosts[host] = [now, 0, reason]
        for other, held in ended:
            self._summarise(other, *held)
        log.warning("refused %s from %s: %s", method, printable(peer), reason)

    def _summarise(self, host: str, since: float, count: int, reason: str) -> None:
        if count:
            log.warning("%d more refused call(s) from %s in the last %.0f s (last: %s)",
                        count, host, max(self._clock() - since, 0.0), reason)

    def flush(self) -> None:
        with self._lock:
            held, self._hosts = self._hosts, {}
        for host, entry in held.items():
            self._summarise(host, *entry)


class _BodyWatch:
    """Cancels admitted calls whose request has not arrived within ``timeout`` s (one thread)."""

    def __init__(self, timeout: float, refusals: RefusalLog) -> None:
        self.timeout = timeout
        self._refusals = refusals
        self._cond = threading.Condition()
        self._waiting: dict[int, tuple[float, object, str]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rpc-body-watch", daemon=True)
        self._thread.start()

    def read(self, requests: Iterator, context, method: str):
        """The call's one request, or None once the call is over without one."""
        key = id(context)
        with self._cond:
            self._waiting[key] = (time.monotonic() + self.timeout, context, method)
            self._cond.notify()
        try:
            return next(requests, None)
        except grpc.RpcError:  # cancelled: by the peer, or by us for its missing body
            return None
        finally:
            with self._cond:
                self._waiting.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                late = [(k, c, m) for k, (t, c, m) in self._waiting.items() if t <= now]
                for key, _, _ in late:
                    del self._waiting[key]
                if not late:
                    nxt = min((t for t, _, _ in self._waiting.values()), default=now + 3600.0)
                    self._cond.wait(max(nxt - now, 0.01))
                    continue
            for _, context, method in late:
                self._refusals.refused(context.peer(), method, f"no request within {self.timeout:g} s of its headers")
                context.cancel()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(2.0)


class _Admission(grpc.ServerInterceptor):
    """Admits every Collective RPC from its headers (see BODY_TIMEOUT above).

    Without the right ``token`` (when there is one) the call gets UNAUTHENTICATED at once and its
    body is never read or decoded (constant-time comparison; the log names the peer, rate-limited
    by ``RefusalLog``, never the token). An admitted call reads and decodes its request itself:
    an undecodable one gets INVALID_ARGUMENT and a log line, not a traceback.
    """

    def __init__(self, token: str | None, refusals: RefusalLog, body: _BodyWatch) -> None:
        self._token = token.encode() if token else None
        self._refusals = refusals
        self._body = body

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler  # the health service answers without a token
        method = details.method.rsplit("/", 1)[-1]
        if self._token is not None:
            given = dict(details.invocation_metadata).get(TOKEN_HEADER, "")
            if not hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._token):
                reason = "no cluster token" if not given else "a wrong cluster token"
                return self._refuse(handler, method, reason)
        return self._admit(handler, method)

    def _refuse(self, handler, method: str, reason: str):
        def refuse(requests, context):
            self._refusals.refused(context.peer(), method, reason)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} refused: {reason}")

        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse, None, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(refuse, None, handler.response_serializer)

    def _admit(self, handler, method: str):
        behavior = handler.unary_stream or handler.unary_unary
        decode = handler.request_deserializer

        def admitted(requests, context):
            raw = self._body.read(requests, context, method)
            if raw is None:
                context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended before its request arrived")
            try:
                request = decode(raw) if decode is not None else raw
            except DecodeError:
                self._refusals.refused(context.peer(), method, "an undecodable request")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid message")
            return behavior(request, context)

        if handler.request_streaming:
            return handler  # the service has no client streams; left as gRPC serves them
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(admitted, None, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(admitted, None, handler.response_serializer)


def pool_size(handler) -> int:
    """Threads a server needs for ``handler``: a worker holds at most CALLS_PER_WORKER calls at
    once (a long-poll or stream on its data connection, Heartbeat and Presence on its own, and
    ReportFailure), plus 8 for Status and what arrives while calls end."""
    return CALLS_PER_WORKER * max(int(getattr(handler, "num_workers", 0)), 0) + 8


CALLS_PER_WORKER = 4


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
        self._credentials = self.tls.server_credentials() if self.tls else None  # refuse bad setups early
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
        self._body = _BodyWatch(self.body_timeout, self._refusals)
        self._pool = futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=f"{self.name}-rpc")
        server = grpc.server(
            self._pool,
            interceptors=[_Admission(self.token, self._refusals, self._body)],
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
                port = server.add_secure_port(self.bind, self._credentials)
            else:
                port = server.add_insecure_port(self.bind)
        except RuntimeError as exc:
            self._body.close()
            raise E.UsageError(f"cannot listen on {self.bind}: {exc}; is the port in use?") from exc
        if not port:
            self._body.close()
            raise E.UsageError(f"cannot listen on {self.bind}: the port is in use or the address is not local")
        server.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server, self.port = server, port
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


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: addresses no other host can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- client ------------------------------------------------------------------------------


class _Collected:
    """A server-streaming method called as ``_unary`` calls a unary one: ``future(...)`` starts
    the call, ``result()`` is the list of its messages, ``cancel()`` ends it."""

    def __init__(self, method) -> None:
        self._method = method

    def future(self, request, *, timeout: float, metadata) -> _Collected:
        self._call = self._method(request, timeout=timeout, metadata=metadata)
        return self

    def result(self) -> list:
        return list(self._call)

    def cancel(self) -> None:
        self._call.cancel()


class _NoDataPort(Exception):
    """The sender's raw TCP data port cannot be reached: FetchRaw over gRPC instead."""


# Join retries back off exponentially to JOIN_BACKOFF_CAP s between tries; their log lines come
# after the first failure and then at doubling intervals up to JOIN_LOG_CAP s, each a summary.
JOIN_BACKOFF_CAP = 2.0
JOIN_LOG_FIRST, JOIN_LOG_CAP = 2.0, 30.0


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
        return self._error_of(exc.code(), exc.details() or "", phase, timeout, _raised_class(exc))

    def _error_of(self, code: grpc.StatusCode, details: str, phase: str, timeout: float,
                  name: str | None = None) -> E.CollectiveError:
        """The error a failed call stands for: the class the peer raised (``name``), or, for a
        status gRPC made itself (no name), what its code means here."""
        if name is not None:
            return self._raised(E.wire_class(name, code.name), details)
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
        return self._raised(E.wire_class(None, code.name), details)

    def _raised(self, cls: type[E.CollectiveError], details: str) -> E.CollectiveError:
        if cls is not E.AbortedError:
            return cls(f"{self.name} at {self.address}: {details}")
        if self.name == "chief":
            return cls(f"round aborted by the chief at {self.address}: {details}")
        return cls(f"{self.name} at {self.address} ended the stream: {details}")  # a relay is not the chief

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
                unavailable = (isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
                               and _raised_class(exc) is None)  # gRPC's own status, not the chief's answer
                if retry and unavailable and now < deadline:
                    down_since = down_since or now
                    if now - down_since < self.retry_window:
                        time.sleep(0.2)
                        continue
                raise self._error(exc, phase, timeout) from None
            finally:
                self._untrack(future)

    def join(self, req: pb.JoinRequest, timeout: float) -> pb.JoinReply:
        size = req.ByteSize()
        if size > MAX_MESSAGE:  # gRPC would refuse it here, in words that blame the chief
            raise E.UsageError(
                f"this worker's join request is {size} bytes ({len(req.declared)} declared variables), more "
                f"than the {MAX_MESSAGE}-byte message limit; join without --expect-model for a model this large"
            )
        started = time.monotonic()
        deadline = started + timeout
        last = "no answer"
        backoff, refusals, tries = 0.1, 0, 0
        next_log, log_every = started, JOIN_LOG_FIRST
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
                if (exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                        and _raised_class(exc) is None):  # not reached yet; an answer is final
                    last = exc.details() or exc.code().name
                    hint = self._tls_hint(last)
                    refusals = refusals + 1 if hint else 0
                    if refusals >= 3:  # a listening chief that keeps closing on us: not a start-up race
                        raise E.AuthError(f"{self.name} at {self.address} refused the connection during join: {last}{hint}") from None
                    tries += 1
                    now = time.monotonic()
                    if now >= next_log:  # the first failure, then a summary at doubling intervals
                        log.info("%s at %s not reachable yet after %d tr%s in %.0f s (%s); retrying for %.0f s more",
                                 self.name, self.address, tries, "y" if tries == 1 else "ies", now - started,
                                 printable(last), max(deadline - now, 0.0))
                        next_log, log_every = now + log_every, min(log_every * 2, JOIN_LOG_CAP)
                    time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                    backoff = min(JOIN_BACKOFF_CAP, backoff * 2)
                    continue
                raise self._error(exc, "join", timeout) from None

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        pieces = self._unary(_Collected(self._stub.GetPlan), ref, "join (waiting for the plan)", timeout, retry=True)
        return from_pieces(pb.Plan, pieces, f"{self.name} at {self.address}")

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
                fail=lambda code, name, message: self._error_of(
                    getattr(grpc.StatusCode, code, grpc.StatusCode.ABORTED), message, "receive", stall_timeout, name),
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
        return self._unary(self._stub.ReportReady, to_pieces(req.SerializeToString()), "ready", timeout)

    def await_start(self, ref: pb.WorkerRef, timeout: float) -> pb.StartReply:
        return self._unary(self._stub.AwaitStart, ref, "waiting for start", timeout + 1.0, retry=True)

    def report_failure(self, req: pb.FailureReport, timeout: float) -> None:
        try:
            self._stub.ReportFailure(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            log.debug("could not tell the chief about the failure: %s", exc.details())

    def heartbeat(self, ref: pb.HeartbeatRequest, timeout: float) -> pb.HeartbeatReply:
        try:
            return self._hb_stub.Heartbeat(ref, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, "heartbeat", timeout) from None

    def status(self, timeout: float) -> pb.StatusReply:
        return self._unary(self._stub.Status, pb.StatusRequest(), "status", timeout)

    def presence(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply:
        """On the heartbeat connection, which carries no data, so nothing queues ahead of it."""
        return self._unary(self._hb_stub.Presence, ref, "presence", timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Close both channels, waiting at most ``timeout`` s. grpc's close waits for every call
        on the channel to end, and a call interrupted inside grpc (Ctrl-C during a long-poll) may
        never report its end: the close then goes on in a daemon thread and the process exits."""
        closer = threading.Thread(target=self._close_channels, name="grpc-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            log.debug("%s at %s: its channels did not close within %g s; leaving them", self.name, self.address, timeout)

    def _close_channels(self) -> None:
        self._channel.close()
        self._hb_channel.close()
