"""The asyncio servicer over a ``ChiefHandler``: a bounded thread pool, one event loop per process.

Every worker holds up to four calls open for the whole round (the plan, the prepared barrier,
start, its presence). A thread per open call cost the chief 4 x 1,024 + 8 threads for 1,024
workers; here calls are coroutines on one event loop (``EventLoop``, shared by every server in
the process: a chief, the relays of the workers a process runs), the handler's synchronous
logic runs on a pool of ``POOL_THREADS`` threads whatever the number of workers, and a call that
waits for the round is parked (``collective.parking``): tried on the pool in poll mode, then
answered by the one parking thread when the round moves, or at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from concurrent import futures

import grpc

from collective import errors as E
from collective import parking
from collective._proto import collective_pb2 as pb
from collective.limits import MAX_ERROR_CHARS
from collective.logs import printable
from collective.plan import MAX_PIECED_BYTES, from_pieces, to_pieces
from collective.transport.api import ChiefHandler
from collective.transport.grpc.admission import _Admission
from collective.transport.grpc.tls import peer_identities
from collective.transport.grpc.wire import SERVICE, error_metadata, frame, status_code

log = logging.getLogger(__name__)

# Threads that run the handler's logic, per server: calls wait as coroutines or parked, so these
# only compute (a join, a heartbeat, a status) or stream the data (the chief's few direct children).
POOL_THREADS = 16
# Threads that build Status answers (``Servicer.Status``), apart from the pool.
STATUS_THREADS = 1
_END = object()


class EventLoop:
    """The process's one asyncio loop for gRPC servers, on a daemon thread started on first use
    (grpc.aio serves from one loop per process at a time)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="grpc-aio-loop", daemon=True).start()
                cls._loop = loop
            return cls._loop

    @classmethod
    def run(cls, coro, timeout: float | None = None):
        """Run ``coro`` on the loop from any other thread; its result."""
        return asyncio.run_coroutine_threadsafe(coro, cls.get()).result(timeout)


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _remaining(context) -> float:
    """Seconds until the caller's deadline, less a margin so our answer beats it."""
    left = context.time_remaining()
    return 3600.0 if left is None else max(0.0, left - 0.5)


class Servicer:
    """The service boundary: every handler error becomes a status the client maps back.

    A ``CollectiveError`` keeps its class (the ``errors`` table); anything else is a bug in this process:
    INTERNAL naming the method and the exception, with the traceback in this process's log.
    """

    def __init__(self, handler: ChiefHandler, pool, *, bind_identity: bool = False, name: str = "chief") -> None:
        self._h = handler
        self._pool = pool
        self._bind_identity = bind_identity
        self._plan_lock = threading.Lock()
        # Started on the first Status call; idle threads end with the process.
        self._status_pool = futures.ThreadPoolExecutor(max_workers=STATUS_THREADS, thread_name_prefix=f"{name}-status")
        self._status_building: dict[bool, asyncio.Future] = {}  # brief -> the Status answer being built
        self._plan_bytes: tuple[pb.Plan | None, bytes] = (None, b"")
        self._name = name

    async def _run(self, fn, *args):
        """``fn(*args)`` on the pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    offload = _run  # admission decodes a large request off the loop

    async def _parked(self, context, fn, *args):
        """``fn(*args, timeout)``, a call that may wait for the round: tried on the pool in poll
        mode, then parked (no thread) until it answers or its deadline passes."""
        timeout = _remaining(context)
        call, deadline = functools.partial(fn, *args, timeout), time.monotonic() + timeout
        tried_at = parking.generation
        try:
            return await self._run(parking.poll, call)
        except parking.NotYet as waiting:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            parker = parking.parker()
            key = parker.park(call, deadline, lambda result, error: loop.call_soon_threadsafe(
                _settle, fut, result, error), tried_at, waiting)
        try:
            return await fut
        finally:
            parker.unpark(key)

    async def _identity(self, context, worker_id: str) -> None:
        """With mutual TLS, a worker may only act under the id its certificate names."""
        if not self._bind_identity:
            return
        names = peer_identities(context)
        if worker_id not in names:
            log.warning("refused worker id %s from %s: its certificate names %s",
                        printable(repr(worker_id)), printable(context.peer()), printable(sorted(names)))
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"worker id {worker_id!r} refused: the client certificate names {', '.join(sorted(names)) or 'nobody'}",
            )

    def _watch(self, context, ref: pb.WorkerRef | None, what: str) -> list[bool]:
        """With ``ref``, a call that ends before it was answered (process gone, link cut) is
        reported to the handler as lost. Returns the flag to set once answered."""
        answered = [ref is None]
        if ref is not None:

            def on_end(_context) -> None:
                if not answered[0]:
                    with contextlib.suppress(RuntimeError):  # the pool is gone: the server stopped
                        self._pool.submit(self._h.lost, ref, f"its {what} call was cut off "
                                                             f"(process gone or connection lost)")

            context.add_done_callback(on_end)
        return answered

    async def _failed(self, context, method: str, exc: Exception):
        # The error's traceback holds the frames it passed (the pool's, with the request) and
        # the caller's, which holds the error (a cycle: freed only by a full collection, which
        # came seconds to minutes later; a 9.5 MB Join held 70 MB until then): logged, dropped.
        tb, exc.__traceback__ = exc.__traceback__, None
        if isinstance(exc, E.CollectiveError):
            context.set_trailing_metadata(error_metadata(exc))
            # Cut here, where every refusal leaves: a message quoting a peer's 10 MB name must
            # still fit the status (else the peer gets RESOURCE_EXHAUSTED, not the reason).
            await context.abort(status_code(exc), printable(str(exc), limit=MAX_ERROR_CHARS))
        log.error("%s from %s failed inside the %s", method, printable(context.peer()), self._name,
                  exc_info=(type(exc), exc, tb))
        tb = None
        await context.abort(
            grpc.StatusCode.INTERNAL,
            f"{method} failed inside the {self._name} ({type(exc).__name__}: {printable(exc)}); "
            f"this is a bug: the {self._name}'s log has the traceback",
        )

    async def _answer(self, context, method: str, coro, ref=None, what: str = ""):
        """Await ``coro``: its answer, or the status its error maps to."""
        answered = self._watch(context, ref, what)
        try:
            result = await coro
        except grpc.aio.AbortError:
            answered[0] = True
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            answered[0] = True
            await self._failed(context, method, exc)
        answered[0] = True
        return result

    async def _stream(self, context, method: str, iterator, ref, what: str):
        """Yield what the synchronous ``iterator`` yields, each step on the pool."""
        answered = self._watch(context, ref, what)
        try:
            while (item := await self._run(next, iterator, _END)) is not _END:
                yield item
        except grpc.aio.AbortError:
            answered[0] = True
            raise
        except Exception as exc:  # noqa: BLE001
            answered[0] = True
            await self._failed(context, method, exc)
        answered[0] = True

    # --- the methods -------------------------------------------------------------------------

    async def Join(self, request, context):  # noqa: N802 - gRPC method names
        await self._identity(context, request.worker_id)
        return await self._answer(context, "Join", self._run(self._h.join, request, context.peer()))

    async def GetPlan(self, request, context):  # noqa: N802
        """The plan in pieces (``collective.plan.to_pieces``): a plan of any size fits."""
        await self._identity(context, request.worker_id)
        data = await self._answer(context, "GetPlan", self._plan(context, request), request, "plan")
        for piece in to_pieces(data):
            yield piece

    async def _plan(self, context, request) -> bytes:
        return await self._run(self._serialized, await self._parked(context, self._h.get_plan, request))

    def _serialized(self, plan: pb.Plan) -> bytes:
        """Every worker gets the same plan: serialize it once (20 MiB of names take 0.1 s)."""
        with self._plan_lock:
            if self._plan_bytes[0] is not plan:
                self._plan_bytes = (plan, plan.SerializeToString())
            return self._plan_bytes[1]

    async def _parked_answer(self, context, method: str, fn, request, what: str):
        """A call that waits for the round (AwaitPrepared, AwaitStart): the caller's identity
        checked, then ``fn`` parked until it answers; a call cut off meanwhile is reported lost."""
        await self._identity(context, request.worker_id)
        return await self._answer(context, method, self._parked(context, fn, request), request, what)

    async def AwaitPrepared(self, request, context):  # noqa: N802
        return await self._parked_answer(context, "AwaitPrepared", self._h.await_prepared, request, "prepared")

    async def FetchRaw(self, request, context):  # noqa: N802
        """Fetch as raw frames (see ``frame``): the chunk's bytes are copied once, into the frame."""
        await self._identity(context, request.worker_id)
        views = self._h.stream_views([request])
        async for msg, data in self._stream(context, "FetchRaw", views, request, "data stream"):
            yield frame(msg, data)

    async def Fetch(self, request, context):  # noqa: N802
        await self._identity(context, request.worker_id)
        async for chunk in self._stream(context, "Fetch", self._h.fetch(request), request, "data stream"):
            yield chunk

    async def ReportReady(self, pieces, context):  # noqa: N802
        """A ReadyRequest in pieces: every device's chunk digests of a model of any size fit.

        The first piece names the sender (``Piece.worker``, with its secret): a call from anyone
        but a member is refused there, and a member's stops at what its report can be
        (``ready_bytes``), so no one makes the chief hold more than that. Each piece comes within
        the body deadline (``admission``)."""
        return await self._answer(context, "ReportReady", self._ready(pieces, context))

    async def _ready(self, pieces, context):
        first = await anext(pieces, None)
        if first is None or not first.HasField("worker"):
            raise E.ProtocolError("ReportReady refused: its first piece must name the worker (Piece.worker)")
        await self._identity(context, first.worker.worker_id)
        # Raises for a non-member or a wrong secret; never past MAX_PIECED_BYTES, whatever a member joined with.
        limit = min(await self._run(self._h.ready_bytes, first.worker), MAX_PIECED_BYTES)
        got, claimed, parts = len(first.data), first.total_bytes, [first]
        # Read no further than the limit: from_pieces then words the refusal.
        while claimed <= limit and got <= claimed and (piece := await anext(pieces, None)) is not None:
            parts.append(piece)
            got += len(piece.data)
            if piece.total_bytes != claimed:
                break
        sender = f"worker {printable(first.worker.worker_id)} at {printable(context.peer())}"
        request = await self._run(functools.partial(from_pieces, pb.ReadyRequest, parts, sender, max_bytes=limit))
        if request.worker != first.worker:
            raise E.ProtocolError(f"{sender} sent a ready report whose worker is not the one its first piece names")
        return await self._run(self._h.report_ready, request)

    async def AwaitStart(self, request, context):  # noqa: N802
        return await self._parked_answer(context, "AwaitStart", self._h.await_start, request, "start")

    async def Heartbeat(self, request, context):  # noqa: N802
        await self._identity(context, request.worker_id)
        return await self._answer(context, "Heartbeat", self._run(self._h.heartbeat, request))

    async def ReportFailure(self, request, context):  # noqa: N802
        await self._identity(context, request.worker.worker_id)
        return await self._answer(context, "ReportFailure", self._run(self._h.report_failure, request))

    async def Status(self, request, context):  # noqa: N802
        """The status, serialized (``handlers``: sent as it is). Built on threads of its own, not
        the pool: a join storm queues 1,024 joins on the pool (each waits there for its turn to
        compare declarations), and a Status behind them waited seconds (6 s at 1,024 workers).
        Calls that come while one is being built share it: every ``collective.join`` worker asks
        once its round took ``straggler_log`` s (whom it waits for), 1,024 of them within a
        second, and each answer lists every worker (100 KB at 1,024): built for each, they
        held the chief's lock for seconds. Those workers ask a ``brief`` one (no worker lines)."""
        brief = request.brief
        building = self._status_building.get(brief)
        if building is None or building.done():
            building = self._status_building[brief] = asyncio.get_running_loop().run_in_executor(
                self._status_pool, lambda: self._h.status(brief).SerializeToString())
        return await self._answer(context, "Status", asyncio.shield(building))

    async def Presence(self, request, context):  # noqa: N802
        await self._identity(context, request.worker_id)
        return await self._answer(context, "Presence", self._parked(context, self._h.await_outcome, request),
                                  request, "presence")

    def handlers(self, admission: _Admission, data_answer: bytes) -> grpc.GenericRpcHandler:
        """Every method of the service (FetchRaw and DataPath outside the .proto), each admitted
        by ``admission`` from its headers."""
        method = pb.DESCRIPTOR.services_by_name["Collective"].methods_by_name
        table = {}
        for name, m in method.items():
            decode = getattr(pb, m.input_type.name).FromString
            encode = getattr(pb, m.output_type.name).SerializeToString
            table[name] = admission.wrap(name, getattr(self, name), decode, encode,
                                         request_streaming=m.client_streaming, response_streaming=m.server_streaming)

        async def data_path(request, context) -> bytes:
            return data_answer

        table["Status"] = admission.wrap("Status", self.Status, pb.StatusRequest.FromString, None)  # bytes already
        table["FetchRaw"] = admission.wrap("FetchRaw", self.FetchRaw, pb.WorkerRef.FromString, None,
                                           response_streaming=True)
        table["DataPath"] = admission.wrap("DataPath", data_path, None, None)
        return grpc.method_handlers_generic_handler(SERVICE, table)
