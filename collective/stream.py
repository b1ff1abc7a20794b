"""The data stream of a plan: its frames, cut from the chief's arena by the ``Chunker`` and
checked by the worker's ``Receiver``.

Both ends derive the stream's messages from the plan alone (``frame_messages``): each chunk's
offset, group and instance keys, and its trailer, the digest of its bytes, which the plan lists
too (``chunk_digests``); the last message carries the stream end (total bytes + manifest digest).
``Receiver`` enforces all of it, so a truncated, reordered or corrupted stream is never taken as
success, and a chunk that differs is traced to the variable whose own digest differs
(``culprit``).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from collective._proto import collective_pb2 as pb
from collective.arena import Arena, as_arena
from collective.digest import bytes_digest
from collective.errors import IntegrityError, ProtocolError
from collective.variables import replica_name


@dataclass(frozen=True)
class _ChunkFrame:
    start: int
    end: int
    group_key: int
    instance_keys: tuple[int, ...]
    digest: str  # "" for the end message


def _frames(plan: pb.Plan) -> list[_ChunkFrame]:
    """Chunk boundaries and their metadata; the same for every receiver of the plan."""
    total, size = plan.total_bytes, plan.chunk_bytes
    group_key = plan.groups[0].group_key if plan.groups else 0
    variables = [v for v in plan.variables if v.nbytes]  # in arena order, without overlaps (validate_plan)
    frames, lo = [], 0
    for i, start in enumerate(range(0, total, size)):
        end = min(start + size, total)
        # Variables only move forward: skip those ended before this chunk, scan those starting in it.
        while lo < len(variables) and variables[lo].offset + variables[lo].nbytes <= start:
            lo += 1
        j = lo
        while j < len(variables) and variables[j].offset < end:
            j += 1
        ik = tuple(v.instance_key for v in variables[lo:j])
        # A provisional plan (digests_follow) has none yet: the sender's trailer is the chunk's digest.
        frames.append(_ChunkFrame(start, end, group_key, ik, plan.chunk_digests[i] if plan.chunk_digests else ""))
    frames.append(_ChunkFrame(total, total, group_key, (), ""))
    return frames


class Chunker:
    """Cuts the chief's arena into the messages of one stream. Built once, used per receiver."""

    def __init__(self, plan: pb.Plan, arena: Arena | np.ndarray, known: Sequence[str] | None = None) -> None:
        """``arena``: an ``Arena`` (``collective.arena``: a shard's or a holder's ``ScatterView``)
        or a flat array. ``known``: the chunk digests verified so far (a relay's Receiver's, growing as the
        stream lands), the trailers of a provisional plan (``digests_follow``); without them
        each chunk is hashed as it is first sent, once for every stream of this Chunker."""
        self._plan = plan
        self._slice = as_arena(arena).slice
        self._frames = _frames(plan)
        self._known = known
        self._hashed: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._frames)

    def chunks(self) -> Iterator[pb.Chunk]:
        """Yield the stream's messages; the last one carries the stream end."""
        return with_bytes(self.frames())

    def frames(self, rng: ChunkRange | None = None, landed=None) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """Each message without its bytes, and a view of those bytes in the arena: the chunks of
        ``rng`` (default: all; a request's, ``ChunkRange.of``), then the end message, a stripe's
        (``stripe_end``) when ``rng`` stops before the arena's end. ``landed(i)``: returns once
        the arena holds chunk ``i``, verified (a relay's, as its own streams arrive), called
        before each chunk's message is made.

        For transports that send the bytes themselves without a copy (MPI's Bcast).
        """
        rng = rng or ALL
        start, stop = rng.start, rng.stop
        total, size = self._plan.total_bytes, self._plan.chunk_bytes
        for msg, first, end in frame_messages(self._plan, self._frames, start):
            if stop and first >= stop:
                yield stripe_end(self._plan, stop), memoryview(b"")
                return
            if first < start:
                continue
            if first < total:  # a chunk, not the end message
                if not rng.has(first // size):
                    continue
                if landed is not None:
                    landed(first // size)
            data = self._slice(first, end)
            if not msg.digest and end > first:  # a provisional plan: the trailer is the chunk's own digest
                msg.digest = self._trailer(first, data)
            yield msg, data

    def _trailer(self, start: int, data: memoryview) -> str:
        i = start // self._plan.chunk_bytes
        if self._known is not None and i < len(self._known) and self._known[i]:
            return self._known[i]
        digest = self._hashed.get(i)
        if digest is None:
            digest = self._hashed[i] = bytes_digest(data)
        return digest


def stripe_end(plan: pb.Plan, stop: int) -> pb.Chunk:
    """The end message of the stripe of a stream that stops at ``stop``: its ``total_bytes`` is
    ``stop``, what a ``Receiver`` of that span expects."""
    group_key = plan.groups[0].group_key if plan.groups else 0
    return pb.Chunk(offset=stop, group_key=group_key,
                    end=pb.StreamEnd(total_bytes=stop, manifest_digest=plan.manifest_digest))


@dataclass(frozen=True)
class FrameTable:
    """What a ``Receiver`` checks a plan's stream against: every frame in order (the end's
    last) and by its offset, the plan's instance and group keys, its variables' ends. Made once
    per plan (``frame_table``) and shared by the receivers of its stripes."""

    chunks: list[_ChunkFrame]
    frames: dict[int, _ChunkFrame]
    keys: frozenset[int]
    groups: frozenset[int]
    ends: list[int]


def frame_table(plan: pb.Plan) -> FrameTable:
    chunks = _frames(plan)
    return FrameTable(chunks, {f.start: f for f in chunks}, frozenset(v.instance_key for v in plan.variables),
                      frozenset(g.group_key for g in plan.groups), sorted(v.offset + v.nbytes for v in plan.variables))


def with_bytes(frames: Iterable[tuple[pb.Chunk, memoryview]]) -> Iterator[pb.Chunk]:
    """Whole messages from (message without bytes, view of the bytes) pairs: one copy each."""
    for msg, data in frames:
        msg.data = bytes(data)
        yield msg


def frame_messages(plan: pb.Plan, frames: list[_ChunkFrame] | None = None,
                   start: int = 0) -> Iterator[tuple[pb.Chunk, int, int]]:
    """Every message of a plan's stream without its bytes, with the arena range it covers.

    Both ends can derive them from the plan alone, so a transport that moves the bytes in large
    collective calls (MPI) need not send them: the receiver still checks every trailer.
    """
    frames = _frames(plan) if frames is None else frames  # ``frames``: the plan's, made once
    last = len(frames) - 1
    # One frame per chunk, then the end: from the chunk holding ``start`` on (a stripe, a resume).
    for i in range(min(start // plan.chunk_bytes, last) if start else 0, last + 1):
        f = frames[i]
        msg = pb.Chunk(offset=f.start, group_key=f.group_key, instance_keys=f.instance_keys, digest=f.digest)
        if i == last:
            msg.end.total_bytes = plan.total_bytes
            msg.end.manifest_digest = plan.manifest_digest
        yield msg, f.start, f.end


def culprit(
    plan: pb.Plan, arena: np.ndarray, start: int, end: int, *, upto: int | None = None,
    replica: tuple[int, str] | None = None, digests: tuple[str, str] | None = None, base: int = 0,
) -> str:
    """Why the bytes ``start..end`` of ``arena`` differ from the chief's, naming the variable.

    Each variable overlapping the range whose bytes all lie below ``upto`` (default: the arena
    end) is hashed and compared with its own digest in the plan; the first that differs is named
    with both digests. A variable that continues past ``upto`` cannot be hashed yet: it is named
    as the owner of the differing bytes. Only the padding between variables is left otherwise.
    ``replica`` (index, device): the arena holds that replica of every variable, not bytes just
    received. ``digests`` (got, chief's) of the whole range are quoted when no variable could be
    hashed on its own. ``base``: ``arena`` holds the plan's arena from that offset on (a
    stripe's buffer); a variable that begins before it cannot be hashed either.
    """
    v, got = differing_variable(plan, arena, start, end, upto=upto, base=base)
    if got and replica is not None:
        name = replica_name(v.name, replica[0])
        return f"variable {v.name!r}: replica {name!r} on {replica[1]} has digest {got}, the chief's is {v.digest}"
    if got:
        return f"variable {v.name!r}: digest of received bytes {got} differs from the chief's {v.digest}"
    quoted = f": chunk digest {digests[0]}, the chief's {digests[1]}" if digests else ""
    if v is not None:
        return (
            f"variable {v.name!r}: its bytes {max(start, v.offset) - v.offset}..{min(end, v.offset + v.nbytes) - v.offset} "
            f"(in the chunk at offset {start}) differ from the chief's{quoted}"
        )
    return f"the padding between variables in bytes {start}..{end} differs from the chief's{quoted}"


def differing_variable(plan: pb.Plan, arena: np.ndarray, start: int, end: int, *, upto: int | None = None,
                       base: int = 0) -> tuple[pb.VariableInfo | None, str]:
    """The variable to blame for bytes ``start..end`` of ``arena`` that differ from the plan's
    (``culprit``'s, a fetch's): the first one overlapping them, held whole (from ``base`` on,
    below ``upto``, default: the arena end), whose bytes' digest differs from its own, with that
    digest; else the first one only partly held, with ""; (None, "") when only the padding
    between variables is left."""
    upto = plan.total_bytes if upto is None else upto
    flat = arena.reshape(-1).view(np.uint8)
    partial = None
    for v in overlapping(plan, start, end):
        if v.offset + v.nbytes > upto or v.offset < base:
            partial = partial or v
            continue
        got = bytes_digest(memoryview(flat[v.offset - base : v.offset + v.nbytes - base]))
        if got != v.digest:
            return v, got
    return partial, ""


def differing_chunk(plan: pb.Plan, got: Sequence[str], want: Sequence[str]) -> tuple[int, int] | None:
    """The arena range of the first chunk whose digest in ``got`` is not the one in ``want`` (or
    that one of the lists lacks); None when they are equal."""
    if list(got) == list(want):
        return None
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    start = k * plan.chunk_bytes
    return start, min(start + plan.chunk_bytes, plan.total_bytes)


def overlapping(plan: pb.Plan, start: int, end: int) -> list[pb.VariableInfo]:
    """The variables with bytes in ``start..end``, in arena order."""
    ends = [v.offset + v.nbytes for v in plan.variables]
    i = bisect.bisect_right(ends, start)
    out = []
    for v in plan.variables[i:]:
        if v.offset >= end:
            break
        if v.nbytes:
            out.append(v)
    return out


@dataclass(frozen=True)
class ChunkRange:
    """Which chunks one stream carries: from arena offset ``start`` to ``stop`` (chunk
    boundaries; ``stop`` 0: to the arena's end), those whose index i has ``i % stride ==
    phase``; then the end message (a stripe's, ``stripe_end``, when it stops early).

    ``ChunkRange()`` (``ALL``) is the whole stream, what every single-parent topology asks. A
    double tree's child asks each of its two parents for one tree's chunks (stride 2, phase =
    the tree); a worker whose parent was lost resumes at the first chunk it lacks (``start``);
    a snapshot fetch asks each holder for one stripe (``start``..``stop``). Every sender (the
    chief, a relay, a holder) reads a request with ``of``, which checks it against the plan,
    and cuts it with ``Chunker.frames``; a receiver asks with ``Part.range``, written into the
    request by ``ask``. On the wire: ``WorkerRef.resume_from``, ``stop_at``, ``chunk_stride``,
    ``chunk_phase``."""

    start: int = 0
    stop: int = 0
    stride: int = 1
    phase: int = 0

    @classmethod
    def of(cls, ref: pb.WorkerRef, plan: pb.Plan) -> ChunkRange:
        """The range a stream request asks for, checked against ``plan`` (``check``)."""
        return cls(ref.resume_from, ref.stop_at, ref.chunk_stride or 1, ref.chunk_phase).check(
            plan, "stream request asks for")

    @classmethod
    def stripe(cls, start: int, stop: int, plan: pb.Plan) -> ChunkRange:
        """Every chunk from offset ``start`` to ``stop`` (``plan``'s ``total_bytes``, the
        arena's end: ``stop`` 0)."""
        return cls(start, 0 if stop == plan.total_bytes else stop)

    def check(self, plan: pb.Plan, what: str = "range of") -> ChunkRange:
        """This range, or ProtocolError (``what`` it is, then the range) unless it is one of
        ``plan``'s stream: ``start`` a chunk boundary or the arena's end, ``stop`` 0 or a chunk
        boundary from ``start`` (none between them: the end message only) to below the arena's
        end, ``phase`` below ``stride``."""
        total, size = plan.total_bytes, plan.chunk_bytes or 1
        start, stop = self.start, self.stop

        def boundary(x: int) -> bool:
            return x == total or (0 <= x < total and x % size == 0)
        if not boundary(start) or (stop and not (boundary(stop) and start <= stop < total)) or not 0 <= self.phase < self.stride:
            raise ProtocolError(f"{what} bytes {start}..{stop or total}, chunk phase {self.phase} of stride "
                                f"{self.stride}: not a range of chunks of this {total}-byte stream ({size}-byte chunks)")
        return self

    def ask(self, ref: pb.WorkerRef) -> pb.WorkerRef:
        """``ref`` asking for this range (stride and phase left unset for the whole stream:
        older senders)."""
        ref.resume_from, ref.stop_at = self.start, self.stop
        if self.stride > 1:
            ref.chunk_stride, ref.chunk_phase = self.stride, self.phase
        return ref

    def has(self, i: int) -> bool:
        """Whether chunk ``i`` (an index in the plan) is of this range's stride and phase."""
        return i % self.stride == self.phase

    def first(self, i: int) -> int:
        """The index of the first chunk from ``i`` on of this range's stride and phase."""
        return i + (self.phase - i) % self.stride


ALL = ChunkRange()


class Lockstep:
    """Keeps one sender's selected streams (a double tree's: the chief's two root streams, a
    relay's two children) within ``lead`` chunk indexes of each other.

    Why: two TCP streams leaving one shaped link do not share it from the start. Measured on
    emulated hosts, whichever stream gets going first keeps the link and the other is held back
    for up to its whole half (0 to 0.35 s of a 0.8 s round, no loss), and a late stream leaves
    its whole tree idle. A stream that runs ahead here waits until the others have handed
    their earlier chunks to their transport, so the one that got the link lets the other in.

    The streams of one sender are asked for some milliseconds apart, and a stream alone fills
    the link's queue before its sibling starts (which then starts slowly behind that queue): so
    a stream also waits, before its first chunk, for the siblings its sender expects
    (``expected``) to be asked for. With both: the later root stream's first chunk landed
    0.005-0.04 s after the other's (0-0.35 s before).

    Every wait is bounded: a stream that has not moved for ``hold`` seconds (its receiver
    stalled, a relay waiting for its parent, a stream never closed), or a sibling not asked for
    within ``hold`` seconds of the first, is not waited for. Thread-safe; one per sender, across
    rounds (a stream leaves when it ends; the first to come when none is left starts anew)."""

    def __init__(self, lead: int = 2, hold: float = 1.0) -> None:
        self._cond = threading.Condition()
        self._next: dict[object, tuple[int, float]] = {}  # stream -> (chunk it sends next, since when)
        self._lead, self._hold = lead, hold
        self._expected, self._seen, self._started = 1, 0, 0.0

    def frames(self, chunker: Chunker, rng: ChunkRange, landed=None,
               expected: int = 1) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """``chunker.frames(rng, landed)`` kept in step with this sender's other selected
        streams, ``expected`` of them in all (``plan.sibling_streams``); a whole stream (stride
        1) has no sibling to wait for."""
        if rng.stride <= 1:
            yield from chunker.frames(rng, landed)
            return
        token = object()
        with self._cond:
            if not self._next:  # the first of this sender's streams (of a round)
                self._expected, self._seen, self._started = expected, 0, time.monotonic()
            self._seen += 1

        def paced(i: int) -> None:
            self._mark(token, i)  # it handed over every earlier chunk, whatever it waits for now
            if landed is not None:
                landed(i)
            self.wait(token, i)
        try:
            yield from chunker.frames(rng, paced)
        finally:  # ended, failed or cut off (the generator closed): nobody waits for it
            with self._cond:
                self._next.pop(token, None)
                self._cond.notify_all()

    def _mark(self, token: object, i: int) -> None:
        with self._cond:
            self._next[token] = (i, time.monotonic())
            self._cond.notify_all()

    def wait(self, token: object, i: int) -> None:
        """``token``'s stream is about to send chunk ``i`` (it has handed over every earlier one)."""
        self._mark(token, i)  # again after ``landed``, which may have waited: its hold starts now
        with self._cond:
            deadline = time.monotonic() + self._hold

            def behind() -> bool:
                now = time.monotonic()
                if self._seen < self._expected and now - self._started < self._hold:
                    return True  # a sibling not asked for yet
                return any(j < i - self._lead and now - since < self._hold
                           for t, (j, since) in self._next.items() if t is not token)
            while behind():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            self._next[token] = (i, time.monotonic())  # it sends from now: it has moved


class Receiver:
    """Writes the streams of one plan into a worker's arena and checks them against the plan.

    The chunks may come in several streams, each a ``ChunkRange``'s stride and phase of them
    from its own sender (``part``), concurrently and in any order between streams; within one stream in order. Each
    chunk is marked landed (``landed``, ``verified``) only once its bytes matched the plan's
    digest, so a relay never forwards one known to differ. The Receiver's own ``view``, ``span``
    and ``accept`` are those of the whole stream (``part(ALL)``), for a single sender.

    ``accept`` raises ProtocolError for keys or offsets the plan does not allow, and
    IntegrityError (naming the variable) for a chunk whose bytes differ from the chief's. Every
    chunk is hashed once, whatever the number of variables it fuses. ``finish`` raises
    IntegrityError unless every stream ended properly with every byte verified.

    ``span`` (a ``ChunkRange``'s ``start`` and ``stop``, of stride 1): receive one stripe of the
    stream, whose streams end with ``stripe_end`` (several senders' stripes of one arena); each
    part's stride and phase apply within it. ``base``: ``arena`` holds the bytes from that offset
    of the plan's arena on (a stripe's own buffer). Chunk indices (``landed``, ``verified``) are
    the plan's, whatever the span.
    """

    def __init__(self, plan: pb.Plan, arena: np.ndarray, *, span: ChunkRange = ALL,
                 base: int = 0, table: FrameTable | None = None) -> None:
        """``table``: the plan's ``frame_table``, made once for the many stripes of one plan."""
        self._plan = self.plan = plan
        self._arena = arena.reshape(-1).view(np.uint8)
        self._base = base
        self._table(frame_table(plan) if table is None else table)
        if span.stride != 1:
            raise ValueError(f"a receiver's span is every chunk from start to stop, not a stride of them: {span}")
        self._span = span.check(plan, "a receiver's span of")
        start, stop = self._start, self._stop = span.start, span.stop or plan.total_bytes
        # A stripe ends where its next chunk would begin, with a message of no bytes there.
        f = self._frames[stop]
        self._end = _ChunkFrame(f.start, f.start, f.group_key, (), "")
        # The span's chunks by index, first..last; the frame at ``last`` is the span's end.
        self._first, self._last = (len(self._list) - 1 if x == plan.total_bytes else x // plan.chunk_bytes
                                   for x in (start, stop))
        n = len(self._list) - 1
        self._lock = threading.Lock()  # the bookkeeping below, shared by the streams of every part
        self._landed = bytearray(n)
        self._received = 0
        self._prefix = self._first  # chunks landed from the span's first on, without a gap
        # The digest of every chunk verified so far by index, "" for one not yet: a relay's
        # Chunker reads its trailers here (``Chunker(known=)``) as they land.
        self.verified: list[str] = [""] * n
        self._parts: list[Part] = []
        self._whole: Part | None = None

    def _table(self, table: FrameTable) -> None:
        self._list, self._frames = table.chunks, table.frames
        self._keys, self._groups, self._ends = table.keys, table.groups, table.ends

    def _frame(self, offset: int) -> _ChunkFrame | None:
        return self._end if offset == self._stop else self._frames.get(offset)

    def _slice(self, start: int, end: int) -> np.ndarray:
        return self._arena[start - self._base : end - self._base]

    def part(self, rng: ChunkRange = ALL) -> Part:
        """The receiving end of one stream carrying the chunks of ``rng``'s stride and phase
        within this Receiver's span (one per sender). A stream resumed from another sender
        continues the same part (``Part.range``)."""
        p = Part(self, rng)
        self._parts.append(p)
        return p

    @property
    def range(self) -> ChunkRange:
        """What to ask a single sender for: the whole stream's part's ``range``."""
        return self._default().range

    def _default(self) -> Part:
        if self._whole is None:
            self._whole = self.part(ALL)
        return self._whole

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self._default().view(offset, nbytes)

    def span(self, start: int, end: int) -> np.ndarray:
        return self._default().span(start, end)

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None:
        self._default().accept(chunk, placed=placed)

    def landed(self, i: int) -> bool:
        """Whether chunk ``i`` is in the arena, verified."""
        return bool(self._landed[i])

    @property
    def landed_mask(self) -> bytearray:
        """One byte per chunk, non-zero once it has landed, verified: what a relay reads (it
        holds no reference to the arena, whose last writable view must go before a seal)."""
        return self._landed

    @property
    def digests(self) -> list[str]:
        """The digests of the chunks verified from the span's first on, without a gap, in order."""
        return self.verified[self._first : self._prefix]

    @property
    def bytes_received(self) -> int:
        """The bytes that landed, verified, in every stream."""
        return self._received

    @property
    def verified_to(self) -> int:
        """The offset below which every byte of the span landed, verified (where a stripe's
        fetch resumes)."""
        return self._list[self._prefix].start

    def _through(self) -> int:
        """Where a single stream would stand: the span's start plus the bytes received."""
        return self._start + self._received

    @property
    def variables_verified(self) -> int:
        """Variables whose every byte has arrived in verified chunks."""
        return bisect.bisect_right(self._ends, self.verified_to)

    def _land(self, i: int, digest: str, nbytes: int) -> None:
        with self._lock:
            self.verified[i] = digest
            self._landed[i] = 1
            self._received += nbytes
            while self._prefix < self._last and self._landed[self._prefix]:
                self._prefix += 1

    def _check_chunk(self, chunk: pb.Chunk, frame: _ChunkFrame) -> str:
        """The chunk's trailer: its bytes' digest against the plan's (and the sender's claim).

        A provisional plan (``digests_follow``) has no chunk digests yet: the bytes are checked
        against the trailer, and against the chief's digests once they come (``complete``)."""
        got = bytes_digest(memoryview(self._slice(frame.start, frame.end)))
        if not frame.digest:
            if not chunk.digest:
                raise ProtocolError(f"chunk at offset {chunk.offset} has no digest trailer; the plan's digests "
                                    f"follow the stream, so every chunk must carry its own")
            if got != chunk.digest:
                names = ", ".join(repr(v.name) for v in overlapping(self._plan, frame.start, frame.end)[:3]) or "padding"
                raise IntegrityError(f"chunk at offset {chunk.offset} (bytes of {names}): digest of received bytes "
                                     f"{got} differs from its trailer {chunk.digest}")
        elif got != frame.digest:
            # A variable can be hashed on its own only when all its bytes are here: those before
            # this chunk once every chunk before it has landed.
            upto = frame.end if self.verified_to >= frame.start else frame.start
            raise IntegrityError(culprit(self._plan, self._arena, frame.start, frame.end, upto=upto,
                                         digests=(got, frame.digest), base=self._base))
        elif chunk.digest != frame.digest:
            raise IntegrityError(
                f"chunk at offset {chunk.offset}: its trailer says digest {chunk.digest or '(none)'}, "
                f"the plan and the received bytes say {frame.digest}"
            )
        return got

    def complete(self, plan: pb.Plan) -> None:
        """The complete plan of a provisional one (``check_completes``): every chunk received
        so far against the chief's digests. Raises IntegrityError naming the variable. For a
        Receiver of the whole stream (a provisional plan is never striped)."""
        differs = differing_chunk(plan, self.digests, plan.chunk_digests[: len(self.digests)])
        if differs is not None:
            k = differs[0] // plan.chunk_bytes
            raise IntegrityError(culprit(plan, self._arena, *differs, upto=self.verified_to,
                                         digests=(self.digests[k], plan.chunk_digests[k]), base=self._base))
        self._plan = self.plan = plan
        self._table(frame_table(plan))

    def finish(self) -> None:
        """Raise IntegrityError unless every stream ended properly, every byte verified."""
        for p in self._parts or [self._default()]:
            p.finish()
        if self._prefix < self._last:
            first = next((v.name for v in self._plan.variables if v.offset + v.nbytes > self.verified_to), "-")
            raise IntegrityError(
                f"streams ended with {self._through()} of {self._stop} bytes: the chunk at offset "
                f"{self.verified_to} (bytes of {first!r}) came in none of them"
            )


class Part:
    """One stream of a ``Receiver``: the chunks of its stride and phase in the Receiver's span,
    in order, then the end message."""

    def __init__(self, receiver: Receiver, rng: ChunkRange) -> None:
        self._r, self.stride, self.phase = receiver, rng.stride, rng.phase
        self._next = rng.first(receiver._first)  # the index of the next chunk this stream carries
        self._ended = False

    @property
    def plan(self) -> pb.Plan:
        return self._r.plan

    @property
    def resume_from(self) -> int:
        """Where this stream stands: the offset of its next chunk (the span's end once none is left)."""
        r = self._r
        return r._list[min(self._next, r._last)].start

    @property
    def range(self) -> ChunkRange:
        """What to ask a sender for (``ChunkRange.ask``): this stream's chunks from where it
        stands to the span's end."""
        return replace(self._r._span, start=self.resume_from, stride=self.stride, phase=self.phase)

    @property
    def bytes_received(self) -> int:
        return self._r.bytes_received

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Where the next chunk's bytes go, for transports that write them in place.

        Raises ProtocolError unless ``offset`` is where the stream stands and ``nbytes`` is the
        plan's length for that chunk; then call ``accept(meta, placed=True)``.
        """
        pos = self.resume_from
        frame = self._r._frame(offset)
        if offset != pos or frame is None or nbytes != frame.end - frame.start:
            raise ProtocolError(
                f"chunk of {nbytes} bytes at offset {offset} does not fit the plan (the stream stands at {pos})"
            )
        return self._r._slice(frame.start, frame.end)

    def span(self, start: int, end: int) -> np.ndarray:
        """Where several consecutive chunks' bytes go, for one large in-place write.

        ``start`` must be where the stream stands and ``end`` a chunk boundary of the plan (or
        the arena's end) up to the span's end, within this stream's chunks (one, unless it
        carries every chunk); then ``accept(meta, placed=True)`` each chunk of the span in order.
        """
        r, pos = self._r, self.resume_from
        ok = end in r._frames and end <= r._stop  # the arena's end is the end frame's offset
        if self.stride > 1:
            ok = ok and pos < r._stop and end == r._list[self._next].end
        if start != pos or not ok or end < start:
            raise ProtocolError(f"span {start}..{end} does not fit the plan (the stream stands at {pos})")
        return r._slice(start, end)

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None:
        """Check one message and write its bytes (already written with ``placed``)."""
        r = self._r
        if self._ended:
            raise ProtocolError("message received after the end of the stream")
        if chunk.group_key not in r._groups and (chunk.data or chunk.instance_keys):
            raise ProtocolError(f"chunk at offset {chunk.offset} has group key {chunk.group_key}, not in the plan")
        pos = self.resume_from
        frame = r._frame(chunk.offset)
        if chunk.offset != pos or frame is None:
            raise ProtocolError(f"chunk at offset {chunk.offset} arrived where offset {pos} was expected")
        if not placed and len(chunk.data) != frame.end - frame.start:
            raise IntegrityError(
                f"chunk at offset {chunk.offset} has {len(chunk.data)} bytes; the plan says {frame.end - frame.start}"
            )
        keys = tuple(chunk.instance_keys)
        if keys != frame.instance_keys:
            unknown = [k for k in keys if k not in r._keys]
            if unknown:
                raise ProtocolError(f"chunk at offset {chunk.offset} has instance key {unknown[0]}, not in the plan")
            raise ProtocolError(
                f"chunk at offset {chunk.offset} names instance keys {list(keys)[:8]}; "
                f"the plan puts {list(frame.instance_keys)[:8]} there"
            )
        if chunk.data and not placed:
            r._slice(frame.start, frame.end)[...] = np.frombuffer(chunk.data, dtype=np.uint8)
        if frame.end > frame.start:
            r._land(self._next, r._check_chunk(chunk, frame), frame.end - frame.start)
            self._next += self.stride
        elif chunk.digest:
            raise ProtocolError(f"message at offset {chunk.offset} has no bytes but claims digest {chunk.digest}")
        if chunk.HasField("end"):
            self._check_end(chunk.end)

    def _check_end(self, end: pb.StreamEnd) -> None:
        r = self._r
        if end.total_bytes != r._stop or self.resume_from != r._stop:
            raise IntegrityError(
                f"stream end claims {end.total_bytes} bytes after {r._through()} received; "
                f"the plan has {r._stop}"
            )
        # An empty one: the sender's plan or this one is provisional (``digests_follow``).
        if end.manifest_digest and r.plan.manifest_digest and end.manifest_digest != r.plan.manifest_digest:
            raise IntegrityError("stream end carries a manifest digest that differs from the plan's")
        self._ended = True

    def finish(self) -> None:
        """Raise IntegrityError unless this stream arrived, verified, with its end message."""
        if self._ended:
            return
        r = self._r
        if self.resume_from == r._stop:
            raise IntegrityError(
                f"stream ended without its end message (total and manifest digest) after all "
                f"{r._through()} bytes; a stream that does not end properly is never taken as complete"
            )
        first = next((v.name for v in r.plan.variables if v.offset + v.nbytes > r.verified_to), "-")
        missing = len(r._ends) - r.variables_verified
        raise IntegrityError(
            f"stream ended early: {r._through()} of {r._stop} bytes, "
            f"{missing} variable(s) unverified (first: {first})"
        )
