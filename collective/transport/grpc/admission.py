"""Admission at the gRPC server: the token checked from headers, bodies that never come cut, refusals logged without flooding."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from collective.errors import ProtocolError
from collective.logs import printable
from collective.sizes import format_bytes
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
# The bytes of large requests (past LARGE_REQUEST) a server holds at once: those being decoded
# and handled (LARGE_IN_FLIGHT; one is always let in, whatever its size), and those waiting for
# room (LARGE_WAITING, each up to the body deadline); past both, a call is refused at once with
# RESOURCE_EXHAUSTED naming the limit. A decoded request takes several times its bytes, and a
# handled one more (16 concurrent 9.5 MB Joins took a chief to 794-933 MiB before): the limit
# bounds what a token holder can make the chief hold. A real join storm fits (1,024 workers
# declaring 10,000 variables with 30-character names send 0.57 MiB joins, under LARGE_REQUEST;
# larger ones wait for room, and a join refused for it tries again).
LARGE_IN_FLIGHT = 32 << 20
LARGE_WAITING = 96 << 20


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; a no-op without
    glibc). A large request freed by a pool thread leaves its pages in that thread's arena, in
    this process's RSS, until then."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _LargeBytes:
    """The byte budget of large requests at one server (LARGE_IN_FLIGHT, LARGE_WAITING), kept
    on the server's event loop (every call of it runs there: no lock)."""

    def __init__(self, in_flight: int = LARGE_IN_FLIGHT, waiting: int = LARGE_WAITING) -> None:
        self.limit, self.waiting_limit = in_flight, waiting
        self.held = self.waiting = 0
        self._freed: asyncio.Condition | None = None

    def _fits(self, size: int) -> bool:
        return self.held == 0 or self.held + size <= self.limit

    async def take(self, size: int, timeout: float) -> str | None:
        """Hold ``size`` bytes (waiting up to ``timeout`` s for room): None, or why not."""
        if self._freed is None:
            self._freed = asyncio.Condition()
        if not self._fits(size):
            if self.waiting + size > self.waiting_limit:
                return (f"{format_bytes(self.held)} of large requests are being handled and "
                        f"{format_bytes(self.waiting)} more wait")
            self.waiting += size
            try:
                async with self._freed:
                    await asyncio.wait_for(self._freed.wait_for(lambda: self._fits(size)), timeout)
            except TimeoutError:
                return f"no room within {timeout:g} s ({format_bytes(self.held)} of large requests are being handled)"
            finally:
                self.waiting -= size
        self.held += size
        return None

    async def give(self, size: int) -> None:
        self.held -= size
        async with self._freed:
            self._freed.notify_all()


def _forget(exc: BaseException) -> None:
    """Drop what ``exc`` holds of the call: grpc keeps an abort's exception with the call's
    state, and its traceback holds our frames, which hold the call's context (a cycle, freed
    only by a full collection) and the request (9.5 MB of a Join, 50 MB decoded)."""
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None


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
                 fields: dict[str, Callable[[], int]] | None = None, offload=None,
                 large: _LargeBytes | None = None) -> None:
        self._token = token.encode() if token else None
        self._large_bytes = large or _LargeBytes()
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
        """The call's request, decoded, and the bytes of the budget it holds (``_LargeBytes``;
        0 for a small one) until ``_release``: a large one is refused when there is no room."""
        messages = requests.__aiter__()
        raw = await self._body.read(messages, context, method)
        # gRPC's receiver is a generator suspended where it yielded the request: it would hold
        # the bytes for as long as the call's state lives (past the answer, until a collection).
        await messages.aclose()
        if raw is None:
            await context.abort(grpc.StatusCode.CANCELLED, f"{method}: the call ended before its request arrived")
        size = len(raw) if len(raw) > LARGE_REQUEST else 0
        if size:
            why = await self._large_bytes.take(size, self._body.timeout)
            if why is not None:
                raw = None  # not held while the refusal is sent
                reason = (f"a request of {format_bytes(size)} refused: {why}; the limit is "
                          f"{format_bytes(self._large_bytes.limit)} of requests above {format_bytes(LARGE_REQUEST)} "
                          f"at once; try again later")
                self._refusals.refused(context.peer(), method, reason)
                await self._trim()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} {reason}")
        try:
            return await self._decoded(raw, context, method, decode), size
        except BaseException:
            raw = None
            await self._release(size)
            raise

    async def _release(self, size: int) -> None:
        """A call's request is gone: its bytes back to the budget, the heap trimmed."""
        if size:
            await self._large_bytes.give(size)
            await self._trim()

    async def _trim(self) -> None:
        """``trim_heap`` off the loop, once a large request's memory is freed."""
        await self._offload(trim_heap) if self._offload is not None else trim_heap()

    async def _decoded(self, raw: bytes, context, method: str, decode):
        why = None
        try:
            if len(raw) > LARGE_REQUEST and self._offload is not None:
                return await self._offload(self._decode, decode, raw, method)
            return self._decode(decode, raw, method)
        except DecodeError:
            why = (grpc.StatusCode.INVALID_ARGUMENT, "an undecodable request", f"{method}: the request is not a valid message")
        except ProtocolError as exc:
            why = (grpc.StatusCode.INVALID_ARGUMENT, str(exc), str(exc))
        raw = None  # the refusal, outside the except block: it holds neither the bytes nor their error
        code, reason, details = why
        self._refusals.refused(context.peer(), method, reason)
        await context.abort(code, details)

    def wrap(self, method: str, behavior, decode, serialize, *, request_streaming: bool = False,
             response_streaming: bool = False):
        """The handler of ``method``: ``behavior(request, context)`` (a coroutine, or an async
        generator with ``response_streaming``; with ``request_streaming`` it gets the decoded
        messages instead of one request), behind the token and the body deadline."""
        if request_streaming:
            async def admitted_stream(requests, context):
                try:
                    if not await self._refused(context, method):
                        return await behavior(self._body.messages(requests, context, method, decode), context)
                except grpc.aio.AbortError as exc:
                    _forget(exc)
                    requests = context = None  # noqa: F841 - nor does this frame, which the raise adds
                    raise

            return grpc.stream_unary_rpc_method_handler(admitted_stream, None, serialize)

        async def admitted_responses(requests, context, behavior=behavior):
            size = 0
            try:
                if not await self._refused(context, method):
                    request, size = await self._request(requests, context, method, decode)
                    responses, request = behavior(request, context), None  # held by the generator alone
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError as exc:
                _forget(exc)
                requests = context = request = responses = None  # noqa: F841
                raise
            finally:
                await self._release(size)

        if response_streaming:
            return grpc.stream_stream_rpc_method_handler(admitted_responses, None, serialize)

        async def once(request, context):
            answer, request = behavior(request, context), None  # held by the coroutine alone
            yield await answer

        async def admitted(requests, context):
            answers = admitted_responses(requests, context, once)
            try:
                return await anext(answers, None)
            except grpc.aio.AbortError:
                requests = context = None  # noqa: F841 - see _forget
                raise
            finally:
                await answers.aclose()

        return grpc.stream_unary_rpc_method_handler(admitted, None, serialize)
