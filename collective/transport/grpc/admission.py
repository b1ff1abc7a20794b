"""Admission at the gRPC server: the token checked from headers, bodies that never come cut, refusals logged without flooding."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from collective.errors import ProtocolError
from collective.logs import printable
from collective.transport.grpc.wire import TOKEN_HEADER

log = logging.getLogger(__name__)


# --- admission -----------------------------------------------------------------------------

# A peer must never hold the server for long. The server is asyncio (``servicer.py``): a call
# waiting for its body holds no thread, but it holds memory and a slot, so every Collective RPC
# is admitted here from its headers alone: a call without the right token is refused at once,
# its body never read or decoded; an admitted call reads its one request under a deadline
# (BODY_TIMEOUT: a member sends it with the headers), after which the call is cut (CANCELLED).
# A client stream (ReportReady's pieces) reads each of its messages under the same deadline;
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
    """Reads a call's request (or each message of a client stream) under ``timeout`` s; a call
    whose request does not come is cut with CANCELLED and one refusal line."""

    def __init__(self, timeout: float, refusals: RefusalLog) -> None:
        self.timeout = timeout
        self._refusals = refusals

    async def messages(self, requests, context, method: str, decode) -> AsyncIterator:
        """A client stream's messages, decoded, each read under the deadline. An undecodable
        message is one refusal line and a ProtocolError (INVALID_ARGUMENT at the servicer's
        boundary), never a traceback."""
        requests = requests.__aiter__()
        while (raw := await self.read(requests, context, method)) is not None:
            try:
                yield decode(raw) if decode is not None else raw
            except DecodeError:
                self._refusals.refused(context.peer(), method, "an undecodable request")
                raise ProtocolError(f"{method}: a message of the request stream is not a valid message") from None

    async def read(self, requests, context, method: str):
        """The call's next request, or None at the end of its stream; past the deadline the call is cut."""
        try:
            return await asyncio.wait_for(requests.__anext__(), self.timeout)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            reason = f"no request within {self.timeout:g} s of its headers"
            self._refusals.refused(context.peer(), method, reason)
            await context.abort(grpc.StatusCode.CANCELLED, f"{method} cut: {reason}")

    def close(self) -> None:
        pass


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


class _Admission:
    """Admits every Collective RPC from its headers (see BODY_TIMEOUT above): wraps each method's
    handler (``wrap``) so it runs only once admitted.

    Without the right ``token`` (when there is one) the call gets UNAUTHENTICATED at once and its
    body is never read or decoded (constant-time comparison; the log names the peer, rate-limited
    by ``RefusalLog``, never the token). An admitted call reads and decodes its request itself:
    an undecodable one gets INVALID_ARGUMENT and a log line, not a traceback. ``offload(fn, *args)``
    runs a large decode off the event loop.
    """

    def __init__(self, token: str | None, refusals: RefusalLog, body: _BodyWatch,
                 fields: dict[str, Callable[[], int]] | None = None, offload=None) -> None:
        self._token = token.encode() if token else None
        # method -> the most top-level fields its request may have, asked per call: a chief that
        # bound its port first learns its model's size later
        self._fields = fields or {}
        self._large = threading.Lock()
        self._refusals = refusals
        self._body = body
        self._offload = offload

    async def _refused(self, context, method: str) -> bool:
        if self._token is None:
            return False
        given = dict(context.invocation_metadata() or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._token):
            return False
        reason = "no cluster token" if not given else "a wrong cluster token"
        self._refusals.refused(context.peer(), method, reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} refused: {reason}")
        return True

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

    async def _request(self, requests, context, method: str, decode):
        raw = await self._body.read(requests.__aiter__(), context, method)
        if raw is None:
            await context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended before its request arrived")
        try:
            if len(raw) > LARGE_REQUEST and self._offload is not None:
                return await self._offload(self._decode, decode, raw, method)
            return self._decode(decode, raw, method)
        except DecodeError:
            self._refusals.refused(context.peer(), method, "an undecodable request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid message")
        except ProtocolError as exc:
            self._refusals.refused(context.peer(), method, str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def wrap(self, method: str, behavior, decode, serialize, *, request_streaming: bool = False,
             response_streaming: bool = False):
        """The handler of ``method``: ``behavior(request, context)`` (a coroutine, or an async
        generator with ``response_streaming``; with ``request_streaming`` it gets the decoded
        messages instead of one request), behind the token and the body deadline."""
        if request_streaming:
            async def admitted_stream(requests, context):
                if not await self._refused(context, method):
                    return await behavior(self._body.messages(requests, context, method, decode), context)

            return grpc.stream_unary_rpc_method_handler(admitted_stream, None, serialize)
        if response_streaming:
            async def admitted_responses(requests, context):
                if not await self._refused(context, method):
                    request = await self._request(requests, context, method, decode)
                    async for response in behavior(request, context):
                        yield response

            return grpc.stream_stream_rpc_method_handler(admitted_responses, None, serialize)

        async def admitted(requests, context):
            if not await self._refused(context, method):
                return await behavior(await self._request(requests, context, method, decode), context)

        return grpc.stream_unary_rpc_method_handler(admitted, None, serialize)
