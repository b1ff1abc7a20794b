"""The broadcast plan: arena layout, keys, chunking, and the receiver's checks.

All variables are laid out back to back (64-byte aligned) in one *arena*. The data stream is the
arena cut into chunks of at most ``chunk_bytes``: many small variables fuse into one chunk and a
large variable spans many. Each chunk names the instance keys of the variables it carries; the
chunk holding a variable's last byte carries its trailer (byte count + digest); the last message
carries the stream end (total bytes + manifest digest). ``Receiver`` enforces all of it, so a
truncated, reordered or corrupted stream is never taken as success.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from collective import keys as keymod
from collective._proto import collective_pb2 as pb
from collective.digest import bytes_digest, combined_digest
from collective.errors import IntegrityError, ProtocolError
from collective.model import Aggregation, Synchronization, VariableSpec

ALIGN = 64
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 16 << 20
_ALLOWED_KINDS = set("biufc")
_CANONICAL_DTYPE = re.compile(r"[<>|=][biufc][0-9]{1,2}", re.ASCII)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(specs: Sequence[VariableSpec]) -> tuple[list[int], int]:
    """Arena offsets of each variable and the arena's total size."""
    offsets, pos = [], 0
    for spec in specs:
        pos = align(pos)
        offsets.append(pos)
        pos += spec.nbytes
    return offsets, pos


def manifest_digest(variables: Sequence[pb.VariableInfo]) -> str:
    return combined_digest((v.name, v.digest) for v in variables)


def build_plan(
    specs: Sequence[VariableSpec],
    digests: Sequence[str],
    workers: Sequence[pb.WorkerInfo],
    *,
    chunk_bytes: int,
    chief_incarnation: str,
    model: str,
) -> pb.Plan:
    """Assign keys and offsets. Every variable goes to every device of every worker."""
    offsets, total = layout(specs)
    devices = [keymod.qualified_device(w.rank, d) for w in workers for d in w.devices]
    groups = keymod.group_keys([devices])
    group_key = groups[tuple(sorted(devices))]
    ikeys = keymod.instance_keys([s.name for s in specs])
    variables = [
        pb.VariableInfo(
            name=s.name,
            shape=list(s.shape),
            dtype=s.dtype,
            synchronization=s.synchronization.name,
            aggregation=s.aggregation.name,
            trainable=_trainable(s),
            group_key=group_key,
            instance_key=ikeys[s.name],
            offset=off,
            nbytes=s.nbytes,
            digest=d,
        )
        for s, off, d in zip(specs, offsets, digests, strict=True)
    ]
    return pb.Plan(
        chief_incarnation=chief_incarnation,
        num_workers=len(workers),
        workers=list(workers),
        groups=[pb.GroupInfo(group_key=k, devices=list(g)) for g, k in groups.items()],
        variables=variables,
        total_bytes=total,
        chunk_bytes=chunk_bytes,
        manifest_digest=manifest_digest(variables),
        model=model,
    )


def _trainable(spec: VariableSpec) -> bool:
    if spec.trainable is not None:
        return spec.trainable
    return spec.synchronization is not Synchronization.ON_READ


def declared(specs: Sequence[VariableSpec]) -> list[pb.VariableInfo]:
    """The declaration a worker sends at join: names, shapes, dtypes and modes."""
    return [
        pb.VariableInfo(
            name=s.name, shape=list(s.shape), dtype=s.dtype, synchronization=s.synchronization.name,
            aggregation=s.aggregation.name, trainable=_trainable(s),
        )
        for s in specs
    ]


def declaration_differences(chief: Sequence[VariableSpec], worker: Sequence[pb.VariableInfo]) -> list[str]:
    """Every difference, one line each: ``name: chief (3, 4) float32 vs worker (4, 3) float32``."""
    mine = {s.name: s for s in chief}
    theirs = {v.name: v for v in worker}
    out = []
    for name, s in mine.items():
        v = theirs.get(name)
        if v is None:
            out.append(f"{name}: chief {s.describe()} vs worker (missing)")
            continue
        try:
            w = spec_of(v)
        except ValueError as exc:
            out.append(f"{name}: worker declaration is invalid ({exc})")
            continue
        if (w.shape, w.np_dtype) != (s.shape, s.np_dtype):
            out.append(f"{name}: chief {s.describe()} vs worker {w.describe()}")
        elif (w.synchronization, w.aggregation) != (s.synchronization, s.aggregation):
            out.append(
                f"{name}: chief {s.synchronization.name}/{s.aggregation.name} vs worker "
                f"{w.synchronization.name}/{w.aggregation.name}"
            )
    out += [f"{name}: chief (missing) vs worker {spec_of(v).describe()}" for name, v in theirs.items() if name not in mine]
    return out


def spec_of(v: pb.VariableInfo) -> VariableSpec:
    return VariableSpec(
        name=v.name,
        shape=tuple(v.shape),
        dtype=v.dtype,
        synchronization=Synchronization.parse(v.synchronization, variable=v.name),
        aggregation=Aggregation.parse(v.aggregation, variable=v.name),
        trainable=v.trainable,
    )


def validate_plan(plan: pb.Plan) -> None:
    """Reject a plan that is inconsistent before any byte is written. Raises ProtocolError."""
    if not 0 < plan.chunk_bytes <= MAX_CHUNK_BYTES:
        raise ProtocolError(f"plan chunk size {plan.chunk_bytes} is outside 1..{MAX_CHUNK_BYTES}")
    group_keys = {g.group_key for g in plan.groups}
    names, ikeys, end = set(), set(), 0
    for v in plan.variables:
        where = f"plan variable {v.name!r}"
        if not v.name or v.name in names:
            raise ProtocolError(f"{where}: empty or duplicate name")
        if v.instance_key in ikeys:
            raise ProtocolError(f"{where}: instance key {v.instance_key} is used twice")
        if v.group_key not in group_keys:
            raise ProtocolError(f"{where}: group key {v.group_key} is not a group of the plan")
        # Only numpy's canonical ``dtype.str`` forms (``<f4``, ``|b1``) are accepted on the wire.
        if not _CANONICAL_DTYPE.fullmatch(v.dtype):
            raise ProtocolError(f"{where}: invalid dtype {v.dtype!r}")
        try:
            dt = np.dtype(v.dtype)
        except (TypeError, ValueError, SyntaxError) as exc:
            raise ProtocolError(f"{where}: invalid dtype {v.dtype!r}") from exc
        if dt.str != v.dtype:
            raise ProtocolError(f"{where}: dtype {v.dtype!r} is not in numpy's canonical form {dt.str!r}")
        try:
            Synchronization.parse(v.synchronization, variable=v.name)
            Aggregation.parse(v.aggregation, variable=v.name)
        except ValueError as exc:
            raise ProtocolError(f"{where}: {exc}") from exc
        if dt.kind not in _ALLOWED_KINDS or dt.fields is not None:
            raise ProtocolError(f"{where}: dtype {v.dtype!r} is not allowed on the wire")
        if any(d < 0 for d in v.shape):
            raise ProtocolError(f"{where}: negative dimension in shape {tuple(v.shape)}")
        expected = math.prod(v.shape) * dt.itemsize  # exact integers: no rounding for huge shapes
        if expected != v.nbytes:
            raise ProtocolError(f"{where}: {v.nbytes} bytes do not fit shape {tuple(v.shape)} {dt.name}")
        if v.offset < end or v.offset + v.nbytes > plan.total_bytes:
            raise ProtocolError(f"{where}: bytes {v.offset}..{v.offset + v.nbytes} overlap or pass the arena end")
        end = v.offset + v.nbytes
        names.add(v.name)
        ikeys.add(v.instance_key)
    if manifest_digest(plan.variables) != plan.manifest_digest:
        raise ProtocolError("plan manifest digest does not match its variables")
    _validate_parents(plan)


def _validate_parents(plan: pb.Plan) -> None:
    """With a relay topology, every worker's parents lead to the chief, through relays that exist."""
    if plan.topology in ("", "star"):
        return
    by_rank = {w.rank: w for w in plan.workers}
    for w in plan.workers:
        seen, node = set(), w
        while node.parent != -1:
            parent = by_rank.get(node.parent)
            if parent is None or node.rank in seen:
                raise ProtocolError(f"plan worker rank {w.rank}: its parents do not lead to the chief")
            if not parent.relay_address:
                raise ProtocolError(f"plan worker rank {parent.rank} relays to rank {node.rank} but has no relay address")
            seen.add(node.rank)
            node = parent


@dataclass(frozen=True)
class _ChunkFrame:
    start: int
    end: int
    group_key: int
    instance_keys: tuple[int, ...]
    trailers: tuple[pb.VariableTrailer, ...]


def _frames(plan: pb.Plan) -> list[_ChunkFrame]:
    """Chunk boundaries and their metadata; the same for every receiver of the plan."""
    total, size = plan.total_bytes, plan.chunk_bytes
    group_key = plan.groups[0].group_key if plan.groups else 0
    variables = list(plan.variables)  # in arena order, without overlaps (validate_plan)
    frames, vi, lo = [], 0, 0
    for start in range(0, total, size):
        end = min(start + size, total)
        # Variables only move forward: skip those ended before this chunk, scan those starting in it.
        while lo < len(variables) and variables[lo].offset + variables[lo].nbytes <= start:
            lo += 1
        ik, j = [], lo
        while j < len(variables) and variables[j].offset < end:
            if variables[j].nbytes:
                ik.append(variables[j].instance_key)
            j += 1
        ik = tuple(ik)
        trailers = []
        while vi < len(variables):
            v = variables[vi]
            last = v.offset + v.nbytes
            if (v.nbytes and last <= end) or (not v.nbytes and v.offset < end):
                trailers.append(pb.VariableTrailer(instance_key=v.instance_key, nbytes=v.nbytes, digest=v.digest))
                vi += 1
            else:
                break
        frames.append(_ChunkFrame(start, end, group_key, ik, tuple(trailers)))
    rest = tuple(
        pb.VariableTrailer(instance_key=v.instance_key, nbytes=v.nbytes, digest=v.digest) for v in variables[vi:]
    )
    frames.append(_ChunkFrame(total, total, group_key, (), rest))
    return frames


class Chunker:
    """Cuts the chief's arena into the messages of one stream. Built once, used per receiver."""

    def __init__(self, plan: pb.Plan, arena: np.ndarray) -> None:
        self._plan = plan
        self._arena = memoryview(arena.reshape(-1).view(np.uint8))
        self._frames = _frames(plan)

    def __len__(self) -> int:
        return len(self._frames)

    def chunks(self) -> Iterator[pb.Chunk]:
        """Yield the stream's messages; the last one carries the stream end."""
        return with_bytes(self.frames())

    def frames(self) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """Each message without its bytes, and a view of those bytes in the arena.

        For transports that send the bytes themselves without a copy (MPI's Bcast).
        """
        for msg, start, end in frame_messages(self._plan):
            yield msg, self._arena[start:end]


def with_bytes(frames: Iterable[tuple[pb.Chunk, memoryview]]) -> Iterator[pb.Chunk]:
    """Whole messages from (message without bytes, view of the bytes) pairs: one copy each."""
    for msg, data in frames:
        msg.data = bytes(data)
        yield msg


def frame_messages(plan: pb.Plan) -> Iterator[tuple[pb.Chunk, int, int]]:
    """Every message of a plan's stream without its bytes, with the arena range it covers.

    Both ends can derive them from the plan alone, so a transport that moves the bytes in large
    collective calls (MPI) need not send them: the receiver still checks every trailer.
    """
    frames = _frames(plan)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        msg = pb.Chunk(offset=f.start, group_key=f.group_key, instance_keys=f.instance_keys, trailers=f.trailers)
        if i == last:
            msg.end.total_bytes = plan.total_bytes
            msg.end.manifest_digest = plan.manifest_digest
        yield msg, f.start, f.end


PAGE = 4096


def new_arena(nbytes: int) -> np.ndarray:
    """A receive arena with every page already faulted in.

    The first write to each fresh page costs a fault and a zeroing (about 0.5 ms per MiB on a
    small VM); done here, before the stream is asked for, that cost is not paid between two
    chunks of the stream, where it held one gRPC stream to a third of its rate. The peers'
    buffers (``collective bench --peers``) are warm too.
    """
    arena = np.empty(nbytes, dtype=np.uint8)
    arena[::PAGE] = 0
    return arena


class Receiver:
    """Writes a stream into a worker's arena and checks it against the plan.

    ``accept`` raises ProtocolError for keys or offsets the plan does not allow, and
    IntegrityError (naming the variable) for a count or digest mismatch. ``finish`` raises
    IntegrityError unless the stream ended properly with every variable verified.
    """

    def __init__(self, plan: pb.Plan, arena: np.ndarray) -> None:
        self._plan = self.plan = plan
        self._arena = arena.reshape(-1).view(np.uint8)
        self._frames = {f.start: f for f in _frames(plan)}
        self._by_key = {v.instance_key: v for v in plan.variables}
        self._groups = {g.group_key for g in plan.groups}
        self._pos = 0
        self._verified: set[int] = set()
        self._ended = False

    @property
    def bytes_received(self) -> int:
        return self._pos

    @property
    def variables_verified(self) -> int:
        return len(self._verified)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Where the next chunk's bytes go, for transports that write them in place.

        Raises ProtocolError unless ``offset`` is where the stream stands and ``nbytes`` is the
        plan's length for that chunk; then call ``accept(meta, placed=True)``.
        """
        frame = self._frames.get(offset)
        if offset != self._pos or frame is None or nbytes != frame.end - frame.start:
            raise ProtocolError(
                f"chunk of {nbytes} bytes at offset {offset} does not fit the plan (the stream stands at {self._pos})"
            )
        return self._arena[frame.start : frame.end]

    def span(self, start: int, end: int) -> np.ndarray:
        """Where several consecutive chunks' bytes go, for one large in-place write.

        ``start`` must be where the stream stands and ``end`` a chunk boundary of the plan (or
        the arena's end); then ``accept(meta, placed=True)`` each chunk of the span in order.
        """
        if start != self._pos or not (end == self._plan.total_bytes or end in self._frames) or end < start:
            raise ProtocolError(f"span {start}..{end} does not fit the plan (the stream stands at {self._pos})")
        return self._arena[start:end]

    def accept(self, chunk: pb.Chunk, *, placed: bool = False) -> None:
        """Check one message and write its bytes (already written with ``placed``)."""
        if self._ended:
            raise ProtocolError("message received after the end of the stream")
        if chunk.group_key not in self._groups and (chunk.data or chunk.instance_keys):
            raise ProtocolError(f"chunk at offset {chunk.offset} has group key {chunk.group_key}, not in the plan")
        for k in chunk.instance_keys:
            if k not in self._by_key:
                raise ProtocolError(f"chunk at offset {chunk.offset} has instance key {k}, not in the plan")
        frame = self._frames.get(chunk.offset)
        if chunk.offset != self._pos or frame is None:
            raise ProtocolError(f"chunk at offset {chunk.offset} arrived where offset {self._pos} was expected")
        if not placed and len(chunk.data) != frame.end - frame.start:
            raise IntegrityError(
                f"chunk at offset {chunk.offset} has {len(chunk.data)} bytes; the plan says {frame.end - frame.start}"
            )
        if tuple(chunk.instance_keys) != frame.instance_keys:
            raise ProtocolError(
                f"chunk at offset {chunk.offset} names instance keys {list(chunk.instance_keys)}; "
                f"the plan puts {list(frame.instance_keys)} there"
            )
        if chunk.data and not placed:
            self._arena[frame.start : frame.end] = np.frombuffer(chunk.data, dtype=np.uint8)
        self._pos = frame.end
        for t in chunk.trailers:
            self._check_trailer(t)
        if chunk.HasField("end"):
            self._check_end(chunk.end)

    def _check_trailer(self, t: pb.VariableTrailer) -> None:
        v = self._by_key.get(t.instance_key)
        if v is None:
            raise ProtocolError(f"trailer for instance key {t.instance_key}, which is not in the plan")
        if v.offset + v.nbytes > self._pos:
            raise IntegrityError(
                f"variable {v.name!r}: trailer arrived after {max(0, self._pos - v.offset)} of {v.nbytes} bytes"
            )
        if t.nbytes != v.nbytes:
            raise IntegrityError(f"variable {v.name!r}: trailer counts {t.nbytes} bytes; the plan says {v.nbytes}")
        got = bytes_digest(memoryview(self._arena[v.offset : v.offset + v.nbytes]))
        if got != t.digest or got != v.digest:
            raise IntegrityError(
                f"variable {v.name!r}: digest of received bytes {got} differs from the chief's {v.digest}"
            )
        self._verified.add(v.instance_key)

    def _check_end(self, end: pb.StreamEnd) -> None:
        if end.total_bytes != self._plan.total_bytes or self._pos != self._plan.total_bytes:
            raise IntegrityError(
                f"stream end claims {end.total_bytes} bytes after {self._pos} received; "
                f"the plan has {self._plan.total_bytes}"
            )
        if end.manifest_digest != self._plan.manifest_digest:
            raise IntegrityError("stream end carries a manifest digest that differs from the plan's")
        self._ended = True

    def finish(self) -> None:
        """Raise IntegrityError unless the whole stream arrived and every variable verified."""
        missing = [v.name for v in self._plan.variables if v.instance_key not in self._verified]
        if not self._ended:
            if self._pos == self._plan.total_bytes and not missing:
                raise IntegrityError(
                    f"stream ended without its end message (total and manifest digest) after all "
                    f"{self._pos} bytes; a stream that does not end properly is never taken as complete"
                )
            raise IntegrityError(
                f"stream ended early: {self._pos} of {self._plan.total_bytes} bytes, "
                f"{len(missing)} variable(s) unverified (first: {missing[0] if missing else '-'})"
            )
        if missing:
            raise IntegrityError(f"variables never verified: {', '.join(missing[:5])}")
