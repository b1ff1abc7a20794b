"""Shards: a plan that gives each training rank a part of the model instead of a whole replica.

What a caller asks for (``collective.sync(values, shards=...)``, ``serve(..., shards=...)``):

* ``"dim0"``: every variable is cut along dimension 0 over the world, as torch's DTensor
  ``Shard(0)`` (FSDP2's ``fully_shard``) cuts it, with ``torch.chunk``'s rule: rows per rank
  ``c = ceil(n / W)``; rank ``r`` holds rows ``min(n, r*c)..min(n, (r+1)*c)``, so the last
  ranks' shards may be shorter or empty. A 0-d variable has no dimension 0: every rank holds it
  whole (DTensor's ``Replicate``).
* a mapping name -> placement: ``"dim0"``, ``"all"`` (every rank holds it whole), a rank, or a
  list of ranks (each holds it whole); the key ``"*"`` places every variable not named. Every
  variable needs a placement; a name that is not a variable, or a rank outside ``0..W-1``, is a
  UsageError.

Ranks are training ranks: with ``sync`` the chief is rank 0 and holds shard 0 itself; a chief
that does not train serves ``W = workers`` shards, worker rank ``k`` holding shard ``k``.

How it travels: the chief still materialises the whole model, then copies each rank's pieces
into that rank's own arena (``ShardedArenas``, about one more model of memory on the chief).
Each worker gets a plan of its own (``plan_for``): its pieces as the plan's variables (local
shapes, their own digests), its arena's chunk digests and ``Plan.shard`` (the whole shapes and
row ranges), so the Chunker, Receiver, replicas and ready report work unchanged on it and a
worker receives only its bytes. Sharded rounds are star-shaped (a relay forwards its own stream,
not another rank's) and never use the same-host shared arena (it is the whole model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from collective._proto import collective_pb2 as pb
from collective.digest import bytes_digest, chunk_digests
from collective.errors import UsageError
from collective.model import VariableSpec
from collective.plan import layout, manifest_digest

DIM0, ALL = "dim0", "all"


def rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``start..stop`` of dimension 0 (length ``n``) that ``rank`` of ``world`` holds:
    torch's ``Shard(0)`` / ``torch.chunk`` rule (uneven last shards, possibly empty)."""
    c = -(-n // world)
    return min(n, rank * c), min(n, (rank + 1) * c)


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one variable: rows ``start..stop`` of dim 0 (``dim0``) or all of it."""

    index: int  # the variable's position in the model
    placement: str  # DIM0 or ALL
    start: int
    stop: int


@dataclass(frozen=True)
class Placement:
    """What a process holds of a variable, as ``SyncResult.shards`` tells it."""

    placement: str  # "dim0" or "all"
    shape: tuple[int, ...]  # the whole variable's
    rows: tuple[int, int]  # the rows of dimension 0 held (all of them for "all"; (0, 0) for a 0-d one)


def _placement(name: str, value, world: int) -> str | tuple[int, ...]:
    if isinstance(value, str):
        if value in (DIM0, ALL):
            return value
        raise UsageError(f"shards: variable {name!r}: unknown placement {value!r}; use 'dim0', 'all', a rank "
                         f"or a list of ranks")
    ranks = [value] if isinstance(value, int | np.integer) else value
    try:
        ranks = sorted({int(r) for r in ranks})
    except (TypeError, ValueError):
        raise UsageError(f"shards: variable {name!r}: {value!r} is not a placement ('dim0', 'all', a rank "
                         f"or a list of ranks)") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise UsageError(f"shards: variable {name!r}: rank {bad[0] if bad else '(none)'} is out of range: "
                         f"{world} training rank(s) are 0..{world - 1}")
    return tuple(ranks)


def normalize(request, names: Sequence[str], world: int) -> dict[str, str | tuple[int, ...]]:
    """Each variable's placement (``"dim0"``, ``"all"`` or the ranks holding it whole) from a
    request (``"dim0"`` or a mapping). Raises UsageError for a request that cannot be met."""
    if world < 1:
        raise UsageError(f"shards: the world has {world} training ranks")
    if isinstance(request, str):
        if request != DIM0:
            raise UsageError(f"shards: unknown request {request!r}; use 'dim0' or a mapping name -> placement")
        request = {"*": DIM0}
    if not isinstance(request, Mapping):
        raise UsageError(f"shards: {type(request).__name__} is not 'dim0' or a mapping name -> placement")
    known = set(names)
    unknown = [n for n in request if n != "*" and n not in known]
    if unknown:
        raise UsageError(f"shards: {len(unknown)} name(s) are not variables of the model: "
                         f"{', '.join(map(repr, unknown[:5]))}")
    default = request.get("*")
    missing = [n for n in names if n not in request and default is None]
    if missing:
        raise UsageError(f"shards: {len(missing)} variable(s) have no placement (add them, or '*'): "
                         f"{', '.join(map(repr, missing[:5]))}")
    return {n: _placement(n, request.get(n, default), world) for n in names}


def assign(specs: Sequence[VariableSpec], request, world: int) -> list[list[Piece]]:
    """Each rank's pieces, in model order."""
    placements = normalize(request, [s.name for s in specs], world)
    out: list[list[Piece]] = [[] for _ in range(world)]
    for i, s in enumerate(specs):
        p = placements[s.name]
        for r in range(world):
            if p == DIM0 and s.shape:
                out[r].append(Piece(i, DIM0, *rows(s.shape[0], world, r)))
            elif p in (DIM0, ALL) or r in p:
                out[r].append(Piece(i, ALL, 0, s.shape[0] if s.shape else 0))
    return out


def local_spec(spec: VariableSpec, piece: Piece) -> VariableSpec:
    """The spec of what a rank holds: the piece's rows."""
    if piece.placement == ALL:
        return spec
    shape = (piece.stop - piece.start, *spec.shape[1:])
    return VariableSpec(spec.name, shape, spec.dtype, spec.synchronization, spec.aggregation, spec.trainable)


class ShardedArenas:
    """The chief's side: each rank's pieces copied out of the whole arena into an arena of its
    own (the layout of ``collective.plan.layout`` over its local specs), with their digests."""

    def __init__(self, specs: Sequence[VariableSpec], arena: np.ndarray, request, world: int,
                 chunk_bytes: int) -> None:
        self.world, self.chunk_bytes = world, chunk_bytes
        self.pieces = assign(specs, request, world)
        self._specs = list(specs)
        offsets, self.model_bytes = layout(specs)
        flat = arena.reshape(-1).view(np.uint8)
        self.arenas: list[np.ndarray] = []
        self.local: list[list[tuple[VariableSpec, int, str]]] = []  # (local spec, offset, digest) per rank
        for pieces in self.pieces:
            local = [local_spec(specs[p.index], p) for p in pieces]
            local_offsets, total = layout(local)
            out = np.zeros(total, dtype=np.uint8)
            entries = []
            for p, spec, off in zip(pieces, local, local_offsets, strict=True):
                whole = specs[p.index]
                row = whole.nbytes // whole.shape[0] if whole.shape and whole.shape[0] else 0
                src = offsets[p.index] + (p.start * row if p.placement == DIM0 else 0)
                out[off : off + spec.nbytes] = flat[src : src + spec.nbytes]
                entries.append((spec, off, bytes_digest(memoryview(out[off : off + spec.nbytes]))))
            self.arenas.append(out)
            self.local.append(entries)
        self.chunk_digests = [chunk_digests(a, chunk_bytes) for a in self.arenas]

    def plan_for(self, base: pb.Plan, index: int) -> pb.Plan:
        """Shard ``index``'s own plan: ``base`` (the round's plan of the whole model: workers,
        groups, keys) with this rank's pieces as its variables and its arena's chunks."""
        by_name = {v.name: v for v in base.variables}
        variables = []
        for spec, off, digest in self.local[index]:
            v = pb.VariableInfo()
            v.CopyFrom(by_name[spec.name])
            del v.shape[:]
            v.shape.extend(spec.shape)
            v.offset, v.nbytes, v.digest = off, spec.nbytes, digest
            variables.append(v)
        plan = pb.Plan(
            chief_incarnation=base.chief_incarnation, num_workers=base.num_workers, workers=base.workers,
            groups=base.groups, variables=variables, total_bytes=int(self.arenas[index].nbytes),
            chunk_bytes=base.chunk_bytes, manifest_digest=manifest_digest(variables),
            model=base.model, topology=base.topology, chunk_digests=self.chunk_digests[index],
        )
        plan.shard.index, plan.shard.world = index, self.world
        plan.shard.model_manifest_digest, plan.shard.model_bytes = base.manifest_digest, self.model_bytes
        for p in self.pieces[index]:
            plan.shard.pieces.add(shape=self._specs[p.index].shape, row_start=p.start, row_stop=p.stop,
                                  placement=p.placement)
        return plan


def placements(plan: pb.Plan) -> dict[str, Placement] | None:
    """Name -> what this process holds of the variable, for a sharded plan; None otherwise."""
    if not plan.HasField("shard"):
        return None
    return {
        v.name: Placement(p.placement, tuple(p.shape), (p.row_start, p.row_stop))
        for v, p in zip(plan.variables, plan.shard.pieces, strict=True)
    }
