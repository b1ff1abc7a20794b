"""Admission at the gRPC server: the token checked from headers, bodies that never come cut, refusals logged without flooding."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from collective.errors import ProtocolError
from collective.logs import printable
from collective.transport.grpc.wire import SERVICE, TOKEN_HEADER

log = logging.getLogger(__name__)


# --- admission -----------------------------------------------------------------------------

# A pool thread must never wait on a peer. gRPC Python hands a call to a pool thread as soon as
# its headers arrive, and a unary handler's thread then waits for the request body; so a peer
# that sends headers and no body holds a thread for as long as it likes, and 4N+8 such calls
# take every thread of the chief. Hence every Collective RPC is admitted here, in the server's
# own polling thread, from its headers alone: a call without the right token gets a handler
# that never reads its body (refused at once, its body never decoded); an admitted call reads
# its one request under a deadline (BODY_TIMEOUT: a member sends it with the headers), after
# which the call is cancelled and its thread is free again. A client stream (ReportReady's
# pieces) reads each of its messages under the same deadline, so it cannot hold a thread either;
# what it may send in all is the servicer's to bound (from its first message, which names it).
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
    """Cancels admitted calls whose request has not arrived within ``timeout`` s (one thread).

    At most ``max_waiting`` calls wait for a request at once, each holding a pool thread: one
    more cuts the one that has waited longest. So calls that never send their request, however
    many, leave the rest of the pool to everyone else (a member's request arrives with its
    headers, so only a silent call is ever the oldest for long)."""

    def __init__(self, timeout: float, refusals: RefusalLog, max_waiting: int = 1 << 30) -> None:
        self.timeout = timeout
        self.max_waiting = max(1, max_waiting)
        self._refusals = refusals
        self._cond = threading.Condition()
        self._waiting: dict[int, tuple[float, object, str]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rpc-body-watch", daemon=True)
        self._thread.start()

    def messages(self, requests: Iterator, context, method: str, decode) -> Iterator:
        """A client stream's messages, decoded, each read under the deadline; ends early when
        the call is cancelled. An undecodable message is one refusal line and a ProtocolError
        (INVALID_ARGUMENT at the servicer's boundary), never a traceback."""
        while (raw := self.read(requests, context, method)) is not None:
            try:
                yield decode(raw) if decode is not None else raw
            except DecodeError:
                self._refusals.refused(context.peer(), method, "an undecodable request")
                raise ProtocolError(f"{method}: a message of the request stream is not a valid message") from None

    def read(self, requests: Iterator, context, method: str):
        """The call's one request, or None once the call is over without one."""
        key = id(context)
        with self._cond:
            self._waiting[key] = (time.monotonic() + self.timeout, context, method)
            oldest = None
            if len(self._waiting) > self.max_waiting:
                oldest = self._waiting.pop(next(iter(self._waiting)))
            self._cond.notify()
        if oldest is not None:
            _, other, other_method = oldest
            self._refusals.refused(other.peer(), other_method, f"more than {self.max_waiting} calls were "
                                   f"waiting for their request; the one that had waited longest was cut")
            other.cancel()
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


LARGE_REQUEST = 1 << 20  # a request past this is decoded alone, its fields counted first


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(raw):
            raise DecodeError("truncated varint")
        b = raw[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def top_level_fields(raw: bytes, limit: int) -> int:
    """How many top-level fields (each entry of a repeated one counts) the serialized message
    ``raw`` has, counting no further than ``limit + 1``: time in proportion to that, not to ``raw``."""
    i, count = 0, 0
    while i < len(raw) and count <= limit:
        tag, i = _varint(raw, i)
        kind = tag & 7
        if kind == 0:
            _, i = _varint(raw, i)
        elif kind == 2:
            length, i = _varint(raw, i)
            i += length
        elif kind in (1, 5):
            i += 8 if kind == 1 else 4
        else:
            raise DecodeError(f"wire type {kind}")
        count += 1
    return count


class _Admission(grpc.ServerInterceptor):
    """Admits every Collective RPC from its headers (see BODY_TIMEOUT above).

    Without the right ``token`` (when there is one) the call gets UNAUTHENTICATED at once and its
    body is never read or decoded (constant-time comparison; the log names the peer, rate-limited
    by ``RefusalLog``, never the token). An admitted call reads and decodes its request itself:
    an undecodable one gets INVALID_ARGUMENT and a log line, not a traceback.
    """

    def __init__(self, token: str | None, refusals: RefusalLog, body: _BodyWatch,
                 fields: dict[str, Callable[[], int]] | None = None) -> None:
        self._token = token.encode() if token else None
        # method -> the most top-level fields its request may have, asked per call: a chief that
        # bound its port first learns its model's size later
        self._fields = fields or {}
        self._large = threading.Lock()
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

    def _decode(self, decode, raw: bytes, method: str):
        """``raw`` decoded. A decoded message takes far more memory than its bytes (16 MiB of
        empty entries of a repeated field: 1.2 GB), so a large request is decoded one at a time,
        after its top-level fields are counted against ``fields[method]`` (stopping past it)."""
        if decode is None:
            return raw
        if len(raw) <= LARGE_REQUEST:
            return decode(raw)
        with self._large:
            limit = self._fields[method]() if method in self._fields else None
            if limit is not None and top_level_fields(raw, limit) > limit:
                raise ProtocolError(f"{method} refused: the request has more than {limit} top-level fields "
                                    f"(entries of its repeated fields count one each); the limit is {limit}")
            return decode(raw)

    def _admit(self, handler, method: str):
        behavior = handler.unary_stream or handler.unary_unary
        decode = handler.request_deserializer

        def admitted(requests, context):
            raw = self._body.read(requests, context, method)
            if raw is None:
                context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended before its request arrived")
            try:
                request = self._decode(decode, raw, method)
            except DecodeError:
                self._refusals.refused(context.peer(), method, "an undecodable request")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid message")
            except ProtocolError as exc:
                self._refusals.refused(context.peer(), method, str(exc))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return behavior(request, context)

        if handler.request_streaming:
            if handler.response_streaming:
                raise TypeError(f"{method}: bidirectional streams are not admitted")  # the service has none

            def admitted_stream(requests, context):
                return handler.stream_unary(self._body.messages(requests, context, method, decode), context)

            return grpc.stream_unary_rpc_method_handler(admitted_stream, None, handler.response_serializer)
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(admitted, None, handler.response_serializer)
        return grpc.stream_unary_rpc_method_handler(admitted, None, handler.response_serializer)
