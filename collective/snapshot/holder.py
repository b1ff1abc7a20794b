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

from collective import config, parking
from collective._proto import collective_pb2 as pb
from collective.arena import ScatterView
from collective.config import TlsFiles
from collective.digest import array_digest, bytes_digest
from collective.errors import AbortedError, PreconditionError, UsageError
from collective.limits import (
    MAX_HOLDER_NAME_CHARS,
    MIN_SNAPSHOT_CHUNK_BYTES,
    check_ref,
    snapshot_chunking_refused,
)
from collective.plan import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, build_plan, layout
from collective.snapshot import tree, versions
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


def model_label(step: int, name: str, base: int | None = None) -> str:
    """A plan's ``model``: ``snapshot step N`` (``... delta from M`` for a step's delta), then
    ``HOLDER_SEP`` and the holder's name."""
    label = f"{MODEL_PREFIX}{step}" + (f"{versions.DELTA_LABEL}{base}" if base is not None else "")
    return f"{label}{HOLDER_SEP}{name}" if name else label


def plan_of(c: versions.Copied, chunk_bytes: int, name: str = "", base: int | None = None) -> tuple[pb.Plan, object, list]:
    """The plan of the copied, hashed state ``c``, the arena it is served from (sealed where it
    is a memory file: read-only for everyone, this process too) and what keeps it alive (its
    last item the sealed ``SharedArena`` a same-host fetcher may map, or None)."""
    worker = pb.WorkerInfo(rank=0, worker_id="fetcher", devices=["cpu:0"], parent=-1)
    plan = build_plan(c.specs, c.digests, [worker], arena=np.empty(0, np.uint8), chunk_bytes=chunk_bytes,
                      chief_incarnation=secrets.token_hex(8), model=model_label(c.step, name, base), chunks=c.chunks)
    shared, keep_shared = c.shared, None
    if shared is not None:
        c.arena = None  # the seal needs every writable view gone
        try:
            shared.seal()  # read-only for everyone, this process too: what was hashed stays
        except (BufferError, OSError) as exc:
            log.info("publish: cannot seal the copy (%s); same-host fetchers take the stream", exc)
        else:
            keep_shared = shared
        c.arena = shared.array
    return plan, c.arena, [c.arena, shared, keep_shared]


def build(state: Mapping, step: int, *, copy: bool, chunk_bytes: int, name: str = "",
          base: int | None = None) -> tuple[pb.Plan, object, list]:
    """The plan of ``state`` at ``step``, the arena it is served from, and what keeps the arrays
    alive (with ``copy``, its last item is the sealed ``SharedArena`` a same-host fetcher may
    map, or None; its first, the copy). Every digest is computed here, once. ``base``: the
    state is step ``step``'s delta from that step (``versions``)."""
    if copy:
        c = versions.copy_state(state, step)
        versions.hash_all(c, chunk_bytes)
        plan, arena, keep = plan_of(c, chunk_bytes, name, base)
        keep.append(c)
        return plan, arena, keep
    skeleton, arrays = tree.flatten(state)
    arrays = _contiguous(arrays, copy)
    arrays[tree.TREE] = tree.encode(skeleton, step)
    names = list(arrays)
    specs = versions.specs_of(arrays)
    offsets, total = layout(specs)
    arena = ScatterView([(off, arrays[n]) for off, n in zip(offsets, names, strict=True)], total)
    digests = [array_digest(arrays[n]) for n in names]
    chunks = [bytes_digest(arena.slice(i, min(i + chunk_bytes, total))) for i in range(0, total, chunk_bytes)]
    keep = [arrays, None, None, None]
    worker = pb.WorkerInfo(rank=0, worker_id="fetcher", devices=["cpu:0"], parent=-1)
    plan = build_plan(specs, digests, [worker], arena=np.empty(0, np.uint8),
                      chunk_bytes=chunk_bytes, chief_incarnation=secrets.token_hex(8),
                      model=model_label(step, name, base), chunks=chunks)
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
                if self._closed:  # withdrawn mid-stream: its bytes may be changing now (a subscriber's)
                    self._refuse_if_closed(True)
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

    def cut(self, timeout: float) -> bool:
        """Refuse every call and stream at once (a stream in progress ends at its next chunk),
        and wait up to ``timeout`` s for those in progress to end: the arrays it reads may
        change after that (a subscriber applying its next step). True if none was left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = self._closed = True
            while self._active and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return not self._active

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



class Serving:
    """What the endpoint serves: the publication's current handler (its state in full), and
    the current step's delta from the step before (``Publication.update``), if any. A stream
    is served by the plan it names (``WorkerRef.incarnation``, the plan's
    ``chief_incarnation``): the current plans, or one just replaced whose fetches in progress
    are still served (``retiring``); a plan no longer served is refused in one line, never
    answered with another step's bytes. ``replace`` and ``update`` swap what is served
    without closing the listening socket (the servicer and the raw data port look the
    handler's methods up at each call)."""

    POLL_WAIT = 30.0  # at most this long a GetPlan asking for a newer step waits, then answers

    def __init__(self, handler: SnapshotHandler, step: int) -> None:
        self.current, self.step = handler, step
        self.delta: SnapshotHandler | None = None
        self.delta_base: int | None = None
        self.retiring: list[SnapshotHandler] = []
        self.closed = False
        self.served_before = 0  # bytes served by plans no longer served
        self.cond = parking.Condition()

    def __getattr__(self, attr: str):
        return getattr(self.current, attr)

    def swap(self, handler: SnapshotHandler, step: int, delta: SnapshotHandler | None = None,
             base: int | None = None) -> list[SnapshotHandler]:
        """Serve ``handler`` (step ``step``) and its ``delta`` from step ``base`` from now on;
        the handlers replaced, which the caller retires (``SnapshotHandler.close``)."""
        with self.cond:
            old = [h for h in (self.current, self.delta) if h is not None]
            self.current, self.step, self.delta, self.delta_base = handler, step, delta, base
            self.retiring.extend(old)
            self.cond.notify_all()
        return old

    def retired(self, handlers: list[SnapshotHandler]) -> None:
        with self.cond:
            self.served_before += sum(h.bytes_served for h in self.retiring if h in handlers)
            self.retiring = [h for h in self.retiring if h not in handlers]

    def end(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def get_plan(self, ref: pb.WorkerRef, timeout: float) -> pb.Plan:
        if ref.HasField("newer_than"):  # a long poll: until a step past that one is served
            with self.cond:
                parking.wait_for(self.cond, lambda: self.step > ref.newer_than or self.closed,
                                 min(timeout, self.POLL_WAIT), key=f"newer than {ref.newer_than}")
        with self.cond:
            current, delta, base, step = self.current, self.delta, self.delta_base, self.step
        if not ref.HasField("delta_from"):
            return current.get_plan(ref, timeout)
        if delta is None or base != ref.delta_from:
            held = f"a delta from step {base}" if delta is not None else "no delta"
            raise PreconditionError(f"this holder serves step {step} and {held}, not a delta from step "
                                    f"{ref.delta_from}: fetch step {step} in full")
        return delta.get_plan(ref, timeout)

    def stream_views(self, refs: list[pb.WorkerRef]) -> Iterator[tuple[pb.Chunk, memoryview]]:
        want = refs[0].incarnation
        with self.cond:
            served = [h for h in (self.current, self.delta, *self.retiring) if h is not None]
        if not want:  # a fetch that names no plan: the current state
            return served[0].stream_views(refs)
        for h in served:
            if h.plan.chief_incarnation == want:
                return h.stream_views(refs)
        raise AbortedError(f"this holder no longer serves the plan {want[:16]!r} (its step was replaced; "
                           f"it serves step {self.step} now)")

    def fetch(self, ref: pb.WorkerRef) -> Iterator[pb.Chunk]:
        return with_bytes(self.stream_views([ref]))

    def bytes_served(self) -> int:
        with self.cond:
            return self.served_before + sum(h.bytes_served for h in (self.current, self.delta, *self.retiring)
                                            if h is not None)


def _served(plan: pb.Plan, arena, keep: list, chunk_bytes: int) -> tuple[SnapshotHandler, list, object]:
    """(handler, keep, shm_server) serving ``plan`` from ``arena``: with a sealed copy
    (``keep[2]``), the server a same-host fetcher maps it through."""
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
    handler = SnapshotHandler(plan, arena)
    handler.keep, handler.shm = keep, shm_server
    return handler, keep, shm_server


def _state_served(state: Mapping, step: int, copy: bool, chunk_bytes: int, name: str, base: int | None = None):
    """(handler, keep, shm_server) serving ``state`` at ``step``: its plan, its arena, and with
    ``copy`` the sealed copy's server a same-host fetcher maps."""
    plan, arena, keep = build(state, step, copy=copy, chunk_bytes=chunk_bytes, name=name, base=base)
    return _served(plan, arena, keep, chunk_bytes)


def _release(keep: list, shm_server) -> None:
    """Drop a served state: its copy's server and memory file, the references to its arrays."""
    if shm_server is not None:
        shm_server.close()  # a fetcher's mapping stays valid: the kernel frees the file after it
    shared = keep[1] if keep else None
    keep.clear()  # the caller's arrays (or the copy) are no longer referenced
    if shared is not None:
        shared.close()


def _retire(handler: SnapshotHandler, grace: float) -> bool:
    """Refuse ``handler``'s plan to new fetches, let those in progress end (up to ``grace`` s),
    then free its memory. True if none was cut."""
    done = handler.close(grace)
    _release(handler.keep, handler.shm)
    handler.shm = None
    return done


class Publication:
    """A state served at one step (``publish``). ``address`` is what fetchers dial; ``close()``
    stops serving (idempotent; waits up to ``CLOSE_GRACE`` s for fetches in progress); a context
    manager. ``stats()``: bytes and streams served so far. ``update(state, step)`` serves the
    next step as a delta from this one and in full (``collective.subscribe`` follows it);
    ``replace(state, step)`` serves another state at the same address, in full only;
    ``withdraw()`` stops serving the state but keeps the address."""

    def __init__(self, handler: SnapshotHandler, endpoint, address: str, step: int, keep: list,
                 shm_server=None, name: str = "", *, serving: Serving | None = None, copy: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self._endpoint = endpoint
        self._serving = serving or Serving(handler, step)
        self._copy, self._chunk_bytes = copy, chunk_bytes
        self.address, self.name = address, name
        self.step = step
        self.manifest_digest = handler.plan.manifest_digest
        self.total_bytes = handler.plan.total_bytes
        self._base = keep[3] if copy and len(keep) > 3 else None  # the served copy: the next delta's baseline
        self._lock = threading.Lock()
        self._closed = False
        self._updating: threading.Thread | None = None
        self._update_error: BaseException | None = None
        self._latest = step
        self._retirers: list[threading.Thread] = []
        self.last_update: dict = {}

    @property
    def _handler(self) -> SnapshotHandler:
        return self._serving.current

    def withdraw(self, grace: float = CLOSE_GRACE) -> None:
        """Stop serving this state (fetches in progress get up to ``grace`` s; then a fetch is
        refused: "publishes nothing now") but keep listening at ``address``; the caller may
        change its tensors once this returns. ``replace`` serves again."""
        self.wait()
        with self._lock:
            if self._closed:
                raise UsageError(f"publication at {self.address} is closed")
            self._withdraw(grace)

    def _withdraw(self, grace: float) -> None:
        """(Lock held.) Refuse the current state and its delta, then let them go."""
        s = self._serving
        for h in [h for h in (s.current, s.delta, *s.retiring) if h is not None and h.keep]:
            if not _retire(h, grace):
                log.warning("publication of step %d at %s: fetches still in progress after %g s are cut",
                            self.step, self.address, grace)
        s.delta = s.delta_base = None
        self._base = None

    def replace(self, state: Mapping, step: int, grace: float = CLOSE_GRACE) -> None:
        """Serve ``state`` at ``step`` instead, at the same address (the listening socket stays
        open: fetchers keep the address across steps), in full only (no delta: a subscriber
        fetches it whole). The old state is withdrawn first (fetches of it in progress get up
        to ``grace`` s); ``copy``, ``chunk_bytes`` and ``name`` are those of ``publish``."""
        _check_step(step)
        self.wait()
        with self._lock:
            if self._closed:
                raise UsageError(f"publication at {self.address} is closed")
            self._withdraw(grace)
            handler, keep, _shm = _state_served(state, step, self._copy, self._chunk_bytes, self.name)
            self._serving.swap(handler, step)
            self._serving.retired(self._serving.retiring[:])
            self._base = keep[3] if self._copy else None
            self.step, self.manifest_digest, self.total_bytes = step, handler.plan.manifest_digest, handler.plan.total_bytes
            self._latest = step
        log.info("publishing step %d (%d bytes, manifest %s) at %s, in place of the last", step,
                 self.total_bytes, self.manifest_digest, self.address)

    def update(self, state: Mapping, step: int, *, wait: bool = False) -> None:
        """Serve ``state`` as step ``step``: to subscribers as its element-level delta from the
        step served now (``collective.delta``: tensors that did not change cost nothing, a
        changed one goes as its changed elements or whole, the skeleton's JSON whole), and in
        full to anyone else (``collective.fetch``, a subscriber that is behind).

        Returns once ``state``'s bytes are copied (the caller may change its tensors at once);
        the delta and the digests are made on the publication's update thread, then the step is
        served (``step`` and ``manifest_digest`` change then; ``wait()`` waits for it, as
        ``wait=True`` does). One update at a time: a second waits for the first to be served.
        Needs ``publish(copy=True)``: the step served is the baseline the delta is made from.
        A state whose tensors differ in name, shape or dtype is served in full only."""
        _check_step(step)
        if not self._copy:
            raise UsageError("Publication.update needs a publication that holds its own copy: "
                             "publish(state, step=..., copy=True)")
        self.wait()
        with self._lock:
            if self._closed:
                raise UsageError(f"publication at {self.address} is closed")
            if step <= self._latest:
                raise UsageError(f"update(step={step}): steps must increase; step {self._latest} is served")
            started = time.monotonic()
            copied = versions.copy_state(state, step)
            self._latest = step
            self._updating = threading.Thread(target=self._finish, args=(copied, started), name="publish-update",
                                              daemon=True)
            self._updating.start()
        if wait:
            self.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Until the last ``update`` is served; its error, if it failed."""
        t = self._updating
        if t is not None:
            t.join(timeout)
        err, self._update_error = self._update_error, None
        if err is not None:
            raise err

    def _finish(self, copied: versions.Copied, started: float) -> None:
        """(Update thread.) The delta from the step served, the digests, the plans; then swap."""
        try:
            made = time.monotonic()
            base, chunk = self._base, self._chunk_bytes
            delta_handler = None
            if base is not None and versions.same_layout(base, copied):
                names, blobs = versions.deltas_between(base, copied, chunk)
            else:
                names, blobs = None, None
                versions.hash_all(copied, chunk)
            made = time.monotonic() - made
            plan, arena, keep = plan_of(copied, chunk, self.name)
            keep.append(copied)
            handler, keep, _shm = _served(plan, arena, keep, chunk)
            if names is not None:
                tree_view = versions.views(copied)[-1]
                doc = versions.delta_state(base.step, self.manifest_digest, copied.step, plan.manifest_digest,
                                           names, blobs, tree_view)
                delta_handler, _k, _s = _state_served(doc, copied.step, True, _delta_chunk_bytes(chunk, blobs),
                                                      self.name, base=base.step)
            with self._lock:
                if self._closed:
                    for h in (handler, delta_handler):
                        if h is not None:
                            _release(h.keep, h.shm)
                    return
                old = self._serving.swap(handler, copied.step, delta_handler, base.step if delta_handler else None)
                self._base = copied
                self.step, self.manifest_digest, self.total_bytes = copied.step, plan.manifest_digest, plan.total_bytes
                self.last_update = {
                    "step": copied.step, "delta_bytes": delta_handler.plan.total_bytes if delta_handler else None,
                    "changed_tensors": len(names) if names is not None else None, "delta_seconds": made,
                    "seconds": time.monotonic() - started}
                t = threading.Thread(target=self._retire_all, args=(old,), name="publish-retire", daemon=True)
                self._retirers = [r for r in self._retirers if r.is_alive()] + [t]
                t.start()
            log.info("publishing step %d (%d bytes, manifest %s) at %s: %s in %.3f s", copied.step, plan.total_bytes,
                     plan.manifest_digest, self.address,
                     f"{len(names)} tensor(s) changed, delta of {delta_handler.plan.total_bytes} bytes"
                     if delta_handler else "in full (no delta: the first step, or the tensors changed shape)",
                     self.last_update["seconds"])
        except BaseException as exc:  # noqa: BLE001 - kept for wait() / the next update
            log.error("publication at %s: step %d was not served: %s", self.address, copied.step, exc)
            self._update_error = exc

    def _retire_all(self, handlers: list[SnapshotHandler]) -> None:
        for h in handlers:
            if h.keep:
                _retire(h, CLOSE_GRACE)
        self._serving.retired(handlers)

    def stats(self) -> dict[str, int]:
        return {"bytes_served": self._serving.bytes_served(), "streams_served": self._handler.streams_served}

    def close(self, grace: float = CLOSE_GRACE) -> None:
        self.wait_quietly()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._serving.end()
            self._withdraw(grace)
        self._endpoint.stop(0.5)

    def wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - logged by the update thread already
            pass

    def __enter__(self) -> Publication:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"Publication(step={self.step}, address={self.address!r}, {self.total_bytes} bytes, {state})"


def _delta_chunk_bytes(chunk_bytes: int, blobs: list[bytes]) -> int:
    """A delta's chunk size: the state's, or larger where the delta is cut finer than a fetch
    takes (a state of 4 KiB chunks whose delta is 100 MB)."""
    total = sum(len(b) for b in blobs) + 4096
    while snapshot_chunking_refused(total, chunk_bytes) is not None and chunk_bytes < MAX_CHUNK_BYTES:
        chunk_bytes = min(chunk_bytes * 2, MAX_CHUNK_BYTES)
    return chunk_bytes


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
    _check_step(step)
    chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise UsageError(f"chunk_bytes={chunk_bytes}: use 1..{MAX_CHUNK_BYTES}")
    name = holder_name(name)
    started = time.monotonic()
    handler, keep, shm_server = _state_served(state, step, copy, chunk_bytes, name)
    plan, serving = handler.plan, Serving(handler, step)
    try:
        endpoint, address = serve(serving, bind=bind, advertise=advertise, token=token, tls=tls)
    except BaseException:
        _release(keep, shm_server)
        raise
    log.info("publishing step %d (%d tensors, %d bytes, manifest %s) at %s, %s, in %.2f s", step,
             len(plan.variables) - 1, plan.total_bytes, plan.manifest_digest, address,
             "copied" if copy else "served in place", time.monotonic() - started)
    return Publication(handler, endpoint, address, step, keep, shm_server, name, serving=serving, copy=copy,
                       chunk_bytes=chunk_bytes)


def serve(serving: Serving, *, bind: str, advertise: str | None, token: str | None, tls) -> tuple[object, str]:
    """A holder's endpoint serving ``serving`` (a publication's, or a subscription's that
    serves what it holds): (endpoint, the address others dial)."""
    from collective.transport.grpc import GrpcEndpoint

    endpoint = GrpcEndpoint(bind, token=cluster_token(token), name="holder", tls=tls)
    bound = endpoint.start(plan_server(serving))
    host = advertise or bound.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()  # what another host can dial; advertise= overrides it
    return endpoint, f"[{host}]:{endpoint.port}" if ":" in host else f"{host}:{endpoint.port}"


def held_handler(plan: pb.Plan, arrays: Mapping[str, np.ndarray], name: str, base: int | None = None) -> SnapshotHandler:
    """A handler serving a plan another holder made (a step or a delta a subscriber holds,
    verified) from ``arrays`` (every variable by name, the skeleton too) where they are: the
    same chunks and digests, under this holder's name, without the other's same-host copy."""
    served = pb.Plan()
    served.CopyFrom(plan)
    served.shm_socket = served.shm_secret = ""
    step = int(plan.model.removeprefix(MODEL_PREFIX).partition(HOLDER_SEP)[0].partition(versions.DELTA_LABEL)[0])
    served.model = model_label(step, name, base)
    view = ScatterView([(v.offset, arrays[v.name]) for v in plan.variables], plan.total_bytes)
    handler = SnapshotHandler(served, view)
    handler.keep, handler.shm = [arrays, None, None], None
    return handler


def _check_step(step) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"step must be an integer >= 0, not {step!r}")
