"""The broadcast plan: arena layout, keys, chunking, and the receiver's checks.

All variables are laid out back to back (64-byte aligned) in one *arena*. The data stream is the
arena cut into chunks of at most ``chunk_bytes``: many small variables fuse into one chunk (a
bucket) and a large variable spans many. Each chunk names the instance keys of the variables it
carries and carries its trailer, the digest of its bytes, which the plan lists too
(``chunk_digests``); the last message carries the stream end (total bytes + manifest digest).
``Receiver`` enforces all of it, so a truncated, reordered or corrupted stream is never taken as
success, and a chunk that differs is traced to the variable whose own digest differs.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from collective import dtypes
from collective import keys as keymod
from collective._proto import collective_pb2 as pb
from collective.digest import bytes_digest, chunk_digests, combined_digest
from collective.errors import IntegrityError, InvalidVariableError, ProtocolError
from collective.model import Aggregation, Synchronization, VariableSpec, check_specs
from collective.variables import replica_name

ALIGN = 64
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 16 << 20
_ALLOWED_KINDS = set("biufc")
_EMPTY_DIGEST = bytes_digest(b"")
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
    arena: np.ndarray,
    chunk_bytes: int,
    chief_incarnation: str,
    model: str,
    offsets: Sequence[int] | None = None,
    chunks: Sequence[str] | None = None,
) -> pb.Plan:
    """Assign keys and offsets. Every variable goes to every device of every worker.

    ``arena`` holds the variables at the layout's offsets, or at ``offsets`` (in order, not
    overlapping: a model file's own, when the arena is the file): the plan lists its chunk
    digests, or ``chunks`` when they were computed already (``digest.one_pass``).
    ``digests`` None: the bytes are not read yet, and the plan goes out without its digests
    (``Plan.digests_follow``; ``complete_plan`` fills them in later).
    """
    follow = digests is None
    if follow:  # an empty variable's digest is known without reading anything
        digests = ["" if s.nbytes else _EMPTY_DIGEST for s in specs]
    if offsets is None:
        offsets, total = layout(specs)
    else:
        offsets, total = list(offsets), arena.nbytes
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
    plan = pb.Plan(
        chief_incarnation=chief_incarnation,
        num_workers=len(workers),
        workers=list(workers),
        groups=[pb.GroupInfo(group_key=k, devices=list(g)) for g, k in groups.items()],
        variables=variables,
        total_bytes=total,
        chunk_bytes=chunk_bytes,
        model=model,
    )
    if follow:
        plan.digests_follow = True
        return plan
    return complete_plan(plan, digests, chunks if chunks is not None else
                         chunk_digests(arena.reshape(-1).view(np.uint8)[:total], chunk_bytes))


def complete_plan(plan: pb.Plan, digests: Sequence[str], chunks: Sequence[str]) -> pb.Plan:
    """``plan`` with its digests: each variable's (in order), each chunk's, the manifest's; a
    provisional plan (``digests_follow``) becomes the complete one. Returns a new Plan."""
    out = pb.Plan()
    out.CopyFrom(plan)
    out.digests_follow = False
    for v, d in zip(out.variables, digests, strict=True):
        v.digest = d
    out.manifest_digest = manifest_digest(out.variables)
    del out.chunk_digests[:]
    out.chunk_digests.extend(chunks)
    return out


def check_completes(provisional: pb.Plan, complete: pb.Plan) -> None:
    """Raise ProtocolError unless ``complete`` lays out the bytes as ``provisional`` did, with
    the digests filled in: what a worker received under the provisional plan is checked against
    the complete one. (Who receives from whom may differ: a rejoin revises it.)"""
    def layout_of(plan: pb.Plan) -> tuple:
        variables = []
        for v in plan.variables:
            bare = pb.VariableInfo()
            bare.CopyFrom(v)
            bare.digest = ""
            variables.append(bare.SerializeToString(deterministic=True))
        return (plan.chief_incarnation, plan.total_bytes, plan.chunk_bytes, plan.model, variables,
                [g.SerializeToString(deterministic=True) for g in plan.groups])

    if complete.digests_follow or layout_of(complete) != layout_of(provisional):
        raise ProtocolError("the complete plan (with digests) does not lay out the bytes as the provisional plan "
                            "this worker received under did: the chief changed the round meanwhile")
    if len(complete.chunk_digests) != -(-complete.total_bytes // complete.chunk_bytes):
        raise ProtocolError(f"the complete plan lists {len(complete.chunk_digests)} chunk digests")


PIECE_BYTES = 4 << 20
"""Messages that grow with the model (the plan, a ready report) go in pieces of this size."""

MAX_PIECED_BYTES = 1 << 30
"""The largest message a receiver joins from pieces: a ready report of 8 devices x 4M chunks."""


def to_pieces(data: bytes, piece_bytes: int = PIECE_BYTES) -> Iterator[pb.Piece]:
    """A serialized message cut into pieces, in order (one empty piece for an empty message)."""
    view = memoryview(data)
    for start in range(0, max(len(data), 1), piece_bytes):
        yield pb.Piece(data=bytes(view[start : start + piece_bytes]), total_bytes=len(data))


def from_pieces(cls, pieces: Iterable[pb.Piece], sender: str, *, max_bytes: int = MAX_PIECED_BYTES):
    """The ``cls`` message joined from ``pieces``. Raises ProtocolError, naming ``sender``, when
    pieces are missing, disagree on the size, pass ``max_bytes`` or do not parse as ``cls``."""
    what = cls.DESCRIPTOR.name
    parts, got, claimed, count = [], 0, None, 0
    for piece in pieces:
        count += 1
        claimed = piece.total_bytes if claimed is None else claimed
        got += len(piece.data)
        if piece.total_bytes != claimed or got > claimed or claimed > max_bytes:
            raise ProtocolError(
                f"{sender} sent a {what} in pieces that claim {piece.total_bytes} bytes after {claimed} "
                f"(at most {max_bytes}) and carry {got}"
            )
        parts.append(piece.data)
    if claimed is None or got != claimed:
        raise ProtocolError(f"{sender} sent {got} bytes of a {what} of {claimed if claimed is not None else '?'} bytes in {count} piece(s)")
    try:
        return cls.FromString(b"".join(parts))
    except DecodeError as exc:
        raise ProtocolError(f"{sender} sent {got} bytes that are not a {what}: {exc}") from None


def _trainable(spec: VariableSpec) -> bool:
    if spec.trainable is not None:
        return spec.trainable
    return spec.synchronization is not Synchronization.ON_READ


def declared(specs: Sequence[VariableSpec]) -> list[pb.VariableInfo]:
    """The declaration a worker sends at join: names, shapes, dtypes and modes.

    Raises InvalidVariableError naming the variable when a spec could not go on the wire or be
    a model (``collective.model.check_specs``)."""
    check_specs(specs)
    return [
        pb.VariableInfo(
            name=s.name, shape=list(s.shape), dtype=s.dtype, synchronization=s.synchronization.name,
            aggregation=s.aggregation.name, trainable=_trainable(s),
        )
        for s in specs
    ]


def check_declared(worker: Sequence[pb.VariableInfo]) -> None:
    """A worker's declaration, as received, obeys the rules of a model's variables (known modes,
    a numpy dtype, ``check_specs``). Raises InvalidVariableError naming the first variable that
    breaks one, before anything compares or describes it."""
    specs = []
    for v in worker:
        try:
            specs.append(spec_of(v))
        except ValueError as exc:
            raise InvalidVariableError(f"variable {v.name!r}: {exc}") from None
    check_specs(specs)


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
    out += [f"{name}: chief (missing) vs worker {_declared(v)}" for name, v in theirs.items() if name not in mine]
    return out


def _declared(v: pb.VariableInfo) -> str:
    try:
        return spec_of(v).describe()
    except ValueError as exc:
        return f"(an invalid declaration: {exc})"


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
    if not _variables_valid(plan):
        _explain_invalid_variables(plan)  # raises, naming the first bad variable
        raise ProtocolError("plan variables are inconsistent")
    chunks = -(-plan.total_bytes // plan.chunk_bytes)
    if plan.digests_follow:
        if plan.manifest_digest or plan.chunk_digests or any(v.digest for v in plan.variables if v.nbytes):
            raise ProtocolError("plan says its digests follow, yet carries some")
    elif manifest_digest(plan.variables) != plan.manifest_digest:
        raise ProtocolError("plan manifest digest does not match its variables")
    elif len(plan.chunk_digests) != chunks:
        raise ProtocolError(f"plan lists {len(plan.chunk_digests)} chunk digests for its {chunks} chunks")
    _validate_parents(plan)
    if plan.HasField("shard"):
        _validate_shard(plan)


def _validate_shard(plan: pb.Plan) -> None:
    """A sharded plan's pieces fit its variables: one each, a row range of the whole variable
    (``dim0``) whose rows are the variable's local shape, or the whole variable (``all``)."""
    shard = plan.shard
    if not 0 <= shard.index < shard.world or len(shard.pieces) != len(plan.variables):
        raise ProtocolError(f"plan shard {shard.index} of {shard.world} lists {len(shard.pieces)} pieces for "
                            f"{len(plan.variables)} variables")
    if plan.topology not in ("", "star"):
        raise ProtocolError(f"a sharded plan is a star, not a {plan.topology}")
    for v, p in zip(plan.variables, shard.pieces, strict=True):
        whole = list(p.shape)
        if p.placement == "dim0" and whole and 0 <= p.row_start <= p.row_stop <= whole[0]:
            local = [p.row_stop - p.row_start, *whole[1:]]
        elif p.placement == "all":
            local = whole
        else:
            raise ProtocolError(f"plan variable {v.name!r}: shard piece {p.placement!r} rows "
                                f"{p.row_start}..{p.row_stop} of shape {tuple(whole)} is not a piece")
        if list(v.shape) != local:
            raise ProtocolError(f"plan variable {v.name!r}: shape {tuple(v.shape)} is not its piece's "
                                f"{tuple(local)}")


def _dtype_allowed(text: str) -> bool:
    # Only numpy's canonical ``dtype.str`` forms (``<f4``, ``|b1``) of plain numbers are accepted,
    # and the names of the extended types (``bfloat16``, ``float8_e4m3fn``: collective.dtypes).
    if text in dtypes.EXTENDED:
        return True
    if not _CANONICAL_DTYPE.fullmatch(text):
        return False
    try:
        dt = np.dtype(text)
    except (TypeError, ValueError, SyntaxError):
        return False
    return dt.str == text and dt.kind in _ALLOWED_KINDS and dt.fields is None


def _modes_allowed(sync: str, agg: str) -> bool:
    try:
        Synchronization.parse(sync)
        Aggregation.parse(agg)
    except ValueError:
        return False
    return True


def _variables_valid(plan: pb.Plan) -> bool:
    """Every rule of ``_explain_invalid_variables`` checked column by column: a plan of 20,000
    variables is checked in a few milliseconds, since dtypes and modes repeat."""
    vs = plan.variables
    names = [v.name for v in vs]
    if not all(names) or len(set(names)) != len(names):
        return False
    if len({v.instance_key for v in vs}) != len(vs):
        return False
    if not {v.group_key for v in vs} <= {g.group_key for g in plan.groups}:
        return False
    texts = [v.dtype for v in vs]
    itemsize = {}
    for text in set(texts):
        if not _dtype_allowed(text):
            return False
        itemsize[text] = dtypes.from_wire(text).itemsize
    if not all(_modes_allowed(s, a) for s, a in {(v.synchronization, v.aggregation) for v in vs}):
        return False
    end = 0
    for v, dtype in zip(vs, texts, strict=True):
        shape, offset, nbytes = v.shape, v.offset, v.nbytes
        if (shape and min(shape) < 0) or math.prod(shape) * itemsize[dtype] != nbytes or offset < end:
            return False
        end = offset + nbytes
        if not nbytes and v.digest != _EMPTY_DIGEST:
            return False
    return end <= plan.total_bytes


def _explain_invalid_variables(plan: pb.Plan) -> None:
    """Raise ProtocolError naming the first variable that breaks a rule of the plan."""
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
        # Only numpy's canonical ``dtype.str`` forms (``<f4``, ``|b1``) and the extended types'
        # names (``bfloat16``) are accepted on the wire.
        if v.dtype not in dtypes.EXTENDED and not _CANONICAL_DTYPE.fullmatch(v.dtype):
            raise ProtocolError(f"{where}: invalid dtype {v.dtype!r}")
        try:
            dt = dtypes.from_wire(v.dtype)
        except (TypeError, ValueError, SyntaxError) as exc:
            raise ProtocolError(f"{where}: invalid dtype {v.dtype!r}") from exc
        if dtypes.wire(dt) != v.dtype:
            raise ProtocolError(f"{where}: dtype {v.dtype!r} is not in numpy's canonical form {dt.str!r}")
        try:
            Synchronization.parse(v.synchronization, variable=v.name)
            Aggregation.parse(v.aggregation, variable=v.name)
        except ValueError as exc:
            raise ProtocolError(f"{where}: {exc}") from exc
        if (dt.kind not in _ALLOWED_KINDS and not dtypes.is_extended(dt)) or dt.fields is not None:
            raise ProtocolError(f"{where}: dtype {v.dtype!r} is not allowed on the wire")
        if any(d < 0 for d in v.shape):
            raise ProtocolError(f"{where}: negative dimension in shape {tuple(v.shape)}")
        expected = math.prod(v.shape) * dt.itemsize  # exact integers: no rounding for huge shapes
        if expected != v.nbytes:
            raise ProtocolError(f"{where}: {v.nbytes} bytes do not fit shape {tuple(v.shape)} {dt.name}")
        if v.offset < end or v.offset + v.nbytes > plan.total_bytes:
            raise ProtocolError(f"{where}: bytes {v.offset}..{v.offset + v.nbytes} overlap or pass the arena end")
        if not v.nbytes and v.digest != _EMPTY_DIGEST:
            raise ProtocolError(f"{where}: an empty variable's digest must be {_EMPTY_DIGEST}, not {v.digest!r}")
        end = v.offset + v.nbytes
        names.add(v.name)
        ikeys.add(v.instance_key)


def _validate_parents(plan: pb.Plan) -> None:
    """Every worker's parents lead to the chief, through relays that exist. (A plan without a
    topology, from an older chief, is a star whatever its parents say.)"""
    if not plan.topology:
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

    def __init__(self, plan: pb.Plan, arena, known: Sequence[str] | None = None) -> None:
        """``arena``: a flat array, or an object whose ``slice(start, end)`` returns the bytes
        (``collective.shards.ShardView``). ``known``: the chunk digests verified so far (a relay's Receiver's, growing as the
        stream lands), the trailers of a provisional plan (``digests_follow``); without them
        each chunk is hashed as it is first sent, once for every stream of this Chunker."""
        self._plan = plan
        if hasattr(arena, "slice"):  # a shard's bytes where they lie in the model (collective.shards.ShardView)
            self._slice = arena.slice
        else:
            flat = memoryview(arena.reshape(-1).view(np.uint8))
            self._slice = lambda start, end: flat[start:end]
        self._frames = _frames(plan)
        self._known = known
        self._hashed: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._frames)

    def chunks(self) -> Iterator[pb.Chunk]:
        """Yield the stream's messages; the last one carries the stream end."""
        return with_bytes(self.frames())

    def frames(self, start: int = 0, landed=None) -> Iterator[tuple[pb.Chunk, memoryview]]:
        """Each message without its bytes, and a view of those bytes in the arena; from the
        message at offset ``start`` (a receiver resuming: ``WorkerRef.resume_from``) on.
        ``landed(end)``: returns once the arena holds every byte below ``end`` (a relay's, as
        its own stream arrives), called before each message is made.

        For transports that send the bytes themselves without a copy (MPI's Bcast).
        """
        for msg, first, end in frame_messages(self._plan):
            if first >= start:
                if landed is not None:
                    landed(end)
                data = self._slice(first, end)
                if not msg.digest and end > first:  # a provisional plan: the trailer is the chunk's own digest
                    msg.digest = self._trailer(first, data)
                yield msg, data

    def _trailer(self, start: int, data: memoryview) -> str:
        i = start // self._plan.chunk_bytes
        if self._known is not None and i < len(self._known):
            return self._known[i]
        digest = self._hashed.get(i)
        if digest is None:
            digest = self._hashed[i] = bytes_digest(data)
        return digest


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
        msg = pb.Chunk(offset=f.start, group_key=f.group_key, instance_keys=f.instance_keys, digest=f.digest)
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


def culprit(
    plan: pb.Plan, arena: np.ndarray, start: int, end: int, *, upto: int | None = None,
    replica: tuple[int, str] | None = None, digests: tuple[str, str] | None = None,
) -> str:
    """Why the bytes ``start..end`` of ``arena`` differ from the chief's, naming the variable.

    Each variable overlapping the range whose bytes all lie below ``upto`` (default: the arena
    end) is hashed and compared with its own digest in the plan; the first that differs is named
    with both digests. A variable that continues past ``upto`` cannot be hashed yet: it is named
    as the owner of the differing bytes. Only the padding between variables is left otherwise.
    ``replica`` (index, device): the arena holds that replica of every variable, not bytes just
    received. ``digests`` (got, chief's) of the whole range are quoted when no variable could be
    hashed on its own.
    """
    upto = plan.total_bytes if upto is None else upto
    flat = arena.reshape(-1).view(np.uint8)
    partial = []
    for v in overlapping(plan, start, end):
        if v.offset + v.nbytes > upto:
            partial.append(v)
            continue
        got = bytes_digest(memoryview(flat[v.offset : v.offset + v.nbytes]))
        if got != v.digest and replica is not None:
            name = replica_name(v.name, replica[0])
            return f"variable {v.name!r}: replica {name!r} on {replica[1]} has digest {got}, the chief's is {v.digest}"
        if got != v.digest:
            return f"variable {v.name!r}: digest of received bytes {got} differs from the chief's {v.digest}"
    quoted = f": chunk digest {digests[0]}, the chief's {digests[1]}" if digests else ""
    if partial:
        v = partial[0]
        return (
            f"variable {v.name!r}: its bytes {max(start, v.offset) - v.offset}..{min(end, v.offset + v.nbytes) - v.offset} "
            f"(in the chunk at offset {start}) differ from the chief's{quoted}"
        )
    return f"the padding between variables in bytes {start}..{end} differs from the chief's{quoted}"


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


class Receiver:
    """Writes a stream into a worker's arena and checks it against the plan.

    ``accept`` raises ProtocolError for keys or offsets the plan does not allow, and
    IntegrityError (naming the variable) for a chunk whose bytes differ from the chief's. Every
    chunk is hashed once, whatever the number of variables it fuses. ``finish`` raises
    IntegrityError unless the stream ended properly with every byte verified.
    """

    def __init__(self, plan: pb.Plan, arena: np.ndarray) -> None:
        self._plan = self.plan = plan
        self._arena = arena.reshape(-1).view(np.uint8)
        self._frames = {f.start: f for f in _frames(plan)}
        self._keys = {v.instance_key for v in plan.variables}
        self._groups = {g.group_key for g in plan.groups}
        self._ends = sorted(v.offset + v.nbytes for v in plan.variables)
        self._pos = 0
        self._ended = False
        self.digests: list[str] = []  # of every chunk verified so far, in order

    @property
    def bytes_received(self) -> int:
        return self._pos

    @property
    def variables_verified(self) -> int:
        """Variables whose every byte has arrived in verified chunks."""
        return len(self._ends) if self._ended else bisect.bisect_right(self._ends, self._pos)

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
        frame = self._frames.get(chunk.offset)
        if chunk.offset != self._pos or frame is None:
            raise ProtocolError(f"chunk at offset {chunk.offset} arrived where offset {self._pos} was expected")
        if not placed and len(chunk.data) != frame.end - frame.start:
            raise IntegrityError(
                f"chunk at offset {chunk.offset} has {len(chunk.data)} bytes; the plan says {frame.end - frame.start}"
            )
        keys = tuple(chunk.instance_keys)
        if keys != frame.instance_keys:
            unknown = [k for k in keys if k not in self._keys]
            if unknown:
                raise ProtocolError(f"chunk at offset {chunk.offset} has instance key {unknown[0]}, not in the plan")
            raise ProtocolError(
                f"chunk at offset {chunk.offset} names instance keys {list(keys)[:8]}; "
                f"the plan puts {list(frame.instance_keys)[:8]} there"
            )
        if chunk.data and not placed:
            self._arena[frame.start : frame.end] = np.frombuffer(chunk.data, dtype=np.uint8)
        if frame.end > frame.start:
            self._check_chunk(chunk, frame)
        elif chunk.digest:
            raise ProtocolError(f"message at offset {chunk.offset} has no bytes but claims digest {chunk.digest}")
        self._pos = frame.end
        if chunk.HasField("end"):
            self._check_end(chunk.end)

    def _check_chunk(self, chunk: pb.Chunk, frame: _ChunkFrame) -> None:
        """The chunk's trailer: its bytes' digest against the plan's (and the sender's claim).

        A provisional plan (``digests_follow``) has no chunk digests yet: the bytes are checked
        against the trailer, and against the chief's digests once they come (``complete``)."""
        got = bytes_digest(memoryview(self._arena[frame.start : frame.end]))
        if not frame.digest:
            if not chunk.digest:
                raise ProtocolError(f"chunk at offset {chunk.offset} has no digest trailer; the plan's digests "
                                    f"follow the stream, so every chunk must carry its own")
            if got != chunk.digest:
                names = ", ".join(repr(v.name) for v in overlapping(self._plan, frame.start, frame.end)[:3]) or "padding"
                raise IntegrityError(f"chunk at offset {chunk.offset} (bytes of {names}): digest of received bytes "
                                     f"{got} differs from its trailer {chunk.digest}")
        elif got != frame.digest:
            raise IntegrityError(
                culprit(self._plan, self._arena, frame.start, frame.end, upto=frame.end, digests=(got, frame.digest))
            )
        elif chunk.digest != frame.digest:
            raise IntegrityError(
                f"chunk at offset {chunk.offset}: its trailer says digest {chunk.digest or '(none)'}, "
                f"the plan and the received bytes say {frame.digest}"
            )
        self.digests.append(got)

    def complete(self, plan: pb.Plan) -> None:
        """The complete plan of a provisional one (``check_completes``): every chunk received
        so far against the chief's digests. Raises IntegrityError naming the variable."""
        differs = differing_chunk(plan, self.digests, plan.chunk_digests[: len(self.digests)])
        if differs is not None:
            k = differs[0] // plan.chunk_bytes
            raise IntegrityError(culprit(plan, self._arena, *differs, upto=self._pos,
                                         digests=(self.digests[k], plan.chunk_digests[k])))
        self._plan = self.plan = plan
        self._frames = {f.start: f for f in _frames(plan)}

    def _check_end(self, end: pb.StreamEnd) -> None:
        if end.total_bytes != self._plan.total_bytes or self._pos != self._plan.total_bytes:
            raise IntegrityError(
                f"stream end claims {end.total_bytes} bytes after {self._pos} received; "
                f"the plan has {self._plan.total_bytes}"
            )
        # An empty one: the sender's plan or this one is provisional (``digests_follow``).
        if end.manifest_digest and self._plan.manifest_digest and end.manifest_digest != self._plan.manifest_digest:
            raise IntegrityError("stream end carries a manifest digest that differs from the plan's")
        self._ended = True

    def finish(self) -> None:
        """Raise IntegrityError unless the whole stream arrived, verified, with its end message."""
        if not self._ended:
            if self._pos == self._plan.total_bytes:
                raise IntegrityError(
                    f"stream ended without its end message (total and manifest digest) after all "
                    f"{self._pos} bytes; a stream that does not end properly is never taken as complete"
                )
            first = next((v.name for v in self._plan.variables if v.offset + v.nbytes > self._pos), "-")
            missing = len(self._ends) - self.variables_verified
            raise IntegrityError(
                f"stream ended early: {self._pos} of {self._plan.total_bytes} bytes, "
                f"{missing} variable(s) unverified (first: {first})"
            )
