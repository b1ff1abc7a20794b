"""``publish``: serve a state (tensors + JSON values) at one step to whoever fetches it.

The state becomes a plan like a chief's (``collective.plan.build_plan``: the tensors and the
skeleton variable laid out in one arena, each variable's digest, every chunk's digest, the
manifest digest, computed once here) and is served by a ``GrpcEndpoint`` like a chief's: GetPlan
answers the plan in pieces, the data stream goes over the raw data port (an abstract unix socket
on the same host, TCP otherwise) or FetchRaw, cut by the same ``Chunker``; the cluster token
guards every call (the endpoint's interceptor, the data port's hello). The only addition is the
stripe: a fetcher may ask for the chunks from ``WorkerRef.resume_from`` to ``WorkerRef.stop_at``
only (a ``ChunkRange``, as every sender reads it), so several holders each serve a part
(``collective.snapshot.fetch``).

``copy=False`` (default): nothing is copied; the chunks are read from the caller's own arrays
(an ``arena.ScatterView``), so they must not change until ``close()`` returns (a fetcher would get
bytes that differ from the digests and name this holder). ``copy=True``: one arena holds a copy,
and the caller may change its tensors at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Mapping

import numpy as np

from collective import config, dtypes
from collective._proto import collective_pb2 as pb
from collective.arena import ScatterView, SharedArena, new_arena
from collective.config import TlsFiles
from collective.digest import array_digest, bytes_digest, chunk_digests
from collective.errors import AbortedError, UsageError
from collective.limits import (
    MAX_HOLDER_NAME_CHARS,
    MIN_SNAPSHOT_CHUNK_BYTES,
    check_ref,
    snapshot_chunking_refused,
)
from collective.model import VariableSpec
from collective.plan import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, build_plan, layout
from collective.snapshot import tree
from collective.stream import Chunker, ChunkRange, with_bytes
from collective.transport.api import plan_server

log = logging.getLogger(__name__)

CLOSE_GRACE = 10.0
"""How long ``close()`` waits for fetches in progress before it cuts them."""
QUIET = 0.5
"""A fetch in progress opens its next stripe's stream within this of the last one's end (or of
asking for the plan): ``close()`` waits until nothing has happened for this long."""

MODEL_PREFIX = "snapshot step "
"""A publication's ``Plan.model``: this and the step, which a fetcher reads before any byte,
then ``HOLDER_SEP`` and the holder's name (``publish(name=)``), which its errors print."""
HOLDER_SEP = " holder "


def holder_name(name: str | None) -> str:
    """The name a publication goes by in fetchers' errors: ``name``, else ``host:pid``."""
    if name is None:
        return f"{socket.gethostname()}:{os.getpid()}"
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_HOLDER_NAME_CHARS:
        raise UsageError(f"name={str(name)[:80]!r}: a publication's name is 1..{MAX_HOLDER_NAME_CHARS} characters")
    return name


def cluster_token(token: str | None) -> str | None:
    """``token``, else the cluster token every other call of the project reads (COLLECTIVE_TOKEN)."""
    return token if token is not None else config.env_default("token")


def _contiguous(arrays: dict[str, np.ndarray], copy: bool) -> dict[str, np.ndarray]:
    """Arrays the arena can read in place: a non-contiguous one is copied (and says so)."""
    out = {}
    for name, a in arrays.items():
        if not a.flags.c_contiguous:
            if not copy:
                log.info("publish: %r is not contiguous; serving a contiguous copy of it", name)
            a = np.ascontiguousarray(a)
        out[name] = a
    return out


def _memfd_arena(total: int):
    """A ``SharedArena`` (a memfd, every page in place) for a copy, or None where this kernel
    or platform has none (then plain memory)."""
    try:
        return SharedArena(total, prefault=True)
    except (OSError, AttributeError) as exc:  # no memfd_create (not Linux) or no memory file left
        log.info("publish: no memory file for the copy (%s); same-host fetchers take the stream", exc)
        return None


def build(state: Mapping, step: int, *, copy: bool, chunk_bytes: int,
          name: str = "") -> tuple[pb.Plan, object, list]:
    """The plan of ``state`` at ``step``, the arena it is served from, and what keeps the arrays
    alive (with ``copy``, its last item is the sealed ``SharedArena`` a same-host fetcher may
    map, or None). Every digest is computed here, once."""
    skeleton, arrays = tree.flatten(state)
    arrays = _contiguous(arrays, copy)
    arrays[tree.TREE] = tree.encode(skeleton, step)
    names = list(arrays)
    specs = [VariableSpec(n, tuple(int(d) for d in arrays[n].shape), dtypes.wire(arrays[n].dtype)) for n in names]
    offsets, total = layout(specs)
    if copy:
        shared = _memfd_arena(total)
        arena = shared.array if shared is not None else new_arena(total)
        end = 0
        for n, off in zip(names, offsets, strict=True):
            arena[end:off] = 0  # the padding: zeros, as a ScatterView reads it (same chunk digests)
            arena[off : off + arrays[n].nbytes] = arrays[n].reshape(-1).view(np.uint8)
            end = off + arrays[n].nbytes
        arena[end:] = 0
        digests = [array_digest(arena[off : off + s.nbytes]) for off, s in zip(offsets, specs, strict=True)]
        chunks = chunk_digests(arena, chunk_bytes)
        if shared is not None:
            del arena  # the seal needs every writable view gone
            try:
                shared.seal()  # read-only for everyone, this process too: what was hashed stays
            except (BufferError, OSError) as exc:
                log.info("publish: cannot seal the copy (%s); same-host fetchers take the stream", exc)
                keep_shared = None
            else:
                keep_shared = shared
            arena = shared.array
        else:
            keep_shared = None
        keep: list = [arena, shared, keep_shared]
    else:
        arena = ScatterView([(off, arrays[n]) for off, n in zip(offsets, names, strict=True)], total)
        digests = [array_digest(arrays[n]) for n in names]
        chunks = [bytes_digest(arena.slice(i, min(i + chunk_bytes, total))) for i in range(0, total, chunk_bytes)]
        keep = [arrays, None, None]
    worker = pb.WorkerInfo(rank=0, worker_id="fetcher", devices=["cpu:0"], parent=-1)
    plan = build_plan(specs, digests, [worker], arena=np.empty(0, np.uint8),
                      chunk_bytes=chunk_bytes, chief_incarnation=secrets.token_hex(8),
                      model=f"{MODEL_PREFIX}{step}{HOLDER_SEP}{name}" if name else f"{MODEL_PREFIX}{step}",
                      chunks=chunks)
    return plan, arena, keep


class SnapshotHandler:
    """The ``PlanSource`` of a publication: its plan and its data stream, whole or a stripe (its
    server refuses every call of a round: ``transport.api.plan_server``). Counts what it served
    and the streams in progress."""

    num_workers = 8  # sizes the endpoint's thread pool: 4 calls for each of 8 fetchers at once
    refusal = ("this is a publication (collective.publish): it serves its plan and its "
               "data stream to collective.fetch, not a round")

    def __init__(self, plan: pb.Plan, arena) -> None:
        self.plan = plan
        self.specs = plan.variables
        self._chunker = Chunker(plan, arena)
        self._cond = threading.Condition()
        self._active = 0
        self._closing = False  # no new fetch (GetPlan refused); those in progress go on
        self._closed = False  # no stream either
        self._last = 0.0  # monotonic time of the last plan asked for or stream ended
        self.bytes_served = 0
        self.streams_served = 0

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        check_ref(ref)
        with self._cond:
            self._refuse_if_closed(self._closing)
            self._last = time.monotonic()
        return self.plan

    def _refuse_if_closed(self, closed: bool) -> None:
        if closed:
            step = self.plan.model.removeprefix(MODEL_PREFIX).partition(HOLDER_SEP)[0]
            raise AbortedError(f"this holder publishes nothing now (its step {step} was withdrawn or closed)")

    def stream_views(self, refs: list[pb.WorkerRef]) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """The stream (``Chunker.frames``) of the chunks asked for (``ChunkRange.of``): a
        stripe from ``resume_from`` to ``stop_at`` (0: the end)."""
        ref = refs[0]
        check_ref(ref)
        rng = ChunkRange.of(ref, self.plan)
        with self._cond:
            self._refuse_if_closed(self._closed)
            self._active += 1
        try:
            for msg, data in self._chunker.frames(rng):
                yield msg, data
                with self._cond:
                    self.bytes_served += len(data)
        finally:
            with self._cond:
                self._active -= 1
                self.streams_served += 1
                self._last = time.monotonic()
                self._cond.notify_all()

    def fetch(self, ref: pb.WorkerRef) -> Iterator[pb.Chunk]:
        return with_bytes(self.stream_views([ref]))

    def lost(self, ref: pb.WorkerRef, reason: str) -> None:
        log.info("a fetch of this publication ended early: %s", reason)

    def status(self, brief: bool = False) -> pb.StatusReply:
        return pb.StatusReply(phase="publishing" if not self._closing else "closed")

    def close(self, grace: float) -> bool:
        """Refuse new fetches; wait up to ``grace`` s for those in progress (streams active, or
        one ended or a plan asked for within ``QUIET`` s: the fetch's next stripe may follow),
        then refuse every stream. True if none was left in progress."""
        deadline = time.monotonic() + grace
        with self._cond:
            self._closing = True
            while (now := time.monotonic()) < deadline:
                if not self._active and now - self._last >= QUIET:
                    break
                self._cond.wait(min(deadline - now, QUIET))
            self._closed = True
            return not self._active



class _Serving:
    """What the endpoint serves: the publication's current handler. ``Publication.replace``
    swaps it, so a new state is served at the same address without closing the listening socket
    (the servicer and the raw data port look the handler's methods up at each call)."""

    def __init__(self, handler: SnapshotHandler) -> None:
        self.current = handler

    def __getattr__(self, attr: str):
        return getattr(self.current, attr)


def _state_served(state: Mapping, step: int, copy: bool, chunk_bytes: int, name: str):
    """(handler, keep, shm_server) serving ``state`` at ``step``: its plan, its arena, and with
    ``copy`` the sealed copy's server a same-host fetcher maps."""
    plan, arena, keep = build(state, step, copy=copy, chunk_bytes=chunk_bytes, name=name)
    refused = snapshot_chunking_refused(plan.total_bytes, chunk_bytes)
    if refused is not None:  # a fetch would refuse this plan
        _release(keep, None)
        raise UsageError(f"chunk_bytes={chunk_bytes} cuts this state of {plan.total_bytes} bytes into {refused}; "
                         f"use chunk_bytes of at least {MIN_SNAPSHOT_CHUNK_BYTES} (default {DEFAULT_CHUNK_BYTES})")
    shm_server = None
    if keep[2] is not None:  # a sealed copy: a fetcher on this host maps it instead of the stream
        from collective.transport.shm import ShmServer

        shm_server = ShmServer(keep[2], lambda worker_id, incarnation: None)  # the token guarded the plan
        plan.shm_socket, plan.shm_secret = shm_server.name, shm_server.secret
    return SnapshotHandler(plan, arena), keep, shm_server


def _release(keep: list, shm_server) -> None:
    """Drop a served state: its copy's server and memory file, the references to its arrays."""
    if shm_server is not None:
        shm_server.close()  # a fetcher's mapping stays valid: the kernel frees the file after it
    shared = keep[1] if keep else None
    keep.clear()  # the caller's arrays (or the copy) are no longer referenced
    if shared is not None:
        shared.close()


class Publication:
    """A state served at one step (``publish``). ``address`` is what fetchers dial; ``close()``
    stops serving (idempotent; waits up to ``CLOSE_GRACE`` s for fetches in progress); a context
    manager. ``stats()``: bytes and streams served so far (by the current state).
    ``replace(state, step)`` serves another state at the same address; ``withdraw()`` stops
    serving the state but keeps the address."""

    def __init__(self, handler: SnapshotHandler, endpoint, address: str, step: int, keep: list,
                 shm_server=None, name: str = "", *, serving: _Serving | None = None, copy: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self._handler, self._endpoint, self._keep, self._shm = handler, endpoint, keep, shm_server
        self._serving = serving or _Serving(handler)
        self._copy, self._chunk_bytes = copy, chunk_bytes
        self.address, self.name = address, name
        self.step = step
        self.manifest_digest = handler.plan.manifest_digest
        self.total_bytes = handler.plan.total_bytes
        self._lock = threading.Lock()
        self._closed = False

    def withdraw(self, grace: float = CLOSE_GRACE) -> None:
        """Stop serving this state (fetches in progress get up to ``grace`` s; then a fetch is
        refused: "publishes nothing now") but keep listening at ``address``; the caller may
        change its tensors once this returns. ``replace`` serves again."""
        with self._lock:
            if self._closed:
                raise UsageError(f"publication at {self.address} is closed")
            self._withdraw(grace)

    def _withdraw(self, grace: float) -> None:
        """(Lock held.) Refuse the current state, then let it go."""
        if not self._handler.close(grace):
            log.warning("publication of step %d at %s: fetches still in progress after %g s are cut",
                        self.step, self.address, grace)
        _release(self._keep, self._shm)
        self._shm = None

    def replace(self, state: Mapping, step: int, grace: float = CLOSE_GRACE) -> None:
        """Serve ``state`` at ``step`` instead, at the same address (the listening socket stays
        open: fetchers keep the address across steps). The old state is withdrawn first
        (fetches of it in progress get up to ``grace`` s); ``copy``, ``chunk_bytes`` and
        ``name`` are those of ``publish``."""
        _check_step(step)
        with self._lock:
            if self._closed:
                raise UsageError(f"publication at {self.address} is closed")
            self._withdraw(grace)
            handler, keep, shm_server = _state_served(state, step, self._copy, self._chunk_bytes, self.name)
            self._handler, self._keep, self._shm = handler, keep, shm_server
            self._serving.current = handler
            self.step, self.manifest_digest, self.total_bytes = step, handler.plan.manifest_digest, handler.plan.total_bytes
        log.info("publishing step %d (%d bytes, manifest %s) at %s, in place of the last", step,
                 self.total_bytes, self.manifest_digest, self.address)

    def stats(self) -> dict[str, int]:
        return {"bytes_served": self._handler.bytes_served, "streams_served": self._handler.streams_served}

    def close(self, grace: float = CLOSE_GRACE) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._withdraw(grace)
        self._endpoint.stop(0.5)

    def __enter__(self) -> Publication:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"Publication(step={self.step}, address={self.address!r}, {self.total_bytes} bytes, {state})"


def publish(state: Mapping, *, step: int, token: str | None = None, bind: str = "0.0.0.0:0",
            advertise: str | None = None, copy: bool = False, chunk_bytes: int | None = None,
            tls: TlsFiles | None = None, name: str | None = None) -> Publication:
    """Serve ``state`` at ``step`` to ``collective.fetch`` until ``close()``.

    :param state: a mapping name -> array (numpy array or CPU torch tensor), or a nested
        ``state_dict`` / optimizer ``state_dict()``: dicts (str or int keys), lists and tuples
        nesting tensors and JSON values (int, float, bool, None, str). Tensors travel as raw
        bytes, the rest as JSON; anything else is a UsageError naming its key path. Nothing is
        pickled.
    :param step: the training step this state is; a fetch names the step it wants.
    :param token: the cluster token every call must present (default ``COLLECTIVE_TOKEN``).
    :param bind: ``HOST:PORT`` to listen on (port 0: a free one).
    :param advertise: the host fetchers dial (default: the bound host, or this host's name
        when bound to every address).
    :param copy: False (default): the arrays are served in place, with no second copy of the
        state; the caller must not change them until ``close()`` returns (a fetcher would get
        bytes that differ from the digests, and name this holder). True: one copy is taken
        now (into a sealed memory file: a fetcher on this host maps it instead of receiving
        the stream) and the caller may change its tensors at once.
    :param chunk_bytes: the unit of streaming and verification (default 4 MiB; at least 64 KiB
        unless the state is at most 1,024 chunks: a fetch refuses finer plans).
    :param tls: ``TlsFiles(cert=, key=)`` to serve over TLS; with ``ca=`` too, mutual TLS
        (a fetcher must present a certificate that CA signed).
    :param name: what fetchers' errors call this holder (``holder NAME at ADDR``), at most
        ``MAX_HOLDER_NAME_CHARS`` characters; default ``host:pid``.
    :return: the ``Publication`` (``address``, ``name``, ``step``, ``manifest_digest``, ``close()``).
    """
    from collective.transport.grpc import GrpcEndpoint

    _check_step(step)
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise UsageError(f"chunk_bytes={chunk_bytes}: use 1..{MAX_CHUNK_BYTES}")
    name = holder_name(name)
    started = time.monotonic()
    handler, keep, shm_server = _state_served(state, step, copy, chunk_bytes, name)
    plan, serving = handler.plan, _Serving(handler)
    endpoint = GrpcEndpoint(bind, token=cluster_token(token), name="holder", tls=tls)
    try:
        bound = endpoint.start(plan_server(serving))
    except BaseException:
        _release(keep, shm_server)
        raise
    host = advertise or bound.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()  # what another host can dial; advertise= overrides it
    address = f"[{host}]:{endpoint.port}" if ":" in host else f"{host}:{endpoint.port}"
    log.info("publishing step %d (%d tensors, %d bytes, manifest %s) at %s, %s, in %.2f s", step,
             len(plan.variables) - 1, plan.total_bytes, plan.manifest_digest, address,
             "copied" if copy else "served in place", time.monotonic() - started)
    return Publication(handler, endpoint, address, step, keep, shm_server, name, serving=serving, copy=copy,
                       chunk_bytes=chunk_bytes)


def _check_step(step) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"step must be an integer >= 0, not {step!r}")
