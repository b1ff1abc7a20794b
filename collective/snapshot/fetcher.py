"""``fetch``: a published state from one or several holders, striped, every chunk verified.

1. The holders are asked for their plans (GetPlan, in pieces, counted as they arrive, at most
   ``limits.MAX_SNAPSHOT_PLAN_BYTES``) in order, in waves of at most ``MAX_ACTIVE_HOLDERS``
   threads, until a wave has one that answered; the sources not asked are spares. A plan is checked before anything is allocated:
   ``validate_plan``, complete (no ``digests_follow``), not cut finer than the chunk floor
   (``limits.snapshot_chunking_refused``), its step (``Plan.model``), its size against
   ``max_bytes``, its skeleton variable's size. The holders of the requested step whose
   manifest digests agree are used together (those of one layout: the same chunks); holders
   that disagree fail the fetch, naming both sides (one of them lies, and digests alone cannot
   say which).
2. A holder on this host that offers its sealed copy (``publish(copy=True)``) is mapped instead,
   every chunk of the mapping checked against the plan. Otherwise the arena's chunks are cut
   into stripes, taken in turn by one thread per holder: each stripe is one data stream
   (``WorkerRef.resume_from`` .. ``stop_at``) received in place by a ``Receiver`` of that span
   (its pages put in place just before: the arena is committed a stripe at a time), so every
   chunk is checked against the plan's digest as it lands. A holder whose stream breaks, is
   silent for ``stall_timeout``, verifies no chunk for ``stall_timeout`` while another holder
   or a spare is left, or sends bytes that differ from its plan is dropped; what it had not
   delivered goes back to the queue for the others, and its thread goes on with a spare.
3. Every variable's bytes are checked against its own digest (the manifest's), the skeleton
   variable is decoded (JSON only) and the state rebuilt: tensor leaves are numpy views of the
   one received arena, or the caller's ``into`` arrays.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from collective import dtypes
from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.arena import lazy_arena, warm
from collective.digest import bytes_digest, chunk_digests
from collective.limits import (
    MAX_HOLDER_NAME_CHARS,
    MAX_SNAPSHOT_PLAN_BYTES,
    snapshot_chunking_refused,
)
from collective.logs import printable
from collective.model import quoted
from collective.plan import align, validate_plan
from collective.replicas import variable_view
from collective.sizes import format_bytes
from collective.snapshot import tree
from collective.snapshot.holder import HOLDER_SEP, MODEL_PREFIX, cluster_token
from collective.stream import Receiver, differing_chunk, frame_table, overlapping

log = logging.getLogger(__name__)

STRIPE_BYTES = 64 << 20
"""At most this much in one stripe: a lost holder's share is retaken in pieces this size. The
arena's pages are put in place a stripe at a time, as each is asked for: a fetch commits at most
``MAX_ACTIVE_HOLDERS`` stripes of memory ahead of the bytes that arrived."""
MAX_ACTIVE_HOLDERS = 8
"""At most this many holders serve one fetch at once, one thread each; the other sources are
spares, asked for their plan only when a holder is dropped, to retake its share."""
_REF = "fetch"  # who a fetch says it is (its worker id); under mutual TLS, its certificate's name


def _identity(tls) -> str:
    """The worker id a fetch presents: its certificate's common name under mutual TLS (the
    holder admits only a caller its certificate names), else ``fetch``."""
    if tls is None or not tls.mutual:
        return _REF
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(tls.read("cert"))
    except ValueError as exc:
        raise E.UsageError(f"tls cert {tls.cert or '(in memory)'}: not a PEM certificate ({exc})") from None
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else _REF


class Fetched(dict):
    """The fetched state (a dict, as published), with ``step``, ``manifest_digest``,
    ``total_bytes`` (the arena's) and ``stats``: holder address -> bytes it delivered, stripes,
    and why it was dropped (if it was)."""

    step: int
    manifest_digest: str
    total_bytes: int
    stats: dict


class _Holder:
    def __init__(self, address: str, connect) -> None:
        self.address, self._connect, self._link = address, connect, None
        self.plan: pb.Plan | None = None
        self.bytes = 0
        self.stripes = 0
        self.shared = False  # its sealed copy was mapped (same host), not streamed
        self.dropped: str | None = None
        self.label = ""  # its name (publish(name=)), from its plan: printable, bounded

    @property
    def link(self):
        """Its channel, opened when first used (a spare never asked opens none)."""
        if self._link is None:
            self._link = self._connect(self.address)
        return self._link

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def name(self) -> str:
        return f"holder {self.label} at {self.address}" if self.label else f"holder at {self.address}"

    def named(self, label: str) -> None:
        """Go by ``label`` (the holder's own choice: escaped, cut) here and in its link's errors."""
        self.label = printable(label, MAX_HOLDER_NAME_CHARS)
        self.link.name = f"holder {self.label}" if self.label else "holder"


def _sources(sources: str | Sequence[str]) -> list[str]:
    items = [sources] if isinstance(sources, str) else list(sources)
    out = [a.strip() for item in items for a in str(item).split(",") if a.strip()]
    if not out:
        raise E.UsageError("fetch needs at least one holder address (host:port)")
    return list(dict.fromkeys(out))


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40


def _check_plan(h: _Holder, plan: pb.Plan, step: int, max_bytes: int) -> None:
    """The plan of holder ``h`` is one a fetch can take: consistent, of ``step``, not larger
    than ``max_bytes``, with a skeleton variable. Raises naming the holder."""
    if not plan.model.startswith(MODEL_PREFIX):
        raise E.ProtocolError(f"{h.name()} is not a publication (it serves {plan.model[:80]!r})")
    got, _, label = plan.model.removeprefix(MODEL_PREFIX).partition(HOLDER_SEP)
    h.named(label)
    if got != str(step):
        raise E.FetchError(f"{h.name()} publishes step {got[:40]}, not step {step}")
    if plan.total_bytes > max_bytes:
        raise E.ResourceExhaustedError(f"{h.name()} publishes {format_bytes(plan.total_bytes)}, more than "
                                       f"max_bytes={format_bytes(max_bytes)}; refused before allocating")
    try:
        validate_plan(plan)
    except E.ProtocolError as exc:
        raise E.ProtocolError(f"{h.name()} sent a plan that does not hold together: {exc}") from None
    if plan.digests_follow:  # a publication's plan is complete: without digests no byte could be checked
        raise E.ProtocolError(f"{h.name()} sent a plan without its digests (digests_follow); a fetch takes "
                              f"only bytes its plan's digests cover")
    refused = snapshot_chunking_refused(plan.total_bytes, plan.chunk_bytes)
    if refused is not None:
        raise E.ProtocolError(f"{h.name()} sent a plan of {refused}; refused before allocating")
    last = plan.variables[-1] if plan.variables else None
    if last is None or last.name != tree.TREE or last.dtype != "|u1" or len(last.shape) != 1:
        raise E.ProtocolError(f"{h.name()} sent a plan without its structure variable {tree.TREE!r} (bytes, last)")
    if last.nbytes > tree.MAX_TREE_BYTES:
        raise E.ProtocolError(f"{h.name()} sent a plan whose structure takes {last.nbytes} bytes, more than "
                              f"{tree.MAX_TREE_BYTES}; refused before allocating")


def _ask(h: _Holder, step: int, deadline: float, stall_timeout: float, max_bytes: int,
         ident: str) -> E.CollectiveError | None:
    """Ask ``h`` for its plan and check it (``h.plan`` set); the error that left it out, or None."""
    try:
        # A holder that does not answer within the stall timeout is left out, not waited for.
        wait = max(0.1, min(deadline - time.monotonic(), stall_timeout))
        plan = h.link.get_plan(pb.WorkerRef(worker_id=ident), wait,
                               phase="fetch (asking for its manifest)", max_bytes=MAX_SNAPSHOT_PLAN_BYTES)
        _check_plan(h, plan, step, max_bytes)
        h.plan = plan
    except E.CollectiveError as exc:
        return exc
    return None


def _ask_plans(holders: list[_Holder], step: int, deadline: float, stall_timeout: float,
               max_bytes: int, ident: str) -> tuple[list[_Holder], list[_Holder]]:
    """The holders of ``step`` that agree on its manifest, asked in order in waves of at most
    ``MAX_ACTIVE_HOLDERS`` (one thread each) until a wave has one that answered; and the
    spares, those not asked (asked when a holder is dropped)."""
    errors: dict[str, E.CollectiveError] = {}
    asked: list[_Holder] = []
    answered: list[_Holder] = []  # in the order they answered; a thread still asking is not in it

    def ask(h: _Holder) -> None:
        exc = _ask(h, step, deadline, stall_timeout, max_bytes, ident)
        if exc is not None:
            errors[h.address] = exc
        else:
            answered.append(h)

    while len(asked) < len(holders) and not answered:
        if time.monotonic() >= deadline:
            break
        wave = holders[len(asked) : len(asked) + MAX_ACTIVE_HOLDERS]
        threads = [threading.Thread(target=ask, args=(h,), name="fetch-plan", daemon=True) for h in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, min(deadline - time.monotonic(), stall_timeout)) + 1.0)
        asked.extend(wave)
        for h in wave:
            if h.address in errors:
                h.close()  # left out: its channels go now, not at the end of the fetch
    spares = holders[len(asked) :]
    ready = [h for h in asked if h in answered]
    for h in asked:
        if h not in answered and h.address not in errors:
            errors[h.address] = E.DeadlineError(f"{h.name()} did not answer with its manifest in time")
    if not ready:
        if len(errors) == 1:
            raise next(iter(errors.values()))
        said = [_one_line(e) for e in errors.values()]
        more = f"; and {len(said) - 5} more" if len(said) > 5 else ""
        raise E.FetchError(f"no holder serves step {step}: " + "; ".join(said[:5]) + more)
    for exc in errors.values():
        log.warning("fetch of step %d: %s; fetching from the other holders", step, _one_line(exc))
    groups = collections.defaultdict(list)
    for h in ready:
        groups[h.plan.manifest_digest].append(h.name())
    if len(groups) > 1:
        sides = "; ".join(f"{', '.join(a)} publish manifest {d}" for d, a in groups.items())
        raise E.FetchError(f"holders disagree on the manifest of step {step}: {sides}; compare them "
                         f"(collective.check) before trusting any")
    best = _same_layout(ready)
    return best[:MAX_ACTIVE_HOLDERS], best[MAX_ACTIVE_HOLDERS:] + spares


def _layout(plan: pb.Plan) -> str:
    """What stripes from several holders need in common beyond the manifest: the same bytes at
    the same offsets in the same chunks (``chunk_bytes`` is the publisher's choice)."""
    bare = pb.Plan()
    bare.CopyFrom(plan)
    bare.chief_incarnation = bare.shm_socket = bare.shm_secret = ""  # each holder's own
    bare.model = ""  # its name too (the step was checked apart)
    return bytes_digest(bare.SerializeToString(deterministic=True))


def _same_layout(ready: list[_Holder]) -> list[_Holder]:
    """The most holders whose plans lay the state out alike (the first such group on a tie);
    the others, of the same manifest but other chunks, are left out with a warning (their
    stripes would be checked against another plan's chunk digests, and blamed wrongly)."""
    groups = collections.defaultdict(list)
    for h in ready:
        groups[_layout(h.plan)].append(h)
    best = max(groups.values(), key=len)
    for h in ready:
        if h not in best:
            log.warning("fetch: %s publishes the same manifest in other chunks (%d-byte chunks, %d bytes); "
                        "left out, striping over %d holder(s) of one layout", h.name(), h.plan.chunk_bytes,
                        h.plan.total_bytes, len(best))
    return best


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _differing(plan: pb.Plan, buf: np.ndarray, base: int, start: int, end: int) -> str:
    """The variable whose bytes in ``start..end`` differ from its digest: the first one held
    whole in ``buf`` (bytes from ``base`` on) that does, else the first only partly held."""
    partial = None
    for v in overlapping(plan, start, end):
        lo, hi = v.offset - base, v.offset + v.nbytes - base
        if lo < 0 or hi > buf.size:
            partial = partial or v.name
        elif bytes_digest(memoryview(buf[lo:hi])) != v.digest:
            return v.name
    return partial or "the padding between variables"


class _Watch:
    """A stripe in progress: its receiver, and since when it has verified nothing more."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver, self.pos, self.since = receiver, receiver.verified_to, time.monotonic()


class _Striper:
    """The stripes of one fetch, the threads that take them (one per active holder, at most
    ``MAX_ACTIVE_HOLDERS``) and the outcome. A thread whose holder is dropped goes on with a
    spare, if one is left and its plan lays the state out alike."""

    def __init__(self, plan: pb.Plan, holders: list[_Holder], spares: list[_Holder], arena: np.ndarray | None,
                 scatter, stall_timeout: float, ident: str, ask) -> None:
        self.ident = ident
        self.plan, self.holders, self.arena, self.scatter = plan, list(holders), arena, scatter
        self.spares, self.ask, self.layout = collections.deque(spares), ask, _layout(plan)
        self.stall_timeout = stall_timeout
        self.table = frame_table(plan)  # once: every stripe's Receiver checks against it
        size, total = plan.chunk_bytes, plan.total_bytes
        chunks = -(-total // size)
        per = max(1, min(-(-chunks // (4 * len(holders))), max(1, STRIPE_BYTES // size)))
        self.queue = collections.deque(_stripes(plan, per, scatter is not None))
        # With ``into``: the largest stripe that is not received in place, the size of each
        # holder's buffer (a stripe given back is part of one, never larger).
        self.mixed_bytes = max((b - a for a, b in self.queue if scatter is not None and scatter.target(a, b) is None),
                               default=0)
        self.left = len(self.queue)
        self.cond = threading.Condition()
        self.failure: BaseException | None = None
        self.bad: list[str] = []
        self.watches: dict[_Holder, _Watch] = {}

    def run(self, deadline: float, timeout: float) -> None:
        threads = [threading.Thread(target=self._take, args=(h,), name="fetch-stripes", daemon=True)
                   for h in self.holders]
        for t in threads:
            t.start()
        while True:
            with self.cond:
                if not (self.left and self.failure is None and time.monotonic() < deadline):
                    break
                if not any(t.is_alive() for t in threads):
                    break
                self.cond.wait(min(1.0, self.stall_timeout / 4, max(0.0, deadline - time.monotonic())))
                stalled = self._stalled()
            for h in stalled:  # outside the lock: its stripe comes back through _receive
                log.warning("fetch: %s delivered no verified chunk for %g s; dropping it", h.name(), self.stall_timeout)
                h.link.interrupt(E.DeadlineError(f"{h.name()} delivered no verified chunk for "
                                                 f"{self.stall_timeout:g} s (its stripe stalled)"))
        with self.cond:
            done, failure = not self.left, self.failure
        if not done:
            why = failure or E.DeadlineError("the fetch did not complete in time")
            with self.cond:
                self.failure = self.failure or why  # the threads waiting for a stripe stop
                holders = list(self.holders)
            for h in holders:
                h.link.interrupt(why if isinstance(why, E.CollectiveError) else E.AbortedError(str(why)))
            for t in threads:
                t.join(5.0)
            if failure is not None:
                raise failure
            raise self._missing(deadline, timeout)
        for t in threads:
            t.join(5.0)

    def _stalled(self) -> list[_Holder]:
        """The holders whose stripe verified no chunk for ``stall_timeout`` while another holder
        (or a spare) is left to retake it: a trickle is as lost as a silence. The only holder
        left keeps its stripe until the fetch's deadline. Called with the lock held."""
        now, out = time.monotonic(), []
        for h, w in self.watches.items():
            pos = w.receiver.verified_to
            if pos != w.pos:
                w.pos, w.since = pos, now
            elif now - w.since >= self.stall_timeout and h.dropped is None and (
                    self.spares or any(g is not h and g.dropped is None for g in self.holders)):
                out.append(h)
                w.since = float("inf")  # interrupted once
        return out

    def _missing(self, deadline: float, timeout: float) -> E.CollectiveError:
        """Why stripes are left: every holder dropped, or the deadline."""
        with self.cond:
            left = sorted(self.queue)
        if left:
            a = left[0][0]
            names = overlapping(self.plan, a, left[-1][1])
            what = (f"bytes {a}..{left[-1][1]} ({quoted(names[0].name)}" + (f" .. {quoted(names[-1].name)})" if len(names) > 1 else ")")
                    if names else f"bytes {a}..{left[-1][1]}")
        else:
            what = "stripes in progress"
        dropped = [f"{h.name()} {h.dropped}" for h in self.holders if h.dropped]
        if time.monotonic() >= deadline:
            return E.DeadlineError(f"fetch did not complete within {timeout:g} s; still missing {what}"
                                   + (f" ({'; '.join(dropped)})" if dropped else ""))
        if self.bad and len(self.bad) == len(dropped):
            return E.IntegrityError("; ".join(self.bad) + f"; no other holder is left for {what}")
        return E.FetchError("; ".join(dropped) + f"; no holder is left for {what}")

    def _next(self) -> tuple[int, int] | None:
        """The next stripe to take; None once none is left (or the fetch has failed). While the
        queue is empty, another holder's stripe may come back (it is dropped): wait for that."""
        with self.cond:
            while self.failure is None and self.left:
                if self.queue:
                    return self.queue.popleft()
                self.cond.wait(0.5)
            return None

    def _spare(self) -> _Holder | None:
        """The next spare whose plan is this fetch's (same manifest, same layout), or None once
        none is left, no stripe is left or the fetch has failed."""
        while True:
            with self.cond:
                if self.failure is not None or not self.left or not self.spares:
                    return None
                h = self.spares.popleft()
            exc = self.ask(h) if h.plan is None else None
            if exc is None and (h.plan.manifest_digest != self.plan.manifest_digest or _layout(h.plan) != self.layout):
                exc = E.FetchError(f"{h.name()} publishes manifest {h.plan.manifest_digest} in "
                                   f"{h.plan.chunk_bytes}-byte chunks, not this fetch's")
            if exc is not None:
                log.warning("fetch: spare %s left out: %s", h.address, _one_line(exc))
                h.close()
                continue
            log.info("fetch: %s takes over from a dropped holder", h.name())
            with self.cond:
                self.holders.append(h)
            return h

    def _take(self, h: _Holder | None) -> None:
        # With ``into``, a stripe that lies inside one tensor is received into it; each holder's
        # thread receives the others into one buffer of its own (its pages put in place as each
        # stripe is asked for), and copies each out once verified.
        own = lazy_arena(self.mixed_bytes) if self.arena is None else None
        try:
            while h is not None:
                while (span := self._next()) is not None:
                    if not self._receive(h, span, own):
                        break  # dropped: a spare takes its place
                else:
                    return
                h = self._spare()
        except BaseException as exc:  # a bug here must end the fetch, not hang it
            with self.cond:
                self.failure = self.failure or exc
                self.cond.notify_all()
        finally:
            with self.cond:
                self.cond.notify_all()

    def _receive(self, h: _Holder, span: tuple[int, int], own: np.ndarray | None) -> bool:
        a, b = span
        total = self.plan.total_bytes
        if self.arena is not None:
            buf, base = self.arena, 0
            warm(buf, a, b)  # this stripe's pages, committed now that its bytes are asked for
        else:
            inside = self.scatter.target(a, b)
            if inside is None:  # into this holder's buffer, copied out once verified
                warm(own, 0, b - a)
            buf, base = inside or (own[: b - a], a)
        receiver = Receiver(self.plan, buf, span=span, base=base, table=self.table)
        ref = pb.WorkerRef(worker_id=self.ident, resume_from=a, stop_at=b if b < total else 0)
        with self.cond:
            self.watches[h] = _Watch(receiver)
        try:
            h.link.receive_into(ref, receiver, self.stall_timeout)
            receiver.finish()
        except E.CollectiveError as exc:
            pos = receiver.verified_to  # every chunk below it was verified
            if pos >= b and not isinstance(exc, E.IntegrityError):  # only the stripe's end message was lost
                return self._done(h, buf, base, a, b)
            if self.failure is not None:  # interrupted by the fetch itself (its deadline): no one's fault
                self._landed(h, buf, base, a, pos)
                with self.cond:
                    self.queue.appendleft((pos, b))
                return False
            if isinstance(exc, E.IntegrityError):
                name = _differing(self.plan, buf, base, pos, min(pos + self.plan.chunk_bytes, b))
                reason = f"sent bytes of {quoted(name)} that differ from its own plan"
                with self.cond:
                    self.bad.append(f"{h.name()} {reason}")
            else:
                reason = f"was lost ({_one_line(exc)})"
            log.warning("fetch: %s %s; its stripe %d..%d goes to the other holders", h.name(), reason, pos, b)
            self._landed(h, buf, base, a, pos)
            with self.cond:
                h.dropped = reason
                self.queue.appendleft((pos, b))
                self.cond.notify_all()
            return False
        finally:
            with self.cond:
                self.watches.pop(h, None)
        return self._done(h, buf, base, a, b)

    def _done(self, h: _Holder, buf: np.ndarray, base: int, a: int, b: int) -> bool:
        self._landed(h, buf, base, a, b)
        with self.cond:
            h.stripes += 1
            self.left -= 1
            self.cond.notify_all()
        return True

    def _landed(self, h: _Holder, buf: np.ndarray, base: int, a: int, b: int) -> None:
        """Bytes ``a..b`` are verified: count them for ``h`` and move them to ``into``'s arrays."""
        if b <= a:
            return
        if self.scatter is not None:
            self.scatter(buf, base, a, b)
        with self.cond:
            h.bytes += b - a


def _stripes(plan: pb.Plan, per: int, inside: bool) -> list[tuple[int, int]]:
    """The arena's chunks in stripes of at most ``per`` chunks.

    ``inside`` (a fetch ``into`` arrays): a variable whose own chunks (those holding none of
    another's bytes nor padding) make at least an eighth of a stripe is also cut at them, so
    those stripes lie inside it and are received into its array in place. Smaller ones stay in
    the stripes around them (copied out): many small variables do not make many small streams."""
    size, total = plan.chunk_bytes, plan.total_bytes
    chunks = -(-total // size)
    cuts = set(range(0, chunks, per))
    if inside:
        least = max(1, per // 8)
        for v in plan.variables:
            end = v.offset + v.nbytes
            first, last = -(-v.offset // size), (chunks if end == total else end // size)
            if last - first >= least:
                cuts.update((first, last))
    edges = sorted(cuts - {chunks}) + [chunks]
    return [(i * size, min(j * size, total)) for i, j in itertools.pairwise(edges)]


class _Into:
    """Where each variable's bytes go when the caller gave ``into`` arrays: those arrays, or the
    fetch's own (the others, and the skeleton: one receive arena). A stripe that lies inside
    one variable is received straight into its array (``target``); any other stripe into a
    buffer of its holder's and copied out once verified, so the fetch holds the state once plus
    at most one such stripe per holder."""

    def __init__(self, plan: pb.Plan, into: Mapping[str, np.ndarray]) -> None:
        names = {v.name: v for v in plan.variables}
        self.targets: dict[str, np.ndarray] = {}
        for name, a in into.items():
            v = names.get(name)
            if v is None or name == tree.TREE:
                raise E.UsageError(f"into[{name!r}]: the snapshot has no tensor of that name")
            want = (tuple(v.shape), dtypes.from_wire(v.dtype))
            if not isinstance(a, np.ndarray) or (a.shape, a.dtype) != want:
                got = (a.shape, a.dtype) if isinstance(a, np.ndarray) else type(a).__name__
                raise E.UsageError(f"into[{name!r}] is {got}; the snapshot's tensor is {want[0]} {want[1]}")
            if not (a.flags.c_contiguous and a.flags.writeable):
                raise E.UsageError(f"into[{name!r}] must be a writable C-contiguous array")
            self.targets[name] = a
        self.plan = plan
        self.ends = [v.offset + v.nbytes for v in plan.variables]  # in arena order (validate_plan)
        self.flat = {name: a.reshape(-1).view(np.uint8) for name, a in self.targets.items()}
        # The other variables in one receive arena of the fetch's own (its memory committed as
        # their bytes are copied in), each aligned as in the plan's layout.
        rest = [v for v in plan.variables if v.name not in self.targets]
        own, pos = lazy_arena(sum(align(v.nbytes) for v in rest)), 0
        for v in rest:
            self.flat[v.name] = own[pos : pos + v.nbytes]
            pos += align(v.nbytes)

    def target(self, a: int, b: int) -> tuple[np.ndarray, int] | None:
        """The array and the arena offset it starts at, when bytes ``a..b`` lie inside one
        variable (no padding, no other variable): the stripe is received there, in place."""
        i = bisect.bisect_right(self.ends, a)  # the first variable that ends past ``a``
        v = self.plan.variables[i] if i < len(self.ends) else None
        if v is None or not v.offset <= a < b <= v.offset + v.nbytes:
            return None
        return self.flat[v.name], v.offset

    def __call__(self, buf: np.ndarray, base: int, a: int, b: int) -> None:
        for v in overlapping(self.plan, a, b):
            dst = self.flat[v.name]
            if dst is buf:  # received in place (``target``)
                continue
            lo, hi = max(a, v.offset), min(b, v.offset + v.nbytes)
            dst[lo - v.offset : hi - v.offset] = buf[lo - base : hi - base]

    def arrays(self) -> dict[str, np.ndarray]:
        return {v.name: self.targets.get(v.name, variable_view(self.flat[v.name], v, v.offset)) for v in self.plan.variables}


def _check_variables(plan: pb.Plan, arrays: dict[str, np.ndarray], sender: str) -> None:
    """Every variable's bytes against its own digest, the manifest's: the chunk digests that
    checked the stream are the holder's word too, and a plan whose chunk digests cover other
    bytes than its variables' digests (a manifest copied from an honest holder over forged
    chunks) would otherwise hand out bytes that no trusted digest covered."""
    for v in plan.variables:
        if not v.nbytes:
            continue
        got = bytes_digest(memoryview(np.ascontiguousarray(arrays[v.name]).reshape(-1).view(np.uint8)))
        if got != v.digest:
            raise E.IntegrityError(f"{sender}: the bytes of {v.name!r} match the plan's chunk digests but not "
                                   f"its own digest {v.digest} (they hash to {got}): the plan does not hold "
                                   f"together; nothing returned")


def _attach(ready: list[_Holder], plan: pb.Plan, ident: str) -> np.ndarray | None:
    """A same-host holder's sealed copy (``publish(copy=True)``), mapped copy-on-write and
    every chunk checked against the plan, or None (another host, no copy offered, or refused:
    then the stream). A mapping whose bytes differ names the holder and is not used."""
    from collective.transport import shm

    for h in ready:
        if not h.plan.shm_socket:
            continue
        arena = shm.attach(h.plan.shm_socket, h.plan.shm_secret, ident, "", plan.total_bytes, whose=h.name())
        if arena is None:
            continue
        differs = differing_chunk(plan, chunk_digests(arena, plan.chunk_bytes), plan.chunk_digests)
        if differs is not None:
            name = _differing(plan, arena, 0, *differs)
            log.warning("fetch: %s shares a copy whose bytes of %r differ from its own plan; not used", h.name(), name)
            continue
        h.bytes, h.shared = plan.total_bytes, True
        return arena
    return None


def fetch(sources: str | Sequence[str], *, step: int, token: str | None = None, timeout: float = 300.0,
          stall_timeout: float = 30.0, into: Mapping[str, np.ndarray] | None = None,
          manifest: str | None = None, max_bytes: int | None = None, tls=None, shm: bool = True) -> Fetched:
    """The state published at ``step`` by the holders at ``sources``, every byte verified.

    :param sources: one ``host:port`` (or several, comma-separated) or a sequence of them. The
        holders of ``step`` whose manifests agree share the work, at most
        ``MAX_ACTIVE_HOLDERS`` (8) at once (the other sources are spares): the chunks are
        striped over them, and a holder lost (connection cut, process killed, silent for
        ``stall_timeout``, or no verified chunk for ``stall_timeout`` while another is left)
        or sending bytes that differ from its own plan is dropped and its share retaken from
        the others.
    :param step: the step wanted; a holder of another step is refused.
    :param token: the cluster token (default ``COLLECTIVE_TOKEN``).
    :param timeout: seconds for the whole fetch.
    :param stall_timeout: seconds a holder may send nothing (or no whole verified chunk, while
        another holder is left) before it counts as lost.
    :param into: name -> preallocated writable C-contiguous numpy array of that tensor's shape
        and dtype: those tensors are received into them (a stripe inside one tensor in place,
        checked as it lands; the rest in a buffer per holder, copied out once verified), so a
        recovering process need not hold the state twice. The result's leaves are those very
        arrays. A fetch that fails leaves them partly written.
    :param manifest: the manifest digest the state must have (from a source trusted more than
        the holders: what catches a holder that lies consistently in its own plan).
    :param max_bytes: the largest state accepted (default: this machine's memory); a plan that
        claims more is refused before anything is allocated. Memory is committed a stripe at a
        time as each is asked for: at most ``MAX_ACTIVE_HOLDERS`` x ``STRIPE_BYTES`` (8 x 64 MiB)
        ahead of the bytes that arrived.
    :return: a ``Fetched`` dict: the state as published, tensors as numpy arrays (views of one
        received arena, zero copy) and JSON values for the rest; ``.step``,
        ``.manifest_digest``, ``.total_bytes`` and ``.stats`` (per holder: bytes delivered,
        stripes, why it was dropped).
    :param tls: ``TlsFiles(ca=)`` to reach holders that serve TLS (``server_name=`` when their
        certificate names another host); with ``cert=`` and ``key=`` too, mutual TLS (the
        fetch presents itself under its certificate's common name).
    :param shm: map a same-host holder's sealed copy (``publish(copy=True)``) instead of
        receiving the stream, when it offers one (every chunk still checked); False: the stream.
    :raises FetchError: wrong step, holders disagreeing on the manifest, no holder left.
    :raises IntegrityError: a holder's bytes differ from its own plan and no other holder is left.
    :raises AuthError: a holder refused the token. ChiefUnreachableError: unreachable holder.
    """
    from collective.transport.grpc import GrpcChiefLink

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise E.UsageError(f"step must be an integer >= 0, not {step!r}")
    if not (timeout > 0 and stall_timeout > 0):
        raise E.UsageError("timeout and stall_timeout must be > 0 seconds")
    addresses = _sources(sources)
    started = time.monotonic()
    deadline = started + timeout
    token = cluster_token(token)
    ident = _identity(tls)
    limit = max_bytes if max_bytes is not None else _memory_bytes()
    holders = [_Holder(a, lambda a: GrpcChiefLink(a, token=token, name="holder", tls=tls)) for a in addresses]
    try:
        ready, spares = _ask_plans(holders, step, deadline, stall_timeout, limit, ident)
        plan = ready[0].plan
        if manifest is not None and plan.manifest_digest != manifest:
            raise E.FetchError(f"{', '.join(h.name() for h in ready)} publish manifest {plan.manifest_digest} "
                             f"of step {step}, not the expected {manifest}")
        scatter = _Into(plan, into) if into is not None else None
        mapped = _attach(ready, plan, ident) if shm else None
        if mapped is not None:  # verified already; with ``into``, copied out
            arena = mapped
            if scatter is not None:
                scatter(mapped, 0, 0, plan.total_bytes)
        else:
            # Its pages committed a stripe at a time, as each is asked for (``warm``).
            arena = lazy_arena(plan.total_bytes) if scatter is None else None
            striper = _Striper(plan, ready, spares, arena, scatter, stall_timeout, ident,
                               lambda h: _ask(h, step, deadline, stall_timeout, limit, ident))
            striper.run(deadline, timeout)
            ready = striper.holders
        arrays = {v.name: variable_view(arena, v) for v in plan.variables} if scatter is None else scatter.arrays()
        sender = ", ".join(h.name() for h in ready)
        _check_variables(plan, arrays, sender)
        state = tree.unflatten(tree.decode(arrays[tree.TREE], step, sender), arrays, sender)
    finally:
        for h in holders:
            h.close()
    out = Fetched(state)
    out.step, out.manifest_digest, out.total_bytes = step, plan.manifest_digest, plan.total_bytes
    out.stats = {h.address: {"bytes": h.bytes, "stripes": h.stripes, "dropped": h.dropped, "shared_memory": h.shared}
                 for h in ready}
    seconds = time.monotonic() - started
    log.info("fetched step %d (%s, manifest %s) in %.2f s: %s", step, format_bytes(plan.total_bytes),
             plan.manifest_digest, seconds,
             ", ".join(f"{a} {format_bytes(s['bytes'])}" + (f" (dropped: {s['dropped']})" if s["dropped"] else "")
                       for a, s in out.stats.items()))
    return out
