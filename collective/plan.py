"""The broadcast plan: arena layout, keys, chunking, and the checks of a plan and of declarations.

All variables are laid out back to back (64-byte aligned) in one *arena*. The data stream is the
arena cut into chunks of at most ``chunk_bytes``: many small variables fuse into one chunk (a
bucket) and a large variable spans many. Each chunk names the instance keys of the variables it
carries and carries its trailer, the digest of its bytes, which the plan lists too
(``chunk_digests``); the last message carries the stream end (total bytes + manifest digest).
The stream itself, the ``Chunker`` that cuts it and the ``Receiver`` that checks it, are in
``collective.stream``; their names are imported here too, where the rest of the package looks
for them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from google.protobuf.message import DecodeError

from collective import dtypes
from collective import keys as keymod
from collective._proto import collective_pb2 as pb
from collective.digest import bytes_digest, chunk_digests, combined_digest
from collective.errors import InvalidVariableError, ProtocolError
from collective.model import Aggregation, Synchronization, VariableSpec, check_specs
from collective.stream import (  # noqa: F401  (re-exported: the package imports them from here)
    Chunker,
    ChunkRange,
    Lockstep,
    Receiver,
    culprit,
    differing_chunk,
    frame_messages,
    overlapping,
    with_bytes,
)

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


def parent_in(w: pb.WorkerInfo, tree: int) -> int:
    """Whom ``w`` receives tree ``tree``'s chunks from: ``parent_b`` for a double tree's second
    (when it has one: a worker mapping its host leader's arena has one parent), else ``parent``."""
    return w.parent_b if tree == 1 and w.HasField("parent_b") else w.parent


def sibling_streams(plan: pb.Plan, worker_id: str, rng: ChunkRange) -> int:
    """How many selected streams the sender of the stream ``rng`` to ``worker_id`` serves
    under ``plan`` (``Lockstep``): a double tree's chief its two roots, a relay its children in
    its tree; 1 for a whole stream or a worker the plan does not name."""
    child = next((w for w in plan.workers if w.worker_id == worker_id), None)
    if rng.stride <= 1 or child is None:
        return 1
    sender = parent_in(child, rng.phase)
    return sum(parent_in(w, t) == sender for w in plan.workers if w.HasField("parent_b") for t in (0, 1))


def trees_of(plan: pb.Plan) -> int:
    """How many trees carry the plan's chunks: two when any worker has a second parent."""
    return 2 if any(w.HasField("parent_b") for w in plan.workers) else 1


def _validate_parents(plan: pb.Plan) -> None:
    """Every worker's parents, in each tree, lead to the chief, through relays that exist. (A
    plan without a topology, from an older chief, is a star whatever its parents say.)"""
    if not plan.topology:
        return
    by_rank = {w.rank: w for w in plan.workers}
    for tree in range(trees_of(plan)):
        which = " in tree B" if tree else ""
        for w in plan.workers:
            seen, node = set(), w
            while parent_in(node, tree) != -1:
                parent = by_rank.get(parent_in(node, tree))
                if parent is None or node.rank in seen:
                    raise ProtocolError(f"plan worker rank {w.rank}: its parents{which} do not lead to the chief")
                if not parent.relay_address:
                    raise ProtocolError(f"plan worker rank {parent.rank} relays to rank {node.rank}{which} "
                                        f"but has no relay address")
                seen.add(node.rank)
                node = parent
