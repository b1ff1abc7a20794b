"""The raw TCP data path: the data stream's bulk bytes beside gRPC, without user-space copies.

Over gRPC (FetchRaw) each chunk is copied about four times in user space: into the frame, into
gRPC's send buffers, out of its receive buffers into a Python ``bytes``, and from there into the
arena. On one host with a few cores those copies, not the network, set the broadcast's time. Here
the same stream (``StreamSource.stream_views``, the same ``Receiver``) goes over a plain TCP
connection: the sender writes each chunk from its arena with one ``sendmsg`` (header, metadata
and a view of the bytes), the receiver reads the bytes straight into its arena
(``Receiver.view`` then ``recv_into``). Only the kernel copies. A sender in the receiver's network
namespace (one host, or one container) is reached through an abstract unix socket instead of
TCP over loopback (no TCP/IP processing: about twice the rate here); its random name comes with
the port.

It is a backend of the data stream only; gRPC keeps the control plane. ``GrpcEndpoint`` runs a
``DataServer`` beside its gRPC server (the chief's and every relay's) and answers the generic
``DataPath`` RPC with its port, so the token interceptor guards the discovery too. What holds on
this path as on FetchRaw:

* checks: every frame goes through ``Receiver.view`` (offset, length) and ``Receiver.accept``
  (keys, the chunk's digest against the plan's and its trailer, the stream end);
* auth: the first thing the client sends is its WorkerRef and the cluster token, compared in
  constant time; a wrong one gets the interceptor's UNAUTHENTICATED answer. With TLS the
  connection is TLS with the same files (the chief's certificate checked against ``--tls-ca``,
  the client's required with mutual TLS, and then it must name the worker id);
* errors: a ``CollectiveError`` raised by the handler travels as its gRPC status code and
  message, and the client maps it through the same table, so the worker raises what it would
  raise over gRPC;
* liveness: a connection cut before the stream end calls ``StreamSource.lost``; the client
  gives up after ``stall_timeout`` seconds without a byte; ``ChiefLink.interrupt`` shuts the
  socket; TCP keepalive (10 s + 2 x 5 s, as gRPC's) notices a vanished peer host.

Frames, server to client: ``<BIQ`` (kind, metadata length, data length), the metadata, the data.
Kind 0: a chunk (metadata a ``Chunk`` without data). Kind 1: an error (metadata
``<code> <raised>\\n<message>``, UTF-8: the ``errors`` table's status code name and, as JSON,
``errors.describe`` (class, culprit, phase; absent for a refusal before the stream)), the last
frame of the stream.
"""

from __future__ import annotations

import collections
import errno
import hmac
import json
import logging
import os
import secrets
import socket
import ssl
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.limits import MAX_ERROR_CHARS
from collective.logs import printable

log = logging.getLogger(__name__)

MAGIC = b"CLD1"
_HELLO = struct.Struct("<4sII")  # magic, WorkerRef length, token length
_HEAD = struct.Struct("<BIQ")  # kind, metadata length, data length
CHUNK, ERROR = 0, 1
MAX_META = 64 << 20  # a Chunk's metadata: keys of the variables it fuses, never near this
# An error frame: its code, class, culprit and phase and a message the sender cut to
# MAX_ERROR_CHARS (escaped, so at most a few bytes a character): never near this.
MAX_ERROR_META = 64 << 10
HELLO_TIMEOUT = 10.0  # a connection must say who it is within this
PENDING_MAX = 64  # connections that have not said who they are yet; beyond it the oldest is cut
_IOV = 3


def split_host(address: str) -> tuple[str, str]:
    """``host:port`` (``[v6]:port``) -> (host, port) without brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _peer_name(family: int, peer) -> str:
    """A peer as gRPC names it (``ipv4:10.0.0.5:41234``), so refusals count per host alike."""
    if family == socket.AF_INET6:
        host = peer[0].removeprefix("::ffff:")  # a v4 client of a dual-stack port
        return f"ipv4:{host}:{peer[1]}" if "." in host else f"ipv6:[{host}]:{peer[1]}"
    if family == socket.AF_INET:
        return f"ipv4:{peer[0]}:{peer[1]}"
    return "unix:this host"


def _keepalive(sock: socket.socket) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # a unix socket's peer is on this host: its death is seen at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _recv_exact(sock: socket.socket, buf) -> None:
    """Fill the writable buffer ``buf`` from ``sock``; ConnectionError on an early end."""
    view = memoryview(buf).cast("B")
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k


def _send_all(sock: socket.socket, parts: list) -> None:
    """Send every buffer in ``parts``, gathered (one ``sendmsg`` per round, no copies)."""
    bufs = [memoryview(p).cast("B") for p in parts if len(p)]
    if isinstance(sock, ssl.SSLSocket):  # TLS encrypts anyway: no scatter-gather there
        for b in bufs:
            sock.sendall(b)
        return
    while bufs:
        sent = sock.sendmsg(bufs[:_IOV])
        while bufs and sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        if sent:
            bufs[0] = bufs[0][sent:]


# --- server ---------------------------------------------------------------------------------------


class DataServer:
    """Serves ``handler.stream_views`` on a TCP port of ``host`` (beside a gRPC endpoint).

    ``tls`` is a server
    ``ssl.SSLContext`` or None; ``identities(sock)`` the names of a TLS client's certificate
    when a worker may only fetch under its own id (mutual TLS), else None; ``refused(peer,
    what, reason)`` logs a refused connection (the endpoint's RefusalLog, so a flood from one
    host is summarised, not logged a line a connection).
    """

    def __init__(self, host: str, handler, *, token: str | None, tls: ssl.SSLContext | None = None,
                 identities: Callable | None = None, refused: Callable[[str, str, str], None] | None = None) -> None:
        self._handler = handler
        self._refused = refused or (lambda peer, what, reason: log.warning("refused %s from %s: %s", what, peer, reason))
        self._token = token.encode() if token else None
        self._tls = tls
        self._identities = identities
        host = "" if host in ("", "0.0.0.0", "[::]", "::") else host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if host == "" and socket.has_dualstack_ipv6():
            self._sock = socket.create_server(("", 0), family=socket.AF_INET6, backlog=128, dualstack_ipv6=True)
        else:
            self._sock = socket.create_server((host, 0), family=family, backlog=128)
        self.port = self._sock.getsockname()[1]
        self.unix_name, self._unix = _unix_listener()
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        # Connections still in their hello, oldest first: a worker says who it is at once, so
        # when more than PENDING_MAX have not, the oldest is cut. Idle connections (a port
        # scan, a slow-loris, 2,000 of them) then hold at most PENDING_MAX descriptors and
        # threads, never the process's file descriptor limit.
        self._pending: collections.OrderedDict[socket.socket, str] = collections.OrderedDict()
        self._cut_idle = 0
        self._lock = threading.Lock()
        for listener in (self._sock, self._unix):
            if listener is not None:
                threading.Thread(target=self._accept_loop, args=(listener,), name="data-accept", daemon=True).start()

    def _accept_loop(self, listener: socket.socket) -> None:
        short_since = 0.0
        while not self._closed.is_set():
            try:
                conn, peer = listener.accept()
            except OSError as exc:
                if self._closed.is_set() or exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return  # closed
                # Out of descriptors (other connections, other files): wait and accept again,
                # never stop serving; the connection waits in the listen backlog meanwhile.
                if time.monotonic() - short_since > 10.0:
                    short_since = time.monotonic()
                    log.warning("data port cannot accept a connection: %s; retrying (raise `ulimit -n`?)", exc.strerror)
                self._closed.wait(0.05)
                continue
            where = _peer_name(conn.family, peer)
            self._admit(conn, where)
            threading.Thread(target=self._serve, args=(conn, where), name="data-stream", daemon=True).start()

    def _admit(self, conn: socket.socket, where: str) -> None:
        """Count ``conn`` among the connections in their hello, cutting the oldest beyond PENDING_MAX."""
        with self._lock:
            self._conns.add(conn)
            self._pending[conn] = where
            if len(self._pending) <= PENDING_MAX:
                return
            oldest, who = self._pending.popitem(last=False)
            self._cut_idle += 1
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # its thread's read returns at once and it ends
        except OSError:
            pass
        self._refused(who, "data connection", f"more than {PENDING_MAX} connections had not said who they are; "
                                              f"the oldest is cut")

    def _said_hello(self, conn: socket.socket) -> bool:
        """Whether ``conn`` was still pending, i.e. not cut as idle; from now on it is not counted."""
        with self._lock:
            return self._pending.pop(conn, None) is not None

    def close(self) -> None:
        self._closed.set()
        if self._cut_idle:
            log.warning("data port: cut %d connection(s) that said nothing within their turn", self._cut_idle)
        for listener in (self._sock, self._unix):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # streams in progress end now, as gRPC's do when its server stops
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _serve(self, raw: socket.socket, where: str) -> None:
        conn = raw
        try:
            _keepalive(conn)
            conn.settimeout(HELLO_TIMEOUT)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            ref = self._hello(conn, where)
            if not self._said_hello(raw) or ref is None:
                return  # refused, or cut as idle while it spoke
            conn.settimeout(None)  # a slow reader only slows us; keepalive notices a dead one
            self._stream(conn, ref, where)
        except (OSError, ssl.SSLError) as exc:
            # Still pending: it ended by itself (one cut as idle was counted; one cut by close()
            # is not news, and its line would come after the server's owner is done with it).
            if self._said_hello(raw) and not self._closed.is_set():
                log.info("data connection from %s ended before it began: %s", where, exc)
        finally:
            with self._lock:
                self._conns.discard(raw)
                self._pending.pop(raw, None)
            conn.close()

    def _hello(self, conn: socket.socket, where: str) -> pb.WorkerRef | None:
        head = bytearray(_HELLO.size)
        _recv_exact(conn, head)
        magic, nref, ntoken = _HELLO.unpack(head)
        if magic != MAGIC or nref > 4096 or ntoken > 4096:
            self._refused(where, "data connection", "not a collective data stream")
            return None
        body = bytearray(nref + ntoken)
        _recv_exact(conn, body)
        given = bytes(body[nref:])
        if self._token is not None and not hmac.compare_digest(given, self._token):
            reason = "no cluster token" if not given else "a wrong cluster token"
            self._refused(where, "FetchRaw", reason)
            self._send_error(conn, "UNAUTHENTICATED", f"FetchRaw refused: {reason}")
            return None
        try:
            ref = pb.WorkerRef.FromString(bytes(body[:nref]))
        except DecodeError:
            self._send_error(conn, "INVALID_ARGUMENT", "data stream request is not a WorkerRef")
            return None
        if self._identities is not None:
            names = self._identities(conn)
            if ref.worker_id not in names:
                log.warning("refused worker id %r from %s: its certificate names %s", ref.worker_id, where, sorted(names))
                self._send_error(conn, "PERMISSION_DENIED",
                                 f"worker id {ref.worker_id!r} refused: the client certificate names "
                                 f"{', '.join(sorted(names)) or 'nobody'}")
                return None
        return ref

    def _stream(self, conn: socket.socket, ref: pb.WorkerRef, where: str) -> None:
        try:
            for msg, data in self._handler.stream_views([ref]):
                meta = msg.SerializeToString()
                _send_all(conn, [_HEAD.pack(CHUNK, len(meta), len(data)), meta, data])
        except E.CollectiveError as exc:
            self._send_error(conn, exc.code, str(exc), E.describe(exc))
        except (OSError, ssl.SSLError) as exc:
            if not self._closed.is_set():  # else close() cut it: said by whoever closed the server
                log.info("data stream to %s (%s) cut off: %s", ref.worker_id, where, exc)
            self._handler.lost(ref, "its data stream call was cut off (process gone or connection lost)")

    @staticmethod
    def _send_error(conn: socket.socket, code: str, message: str, raised: dict | None = None) -> None:
        head = f"{code} {json.dumps(raised)}" if raised else code
        body = f"{head}\n{printable(message, limit=MAX_ERROR_CHARS)}".encode()  # a peer's long name, cut
        try:
            _send_all(conn, [_HEAD.pack(ERROR, len(body), 0), body])
        except (OSError, ssl.SSLError):
            pass


# --- client ---------------------------------------------------------------------------------------


class _Cancel:
    """What ``ChiefLink.interrupt`` cancels: shuts the socket so a blocked read returns."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def cancel(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Refused(Exception):
    """The data port could not be reached (connect failed): the caller may use FetchRaw."""


def _unix_listener() -> tuple[str | None, socket.socket | None]:
    """An abstract unix socket with an unguessable name (Linux), or (None, None).

    Only processes in the same network namespace (the same host, or the same container) can
    reach it; they find its name through DataPath, behind the token. On one host a unix socket
    moves bytes about twice as fast as TCP over loopback (no TCP/IP processing)."""
    if not hasattr(socket, "AF_UNIX") or not sys.platform.startswith("linux"):
        return None, None
    name = f"collective-data-{secrets.token_hex(12)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(128)
    except OSError:
        sock.close()
        return None, None
    return name, sock


def connect(host: str, port: int, *, timeout: float, tls: ssl.SSLContext | None, server_name: str | None,
            unix_name: str | None = None) -> socket.socket:
    """A connected (TLS-wrapped) data socket: the sender's unix socket when it shares this
    network namespace, else its TCP port. Raises Refused when neither can be reached."""
    sock = None
    if unix_name:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + unix_name)
        except OSError:  # another host (or container): its name means nothing here
            sock.close()
            sock = None
    if sock is None:
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout, 10.0))
        except OSError as exc:
            raise Refused(str(exc)) from None
    _keepalive(sock)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        except (OSError, ssl.SSLError):
            sock.close()
            raise
    return sock


def receive(sock: socket.socket, ref: pb.WorkerRef, token: str | None, receiver, *, stall_timeout: float,
            track: Callable, untrack: Callable, fail: Callable[[str, str], E.CollectiveError]) -> None:
    """Ask for the stream on the connected ``sock`` and feed it to ``receiver`` in place.

    ``fail(code, raised, message)`` builds the error of an error frame; ``socket.timeout`` (nothing for
    ``stall_timeout`` s), ConnectionError and ssl errors reach the caller as they are.
    """
    cancel = _Cancel(sock)
    track(cancel)
    try:
        sock.settimeout(stall_timeout)
        body = ref.SerializeToString()
        tok = (token or "").encode()
        _send_all(sock, [_HELLO.pack(MAGIC, len(body), len(tok)), body, tok])
        head = bytearray(_HEAD.size)
        while True:
            if not sock.recv_into(head, 1):  # closed between two frames: the sender ended it early
                raise ConnectionError(f"the sender closed it without its end message, after "
                                      f"{receiver.bytes_received} bytes")
            _recv_exact(sock, memoryview(head)[1:])
            kind, nmeta, ndata = _HEAD.unpack(head)
            if nmeta > MAX_META or kind not in (CHUNK, ERROR):
                raise E.ProtocolError(f"data frame of kind {kind} with {nmeta} bytes of metadata is not a frame")
            if kind == ERROR and nmeta > MAX_ERROR_META:  # refused before it is read: a peer's text is bounded
                raise E.ProtocolError(f"error frame of {nmeta:,} bytes refused: an error is at most "
                                      f"{MAX_ERROR_META:,} bytes")
            meta = bytearray(nmeta)
            _recv_exact(sock, meta)
            if kind == ERROR:
                head_line, _, message = bytes(meta).decode(errors="replace").partition("\n")
                code, _, raised = head_line.partition(" ")
                try:
                    info = json.loads(raised) if raised else None
                except ValueError:
                    info = None
                raise fail(code, info if isinstance(info, dict) else None, message)
            try:
                msg = pb.Chunk.FromString(bytes(meta))
            except DecodeError as exc:
                raise E.ProtocolError(f"data frame metadata is not a Chunk: {exc}") from None
            if msg.data:
                raise E.ProtocolError("data frame metadata carries bytes of its own")
            view = receiver.view(msg.offset, ndata)  # checks offset and length before reading
            if ndata:
                _recv_exact(sock, view)
            receiver.accept(msg, placed=True)
            if msg.HasField("end"):
                return
    finally:
        untrack(cancel)
        sock.close()


def server_context(tls) -> ssl.SSLContext:
    """The data server's TLS context from the chief's (or relay's) ``TlsFiles``: its certificate,
    and with a client CA, client certificates required (mutual TLS), as on its gRPC port."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(ctx, tls)
    if tls.has("ca"):
        ctx.load_verify_locations(cadata=tls.read("ca").decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls) -> ssl.SSLContext:
    """A worker's TLS context from its ``TlsFiles``: the chief's CA, and its own certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=tls.read("ca").decode())
    if tls.has("cert"):
        _load_chain(ctx, tls)
    return ctx


def _load_chain(ctx: ssl.SSLContext, tls) -> None:
    """Certificate and key from files, or from memory (a relay's own certificate under
    server-only TLS): ``ssl`` reads only files, so those go through a private temporary folder."""
    if tls.cert and tls.key:
        ctx.load_cert_chain(tls.cert, tls.key)
        return
    with tempfile.TemporaryDirectory(prefix="collective-tls-") as folder:
        paths = []
        for which in ("cert", "key"):
            path = os.path.join(folder, which + ".pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(tls.read(which) or b"")
            paths.append(path)
        ctx.load_cert_chain(*paths)


def certificate_names(sock: ssl.SSLSocket) -> set[str]:
    """CN and subject alternative names of the peer's verified certificate."""
    cert = sock.getpeercert() or {}
    names = {value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"}
    return names | {value for _kind, value in cert.get("subjectAltName", ())}


DATA_PATHS = ("auto", "tcp", "grpc")


def mode() -> str:
    """``COLLECTIVE_DATA_PATH``: ``auto`` (default: the unix socket in the same network namespace,
    else TCP), ``tcp`` (TCP even on one host, as containers on one machine get) or ``grpc``
    (FetchRaw only). Anything else is a usage error."""
    value = os.environ.get("COLLECTIVE_DATA_PATH", "auto").strip().lower() or "auto"
    if value not in DATA_PATHS:
        raise E.UsageError(f"COLLECTIVE_DATA_PATH={value!r}: use one of {', '.join(DATA_PATHS)}")
    return value


def enabled() -> bool:
    """Whether the raw data path is used (``COLLECTIVE_DATA_PATH`` is not ``grpc``)."""
    return mode() != "grpc"
