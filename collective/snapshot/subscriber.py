"""``subscribe``: follow a publication step by step, each step applied in place and verified.

1. ``subscribe`` fetches the newest step the holders serve, in full (``fetch``: striped, every
   chunk and variable verified), into the caller's ``into`` arrays or its own.
2. A follower thread asks a holder for a step past the one it has (GetPlan with
   ``newer_than``: a long poll). For each new step N it fetches N's delta from the step it will
   hold (GetPlan and the stream with ``delta_from``; the delta is a publication of its own,
   striped over the holders, every chunk verified), checks it names that base's manifest and
   N's, and parses every tensor's delta against the arrays it will be applied to
   (``collective.delta.parse_delta``: sizes from the receiver, never from the sender; nothing
   written yet). A holder with no delta from that step (the subscriber is behind, or the
   tensors changed shape) gets N fetched in full, off to the side.
3. ``apply()``, called by the caller between uses (or by the follower itself with
   ``auto=True``, under ``lock``), writes the waiting steps in place, then verifies: every chunk
   a delta touched has step N's chunk digest (hashed from the arrays where they are), every
   chunk it did not touch has the same digest in N's plan as in the step before (whose chunks
   were verified), so the state matches N's chunk digests, and so N's manifest, without a
   second pass over unchanged bytes. A mismatch is never kept: the step is fetched whole into
   the arrays, and the holders that sent the delta are named and no longer asked for deltas.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.delta import apply_delta, mismatched_chunks, parse_delta, state_touched_chunks
from collective.limits import MAX_SNAPSHOT_PLAN_BYTES
from collective.snapshot import tree
from collective.snapshot.fetcher import Fetched, _sources, fetch_step, plan_step
from collective.snapshot.holder import (
    CLOSE_GRACE,
    Serving,
    cluster_token,
    held_handler,
    holder_name,
    serve,
)
from collective.snapshot.stripes import MAX_ACTIVE_HOLDERS, one_line

log = logging.getLogger(__name__)

POLL_SECONDS = 10.0
"""How long one long poll (GetPlan with ``newer_than``) waits for a new step before asking again."""
CUT_SECONDS = 2.0
"""How long ``apply`` waits for streams of the step it replaces (a serving subscription) to end."""
RETRY_SECONDS = 1.0
"""Between two tries when no holder answers (the publisher restarting, say)."""


class _Step:
    """A step received and checked, waiting to be applied: its full plan, and either its
    parsed deltas (``kind`` "delta") or its fetched arrays (``kind`` "full")."""

    def __init__(self, kind: str, plan: pb.Plan, *, deltas=None, tree_bytes=None, arrays=None,
                 senders: str = "", nbytes: int = 0, seconds: float = 0.0, doc: Fetched | None = None) -> None:
        self.kind, self.plan, self.deltas, self.tree_bytes, self.arrays = kind, plan, deltas, tree_bytes, arrays
        self.doc = doc  # the delta as fetched (its plan and arrays): what a serving subscriber serves on
        self.senders, self.nbytes, self.seconds = senders, nbytes, seconds
        self.step = plan_step(plan)


class Subscription:
    """Follows a publication (``subscribe``). ``step``, ``manifest_digest``: what the arrays
    hold, verified. ``state``: the state (tensor leaves: the ``into`` arrays or the
    subscription's own, updated in place). ``poll()``: the newest step waiting; ``apply()``:
    apply it. ``lock``: held while a step is applied (a caller that holds it around a use is
    never handed half a step, with ``auto=True`` too). ``stats``: the last applied step's kind,
    bytes received, seconds. ``close()``; a context manager."""

    def __init__(self, sources: list[str], first: Fetched, *, token, tls, timeout: float,
                 stall_timeout: float, into: Mapping | None, auto: bool, shm: bool = True,
                 stripe: bool = True, serving: dict | None = None) -> None:
        self.sources, self._token, self._tls = sources, token, tls
        self._timeout, self._stall = timeout, stall_timeout
        self._into = into is not None
        self._plan = first.plan
        self._arrays = dict(first.arrays)
        self._arrays[tree.TREE] = np.array(first.arrays[tree.TREE], copy=True)
        self.state = dict(first)
        self.step, self.manifest_digest = first.step, first.manifest_digest
        self.stats: dict = {"kind": "full", "bytes": first.total_bytes, "step": first.step}
        self.lock = threading.RLock()
        self._cond = threading.Condition()
        self._pending: list[_Step] = []
        self._error: E.CollectiveError | None = None
        self._distrusted: set[str] = set()
        self._closed = False
        self._auto = auto
        self._said_lost = False
        self._link = None
        self._shm = shm
        self._active = MAX_ACTIVE_HOLDERS if stripe else 1
        self.refusals: list[str] = []  # the deltas refused (one line each, naming the holders)
        self.address: str | None = None
        self._served: Serving | None = None
        if serving is not None:  # serve what it holds: the step, and the delta that led to it
            self._name = holder_name(serving.get("name"))
            self._served = Serving(held_handler(self._plan, self._arrays, self._name), self.step)
            self._endpoint, self.address = serve(self._served, bind=serving.get("bind", "0.0.0.0:0"),
                                                 advertise=serving.get("advertise"), token=token,
                                                 tls=serving.get("tls"))
            log.info("subscription serves step %d at %s", self.step, self.address)
        self._thread = threading.Thread(target=self._follow, name="subscribe", daemon=True)
        self._thread.start()

    # --- the caller's side ---------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> int | None:
        """The newest step received, checked and waiting to be applied, or None (none within
        ``timeout`` s)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed, timeout=max(0.0, timeout))
            return self._pending[-1].step if self._pending else None

    def apply(self, timeout: float = 0.0) -> int | None:
        """Apply the waiting steps in place (call it between uses of the arrays), verify the
        result, and return the step now held; None if no step arrived within ``timeout`` s.
        Raises what the follower could not get past (a holder's refusal, an ``into`` array of
        another shape); the arrays then hold the last verified step."""
        if self.poll(timeout) is None:
            self._raise_error()
            return None
        with self.lock:
            with self._cond:
                todo, self._pending = self._pending, []
            for s in todo:
                self._apply_one(s)
            self._cond_notify()
        return self.step

    def follow(self, sources: str | Sequence[str]) -> None:
        """Follow the holders at ``sources`` from now on (a successor at another address)."""
        self.sources = _sources(sources)
        link, self._link = self._link, None
        if link is not None:
            link.close()

    def verify(self) -> None:
        """A pass over the whole state: every chunk against the step's digests; a chunk that
        differs (a local corruption) is repaired by fetching the step again, in place."""
        with self.lock:
            plan = self._plan
            order = [self._arrays[v.name] for v in plan.variables]
            bad = mismatched_chunks(order, plan.chunk_bytes, range(len(plan.chunk_digests)), plan.chunk_digests,
                                    offsets=[v.offset for v in plan.variables], total=plan.total_bytes)
            if bad:
                log.warning("subscribe: %d chunk(s) of step %d differ from its digests here (first: %d); "
                            "fetching the step again", len(bad), self.step, bad[0])
                self._refetch(plan, f"{len(bad)} local chunk(s) differed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        link = self._link
        if link is not None:
            link.close(0.1)
        self._thread.join(POLL_SECONDS + 5)
        if self._served is not None:
            self._served.end()
            self._served.current.cut(CUT_SECONDS)
            self._endpoint.stop(0.5)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Subscription(step={self.step}, manifest={self.manifest_digest!r}, sources={self.sources!r})"

    # --- applying ----------------------------------------------------------------------------------

    def _raise_error(self) -> None:
        with self._cond:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _cond_notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _apply_one(self, s: _Step) -> None:
        started, kind = time.monotonic(), s.kind
        if self._served is not None:  # its arrays are about to change: no stream may read them now
            if not self._served.current.cut(CUT_SECONDS):
                log.warning("subscribe: a stream of step %d from this subscription was still in progress "
                            "after %g s; its reader may see the next step's bytes (and drop this holder)",
                            self.step, CUT_SECONDS)
        if s.kind == "full":
            self._take_full(s.plan, s.arrays)
        else:
            old = self._plan
            names = [v.name for v in s.plan.variables]
            for name, d in s.deltas:
                apply_delta(self._arrays[name], d, name=name)
            self._arrays[tree.TREE] = s.tree_bytes
            bad = self._unverified(old, s)
            if bad:
                said = (f"step {s.step}'s delta from {s.senders} did not reproduce {len(bad)} chunk(s) of the "
                        f"step's digests (first: chunk {bad[0]})")
                log.warning("subscribe: %s; those holders are no longer asked for deltas, and the step is "
                            "fetched whole", said)
                self.refusals.append(said)
                self._distrusted.update(a.strip() for a in s.senders.split(","))
                self._refetch(s.plan, f"the delta from {s.senders} did not verify")
                kind = "full"
            else:
                self._plan = s.plan
                self._rebuild(names)
        self.step, self.manifest_digest = s.step, s.plan.manifest_digest
        if self._served is not None:
            self._serve_held(s if kind == "delta" else None)
        self.stats = {"kind": kind, "step": s.step, "bytes": s.nbytes, "receive_seconds": s.seconds,
                      "apply_seconds": time.monotonic() - started}

    def _serve_held(self, s: _Step | None) -> None:
        """Serve the step now held (its arrays, in place) and, for a delta ``s``, that delta (its
        verified bytes as fetched): a subscriber that follows this one takes it from here."""
        full = held_handler(self._plan, self._arrays, self._name)
        delta = base = None
        if s is not None and s.doc is not None:
            delta, base = held_handler(s.doc.plan, s.doc.arrays, self._name, s.doc["from"]), s.doc["from"]
        old = self._served.swap(full, self.step, delta, base)
        threading.Thread(target=self._retire, args=(old,), name="subscribe-retire", daemon=True).start()

    def _retire(self, handlers: list) -> None:
        for h in handlers:
            h.close(CLOSE_GRACE)
        self._served.retired(handlers)

    def _unverified(self, old: pb.Plan, s: _Step) -> list[int]:
        """The chunks of step ``s`` (applied) whose bytes here are not its digests: those a
        delta touched, hashed; the others' digests must be the same in both plans."""
        plan, size = s.plan, s.plan.chunk_bytes
        offsets = [v.offset for v in plan.variables]
        touched = set(state_touched_chunks([d for _, d in s.deltas], [self._offset(plan, n) for n, _ in s.deltas],
                                           size).tolist())
        tail = min(plan.variables[-1].offset, old.variables[-1].offset) // size  # the skeleton's chunks
        count = len(plan.chunk_digests)
        touched.update(range(tail, count))
        bad = [c for c in range(count) if c not in touched
               and (c >= len(old.chunk_digests) or old.chunk_digests[c] != plan.chunk_digests[c])]
        check = sorted(touched)
        order = [self._arrays[v.name] for v in plan.variables]
        bad += mismatched_chunks(order, size, check, [plan.chunk_digests[c] for c in check], offsets=offsets,
                                 total=plan.total_bytes)
        return sorted(bad)

    @staticmethod
    def _offset(plan: pb.Plan, name: str) -> int:
        for v in plan.variables:
            if v.name == name:
                return v.offset
        raise E.ProtocolError(f"the plan has no tensor {name!r}")

    def _take_full(self, plan: pb.Plan, arrays: dict) -> None:
        """A step fetched whole: copied into the arrays held (same tensors), or held instead
        (no ``into``, tensors of other shapes)."""
        same = [(v.name, v.shape[:], v.dtype) for v in plan.variables[:-1]] == \
            [(v.name, v.shape[:], v.dtype) for v in self._plan.variables[:-1]]
        if same:
            for v in plan.variables[:-1]:
                np.copyto(self._arrays[v.name], arrays[v.name], casting="no")
        elif self._into:
            raise E.UsageError(f"step {plan_step(plan)} has tensors of other names, shapes or dtypes than the "
                               f"into arrays; subscribe again")
        else:
            self._arrays = dict(arrays)
        self._arrays[tree.TREE] = np.array(arrays[tree.TREE], copy=True)
        self._plan = plan
        self._rebuild([v.name for v in plan.variables])

    def _refetch(self, plan: pb.Plan, why: str) -> None:
        """Step ``plan`` fetched whole into the arrays held (in place), from holders other than
        those distrusted where there are others."""
        sources = [a for a in self.sources if a not in self._distrusted] or self.sources
        into = {v.name: self._arrays[v.name] for v in plan.variables[:-1]}
        got = fetch_step(sources, step=plan_step(plan), token=self._token, tls=self._tls, timeout=self._timeout,
                         stall_timeout=self._stall, into=into, manifest=plan.manifest_digest, shm=self._shm)
        self._take_full(got.plan, got.arrays)
        log.info("subscribe: step %d fetched whole (%s) and verified", plan_step(plan), why)

    def _rebuild(self, names: list[str]) -> None:
        skeleton = tree.decode(self._arrays[tree.TREE], plan_step(self._plan), "this subscription")
        self.state = tree.unflatten(skeleton, {n: self._arrays[n] for n in names}, "this subscription")

    # --- the follower thread ------------------------------------------------------------------------

    def _follow(self) -> None:
        while not self._closed:
            try:
                self._next()
            except E.CollectiveError as exc:
                if self._closed:
                    return
                self._lost(exc)
            except Exception as exc:  # noqa: BLE001 - the follower must not die silently
                log.exception("subscribe: the follower failed")
                with self._cond:
                    self._error = E.CollectiveError(f"subscribe: the follower failed: {type(exc).__name__}: {exc}")
                    self._cond.notify_all()
                return

    def _lost(self, exc: E.CollectiveError) -> None:
        """No holder answered or one refused: keep the step held, say so once, try again."""
        if not self._said_lost:
            log.warning("subscribe: %s; holding step %d (manifest %s), trying again", one_line(exc), self.step,
                        self.manifest_digest)
            self._said_lost = True
        link, self._link = self._link, None
        if link is not None:
            link.close(0.1)
        with self._cond:
            self._cond.wait_for(lambda: self._closed, timeout=RETRY_SECONDS)

    def _held(self) -> tuple[int, pb.Plan]:
        """The step the arrays will hold once the waiting steps are applied, and its plan."""
        with self._cond:
            last = self._pending[-1] if self._pending else None
        return (last.step, last.plan) if last is not None else (self.step, self._plan)

    def _poll_link(self):
        from collective.transport.grpc import GrpcChiefLink

        if self._link is None:
            address = self.sources[0] if len(self.sources) == 1 else self._answering()
            self._link = GrpcChiefLink(address, token=self._token, name="holder", tls=self._tls)
        return self._link

    def _answering(self) -> str:
        """The first source that answers a plain GetPlan (the others are asked for deltas too)."""
        from collective.transport.grpc import GrpcChiefLink

        last: E.CollectiveError | None = None
        for address in self.sources:
            link = GrpcChiefLink(address, token=self._token, name="holder", tls=self._tls)
            try:
                link.get_plan(pb.WorkerRef(worker_id="subscribe"), min(self._stall, 5.0), phase="subscribe",
                              max_bytes=MAX_SNAPSHOT_PLAN_BYTES)
                return address
            except E.CollectiveError as exc:
                last = exc
            finally:
                link.close(0.1)
        raise last or E.FetchError("no holder to follow")

    def _next(self) -> None:
        """One long poll; a new step received and checked, or nothing."""
        held, held_plan = self._held()
        link = self._poll_link()
        ref = pb.WorkerRef(worker_id="subscribe", newer_than=held)
        plan = link.get_plan(ref, POLL_SECONDS + 5.0, phase="subscribe (waiting for the next step)",
                             max_bytes=MAX_SNAPSHOT_PLAN_BYTES)
        if self._said_lost:
            log.info("subscribe: %s answers again (step %d)", link.address, plan_step(plan))
            self._said_lost = False
        step = plan_step(plan)
        if step <= held or self._closed:
            return
        started = time.monotonic()
        s = self._delta(held, held_plan, plan, started)
        if s is None:
            got = fetch_step(self.sources, step=step, token=self._token, tls=self._tls, timeout=self._timeout,
                             stall_timeout=self._stall, manifest=plan.manifest_digest, shm=self._shm,
                             active=self._active)
            s = _Step("full", got.plan, arrays=got.arrays, senders=", ".join(got.stats), nbytes=got.total_bytes,
                      seconds=time.monotonic() - started)
        with self._cond:
            if s.kind == "full":
                self._pending = [s]
            else:
                self._pending.append(s)
            self._cond.notify_all()
        if self._auto:
            self.apply()

    def _delta(self, held: int, held_plan: pb.Plan, plan: pb.Plan, started: float) -> _Step | None:
        """Step ``plan``'s delta from ``held``, fetched, checked and parsed; None where the
        holders have none from that step (then the step is fetched whole)."""
        sources = [a for a in self.sources if a not in self._distrusted]
        if not sources:
            return None
        # A delta is at most each tensor whole plus its header, and the skeleton.
        limit = held_plan.total_bytes + 64 * len(held_plan.variables) + tree.MAX_TREE_BYTES + (1 << 20)
        try:
            doc = fetch_step(sources, step=plan_step(plan), delta_from=held, token=self._token, tls=self._tls,
                             timeout=self._timeout, stall_timeout=self._stall, max_bytes=limit, shm=self._shm,
                             active=self._active)
        except (E.PreconditionError, E.FetchError) as exc:
            log.info("subscribe: step %d as a whole, not a delta (%s)", plan_step(plan), one_line(exc))
            return None
        senders = ", ".join(doc.stats)
        try:
            deltas, tree_bytes = check_delta(doc, held, held_plan, plan, senders)
        except E.ProtocolError as exc:
            log.warning("subscribe: %s; those holders are no longer asked for deltas", exc)
            self.refusals.append(str(exc))
            self._distrusted.update(doc.stats)
            return None
        return _Step("delta", plan, deltas=deltas, tree_bytes=tree_bytes, senders=senders, nbytes=doc.total_bytes,
                     seconds=time.monotonic() - started, doc=doc)


def check_delta(doc: Mapping, held: int, held_plan: pb.Plan, plan: pb.Plan, senders: str) -> tuple[list, np.ndarray]:
    """The parsed deltas (name, Delta) of the delta document ``doc`` (``versions.delta_state``),
    checked against the step held and the new step's plan before anything is written:
    ProtocolError naming ``senders`` for a delta of another base or step, a tensor named twice
    or unknown, a delta that does not parse against the tensor it names."""
    def refuse(why: str) -> E.ProtocolError:
        return E.ProtocolError(f"{senders} sent a delta for step {plan_step(plan)} that {why}; refused, nothing written")

    keys = {"from", "to", "base", "manifest", "names", "deltas", "tree"}
    if not isinstance(doc, Mapping) or set(doc) != keys:
        raise refuse("is not a delta document")
    if doc["from"] != held or doc["base"] != held_plan.manifest_digest:
        raise refuse(f"is from step {doc['from']!r} (manifest {str(doc['base'])[:40]!r}), not from the step held "
                     f"here, {held} (manifest {held_plan.manifest_digest})")
    if doc["to"] != plan_step(plan) or doc["manifest"] != plan.manifest_digest:
        raise refuse(f"leads to step {doc['to']!r} (manifest {str(doc['manifest'])[:40]!r}), not to the step's "
                     f"manifest {plan.manifest_digest}")
    names, blobs, tree_bytes = doc["names"], doc["deltas"], doc["tree"]
    if not (isinstance(names, list) and isinstance(blobs, list) and len(names) == len(blobs)
            and all(isinstance(n, str) for n in names) and isinstance(tree_bytes, np.ndarray)):
        raise refuse("does not list its tensors and their deltas one for one")
    held_vars = {v.name: v for v in held_plan.variables[:-1]}
    new_vars = {v.name: v for v in plan.variables[:-1]}
    if len(set(names)) != len(names):
        raise refuse("names a tensor twice")
    if [(v.name, v.shape[:], v.dtype) for v in held_plan.variables[:-1]] != \
            [(v.name, v.shape[:], v.dtype) for v in plan.variables[:-1]]:
        raise refuse("changes the tensors' names, shapes or dtypes (a delta cannot)")
    parsed = []
    for name, blob in zip(names, blobs, strict=True):
        v = held_vars.get(name)
        if v is None or name not in new_vars:
            raise refuse(f"names a tensor {name[:80]!r} the state does not have")
        if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8:
            raise refuse(f"carries no bytes for {name[:80]!r}")
        from collective import dtypes

        itemsize = np.dtype(dtypes.from_wire(v.dtype)).itemsize
        size = int(np.prod(v.shape, dtype=np.int64)) if len(v.shape) else 1
        try:
            parsed.append((name, parse_delta(blob, size=size, itemsize=itemsize, name=name)))
        except E.ProtocolError as exc:
            raise refuse(f"does not parse: {exc}") from None
    new_tree = plan.variables[-1]
    if tree_bytes.dtype != np.uint8 or tree_bytes.ndim != 1 or tree_bytes.nbytes != new_tree.nbytes:
        raise refuse("carries a skeleton of another size than the step's plan")
    return parsed, np.array(tree_bytes, copy=True)


def subscribe(sources: str | Sequence[str], *, token: str | None = None, into: Mapping[str, np.ndarray] | None = None,
              timeout: float = 300.0, stall_timeout: float = 30.0, tls=None, auto: bool = False,
              shm: bool = True, stripe: bool = True, serve: bool = False, bind: str = "0.0.0.0:0",
              advertise: str | None = None, name: str | None = None, serve_tls=None) -> Subscription:
    """Follow the publication at ``sources`` (``publish`` then ``Publication.update``): its
    newest step fetched in full before this returns, then each new step received as its delta,
    checked off to the side, applied in place by ``apply()`` and verified.

    :param sources: one ``host:port`` (or several, comma-separated) or a sequence: holders of
        the publication (its publisher; ``fetch``'s striping and dropping apply to every step).
    :param token: the cluster token (default ``COLLECTIVE_TOKEN``).
    :param into: name -> writable C-contiguous numpy arrays of the tensors' shapes and dtypes:
        every step is applied into them, in place (a torch module's parameters through
        ``collective.torch.subscribe``). Default: the subscription's own arrays.
    :param timeout: seconds for the first fetch and for each step's.
    :param stall_timeout: seconds a holder may send nothing before it counts as lost.
    :param tls: ``TlsFiles`` as for ``fetch``.
    :param auto: apply each step as soon as it is received and checked (under ``lock``), not
        at ``apply()``.
    :param shm: map a same-host holder's sealed copy of a step or delta instead of receiving
        its stream (every chunk still checked); False: always the stream.
    :param stripe: True: each step striped over every holder of it (as ``fetch``); False: taken
        from the first of ``sources`` that serves it, the others spares (a tree of subscribers:
        the parent first, the publisher after it).
    :param serve: serve what this subscription holds (each step it applied, and the delta that
        led to it) at ``address``, so subscribers that list it take the step from here and the
        publisher's link carries each delta about once (``bind``, ``advertise``, ``name`` and
        ``serve_tls`` as ``publish``'s). A step is served once it is applied (``auto=True``:
        as soon as it arrives).
    :return: the ``Subscription``.
    """
    addresses = _sources(sources)
    if not (timeout > 0 and stall_timeout > 0):
        raise E.UsageError("timeout and stall_timeout must be > 0 seconds")
    token = cluster_token(token)
    first = fetch_step(addresses, step=None, token=token, tls=tls, timeout=timeout, stall_timeout=stall_timeout,
                       into=dict(into) if into is not None else None, shm=shm,
                       active=MAX_ACTIVE_HOLDERS if stripe else 1)
    log.info("subscribed to %s at step %d (manifest %s)", ", ".join(addresses), first.step, first.manifest_digest)
    serving = {"bind": bind, "advertise": advertise, "name": name, "tls": serve_tls} if serve else None
    return Subscription(addresses, first, token=token, tls=tls, timeout=timeout, stall_timeout=stall_timeout,
                        into=into, auto=auto, shm=shm, stripe=stripe, serving=serving)
