"""A fetch's stripes: the arena's chunks cut into stripes (``stripes``), taken in turn by one
thread per holder (``Striper``), each stripe one data stream received in place and verified chunk
by chunk. A holder whose stream breaks, stalls (no verified chunk for ``stall_timeout`` while
another is left), runs far below the others (``SLOW_FRACTION`` of their median rate over
``SLOW_WINDOW`` seconds of streaming, while another is left) or sends bytes that differ from its
plan is dropped; its share goes back to the queue and its thread goes on with a spare
(``fetcher``'s step 2).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

import numpy as np

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.arena import lazy_arena, warm
from collective.digest import bytes_digest
from collective.limits import MAX_HOLDER_NAME_CHARS
from collective.logs import printable
from collective.model import quoted
from collective.sizes import format_bytes
from collective.stream import ChunkRange, Receiver, differing_variable, frame_table, overlapping

log = logging.getLogger("collective.snapshot.fetcher")  # the fetch's one log, as before the split

STRIPE_BYTES = 64 << 20
"""At most this much in one stripe: a lost holder's share is retaken in pieces this size. The
arena's pages are put in place a stripe at a time, as each is asked for: a fetch commits at most
``MAX_ACTIVE_HOLDERS`` stripes of memory ahead of the bytes that arrived."""
MAX_ACTIVE_HOLDERS = 8
"""At most this many holders serve one fetch at once, one thread each; the other sources are
spares, asked for their plan only when a holder is dropped, to retake its share."""
SLOW_WINDOW = 6.0
"""A holder's rate is its verified bytes over its last this many seconds of streaming (summed
over its stripes, not counting the time it waits for one): one that sends a chunk just before
every ``stall_timeout`` is never stalled, yet may run a thousand times below the others."""
SLOW_FRACTION = 1 / 8
"""Below this fraction of the median of the other holders' rates (each its verified bytes over
its time streaming), a holder is dropped and its stripe retaken, while another holder is left."""


class Holder:
    def __init__(self, address: str, connect) -> None:
        self.address, self._connect, self._link = address, connect, None
        self.plan: pb.Plan | None = None
        self.bytes = 0
        self.stripes = 0
        self.shared = False  # its sealed copy was mapped (same host), not streamed
        self.dropped: str | None = None
        self.label = ""  # its name (publish(name=)), from its plan: printable, bounded
        self.streamed, self.verified = 0.0, 0  # seconds in its stripes and the bytes they verified
        self.samples: collections.deque[tuple[float, int]] = collections.deque([(0.0, 0)])  # (streamed, verified)

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


def layout_digest(plan: pb.Plan) -> str:
    """What stripes from several holders need in common beyond the manifest: the same bytes at
    the same offsets in the same chunks (``chunk_bytes`` is the publisher's choice)."""
    bare = pb.Plan()
    bare.CopyFrom(plan)
    bare.chief_incarnation = bare.shm_socket = bare.shm_secret = ""  # each holder's own
    bare.model = ""  # its name too (the step was checked apart)
    return bytes_digest(bare.SerializeToString(deterministic=True))


def one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def differing(plan: pb.Plan, buf: np.ndarray, base: int, start: int, end: int) -> str:
    """The variable whose bytes in ``start..end`` differ from its digest: the first one held
    whole in ``buf`` (bytes from ``base`` on) that does, else the first only partly held
    (``stream.differing_variable``, as the broadcast's ``culprit`` names it)."""
    v, _ = differing_variable(plan, buf, start, end, upto=base + buf.nbytes, base=base)
    return v.name if v is not None else "the padding between variables"


class _Watch:
    """A stripe in progress: its receiver, and since when it has verified nothing more."""

    def __init__(self, receiver: Receiver, h: Holder) -> None:
        self.receiver, self.pos, self.since = receiver, receiver.verified_to, time.monotonic()
        self.start, self.start_pos, self.base = self.since, self.pos, (h.streamed, h.verified)

    def progress(self, now: float) -> tuple[float, int]:
        """Its holder's seconds of streaming and bytes verified, this stripe's so far included."""
        return self.base[0] + now - self.start, self.base[1] + self.receiver.verified_to - self.start_pos


class Striper:
    """The stripes of one fetch, the threads that take them (one per active holder, at most
    ``MAX_ACTIVE_HOLDERS``) and the outcome. A thread whose holder is dropped goes on with a
    spare, if one is left and its plan lays the state out alike."""

    def __init__(self, plan: pb.Plan, holders: list[Holder], spares: list[Holder], arena: np.ndarray | None,
                 scatter, stall_timeout: float, ident: str, ask) -> None:
        self.ident = ident
        self.plan, self.holders, self.arena, self.scatter = plan, list(holders), arena, scatter
        self.spares, self.ask, self.layout = collections.deque(spares), ask, layout_digest(plan)
        self.stall_timeout = stall_timeout
        self.table = frame_table(plan)  # once: every stripe's Receiver checks against it
        size, total = plan.chunk_bytes, plan.total_bytes
        chunks = -(-total // size)
        per = max(1, min(-(-chunks // (4 * len(holders))), max(1, STRIPE_BYTES // size)))
        self.queue = collections.deque(stripes(plan, per, scatter is not None))
        # With ``into``: the largest stripe that is not received in place, the size of each
        # holder's buffer (a stripe given back is part of one, never larger).
        self.mixed_bytes = max((b - a for a, b in self.queue if scatter is not None and scatter.target(a, b) is None),
                               default=0)
        self.left = len(self.queue)
        self.cond = threading.Condition()
        self.failure: BaseException | None = None
        self.bad: list[str] = []
        self.watches: dict[Holder, _Watch] = {}

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
            for h, why in stalled:  # outside the lock: its stripe comes back through _receive
                log.warning("fetch: %s %s; dropping it", h.name(), why)
                h.link.interrupt(E.DeadlineError(f"{h.name()} {why}"))
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

    def _stalled(self) -> list[tuple[Holder, str]]:
        """The holders to drop, and why: those whose stripe verified no chunk for
        ``stall_timeout`` while another holder (or a spare) is left to retake it (a trickle is
        as lost as a silence), and those far below the others (``_slow``) while another holder
        is left. The only holder left keeps its stripe until the fetch's deadline. Called with
        the lock held."""
        now, out = time.monotonic(), []
        for h, w in self.watches.items():
            pos = w.receiver.verified_to
            if pos != w.pos:
                w.pos, w.since = pos, now
            if h.dropped is not None or w.since == float("inf"):
                continue
            if now - w.since >= self.stall_timeout and (
                    self.spares or any(g is not h and g.dropped is None for g in self.holders)):
                out.append((h, f"delivered no verified chunk for {self.stall_timeout:g} s (its stripe stalled)"))
            elif (why := self._slow(h, w, now)) is not None:
                out.append((h, why))
            else:
                continue
            w.since = float("inf")  # interrupted once
        return out

    def _slow(self, h: Holder, w: _Watch, now: float) -> str | None:
        """Why ``h`` runs far below the others, or None: its rate over its last ``SLOW_WINDOW``
        seconds of streaming is below ``SLOW_FRACTION`` of the median of the other holders'
        (those not dropped that verified bytes). A holder that sends one chunk just before every
        ``stall_timeout`` is not stalled, yet holds its stripe for (chunks x stall_timeout)."""
        streamed, verified = w.progress(now)
        h.samples.append((streamed, verified))
        while len(h.samples) > 1 and streamed - h.samples[1][0] >= SLOW_WINDOW:
            h.samples.popleft()  # the oldest kept is the last at least a window back
        then, before = h.samples[0]
        if streamed - then < SLOW_WINDOW:
            return None
        rates = sorted(v / s for v, s in (self._rate(g, now) for g in self.holders
                                          if g is not h and g.dropped is None) if v and s > 0)
        if not rates:
            return None
        rate, median = (verified - before) / (streamed - then), rates[len(rates) // 2]
        if rate >= median * SLOW_FRACTION:
            return None
        return (f"ran far below the other holders ({format_bytes(int(rate))}/s over its last {streamed - then:.0f} s "
                f"of streaming, against their median {format_bytes(int(median))}/s)")

    def _rate(self, g: Holder, now: float) -> tuple[int, float]:
        """``g``'s verified bytes and seconds streaming, its stripe in progress included."""
        w = self.watches.get(g)
        streamed, verified = w.progress(now) if w is not None else (g.streamed, g.verified)
        return verified, streamed

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

    def _spare(self) -> Holder | None:
        """The next spare whose plan is this fetch's (same manifest, same layout), or None once
        none is left, no stripe is left or the fetch has failed."""
        while True:
            with self.cond:
                if self.failure is not None or not self.left or not self.spares:
                    return None
                h = self.spares.popleft()
            exc = self.ask(h) if h.plan is None else None
            if exc is None and (h.plan.manifest_digest != self.plan.manifest_digest or layout_digest(h.plan) != self.layout):
                exc = E.FetchError(f"{h.name()} publishes manifest {h.plan.manifest_digest} in "
                                   f"{h.plan.chunk_bytes}-byte chunks, not this fetch's")
            if exc is not None:
                log.warning("fetch: spare %s left out: %s", h.address, one_line(exc))
                h.close()
                continue
            log.info("fetch: %s takes over from a dropped holder", h.name())
            with self.cond:
                self.holders.append(h)
            return h

    def _take(self, h: Holder | None) -> None:
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

    def _receive(self, h: Holder, span: tuple[int, int], own: np.ndarray | None) -> bool:
        a, b = span
        if self.arena is not None:
            buf, base = self.arena, 0
            warm(buf, a, b)  # this stripe's pages, committed now that its bytes are asked for
        else:
            inside = self.scatter.target(a, b)
            if inside is None:  # into this holder's buffer, copied out once verified
                warm(own, 0, b - a)
            buf, base = inside or (own[: b - a], a)
        receiver = Receiver(self.plan, buf, span=ChunkRange.stripe(a, b, self.plan), base=base, table=self.table)
        # this stripe's chunks, of the plan this holder gave (not of a step it served since)
        ref = receiver.range.ask(pb.WorkerRef(worker_id=self.ident, incarnation=h.plan.chief_incarnation))
        with self.cond:
            self.watches[h] = _Watch(receiver, h)
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
                name = differing(self.plan, buf, base, pos, min(pos + self.plan.chunk_bytes, b))
                reason = f"sent bytes of {quoted(name)} that differ from its own plan"
                with self.cond:
                    self.bad.append(f"{h.name()} {reason}")
            else:
                reason = f"was lost ({one_line(exc)})"
            log.warning("fetch: %s %s; its stripe %d..%d goes to the other holders", h.name(), reason, pos, b)
            self._landed(h, buf, base, a, pos)
            with self.cond:
                h.dropped = reason
                self.queue.appendleft((pos, b))
                self.cond.notify_all()
            return False
        finally:
            with self.cond:
                w = self.watches.pop(h)
                h.streamed, h.verified = w.progress(time.monotonic())
        return self._done(h, buf, base, a, b)

    def _done(self, h: Holder, buf: np.ndarray, base: int, a: int, b: int) -> bool:
        self._landed(h, buf, base, a, b)
        with self.cond:
            h.stripes += 1
            self.left -= 1
            self.cond.notify_all()
        return True

    def _landed(self, h: Holder, buf: np.ndarray, base: int, a: int, b: int) -> None:
        """Bytes ``a..b`` are verified: count them for ``h`` and move them to ``into``'s arrays."""
        if b <= a:
            return
        if self.scatter is not None:
            self.scatter(buf, base, a, b)
        with self.cond:
            h.bytes += b - a


def stripes(plan: pb.Plan, per: int, inside: bool) -> list[tuple[int, int]]:
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
