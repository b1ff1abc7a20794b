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

``Groups(request, shard_of)`` cuts the model over ``S`` shards and gives training rank ``r``
shard ``shard_of[r]`` (``0..S-1``, each used): the ranks of one shard hold the same pieces. That
is HSDP (FSDP2 on a 2-D mesh, ``(Replicate(), Shard(0))``): each replica group holds the whole
model, cut over its ``S`` ranks; ranks placed by ``request`` are then shards, not training ranks.

How it travels: the chief materialises the whole model (or maps its files: ``--from-file``) and
serves each rank's pieces from where they lie in it (``ShardedArenas``, an ``arena.ScatterView`` each: a piece
is one contiguous range, rows of dimension 0; a chunk that spans two pieces is gathered, no
more), so the chief holds the model once. Each worker gets a plan of its own (``plan_for``): its pieces as the plan's variables (local
shapes, their own digests), its arena's chunk digests and ``Plan.shard`` (the whole shapes and
row ranges), so the Chunker, Receiver, replicas and ready report work unchanged on it and a
worker receives only its bytes. Sharded rounds are star-shaped (a relay forwards its own stream,
not another rank's) and never use the same-host shared arena (it is the whole model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from collective._proto import collective_pb2 as pb
from collective.arena import ScatterView
from collective.digest import bytes_digest
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


@dataclass(frozen=True)
class Groups:
    """A request cut over ``S`` shards, training rank ``r`` holding shard ``shard_of[r]``."""

    request: object  # "dim0" or a mapping name -> placement, over the S shards
    shard_of: tuple[int, ...]

    @property
    def shards(self) -> int:
        return max(self.shard_of) + 1 if self.shard_of else 0

    def check(self, world: int) -> None:
        """Raise UsageError unless every training rank has a shard and every shard a rank."""
        if len(self.shard_of) != world:
            raise UsageError(f"shards: {len(self.shard_of)} shard indices for {world} training rank(s)")
        if sorted(set(self.shard_of)) != list(range(self.shards)):
            raise UsageError(f"shards: the shard indices {sorted(set(self.shard_of))} are not 0..S-1 each held "
                             f"by some rank")


def _grouped(request, world: int) -> tuple[object, list[int], int]:
    """(the request over the shards, each training rank's shard, the number of shards): from
    ``Groups`` (checked against ``world``), else each rank its own shard."""
    if isinstance(request, Groups):
        request.check(world)
        return request.request, list(request.shard_of), request.shards
    return request, list(range(world)), world


def normalize(request, names: Sequence[str], world: int) -> dict[str, str | tuple[int, ...]]:
    """Each variable's placement (``"dim0"``, ``"all"`` or the ranks holding it whole) from a
    request (``"dim0"``, a mapping, or ``Groups``: then over its shards). Raises UsageError for
    a request that cannot be met."""
    if isinstance(request, Groups):
        request, _, world = _grouped(request, world)
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
    """Each shard's pieces, in model order: with ``Groups`` one list per shard, else per rank
    (each rank its own shard)."""
    request, _, world = _grouped(request, world)
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
    """The chief's side: each rank's pieces, read where they lie in the whole model's arena
    (``arena.ScatterView``: nothing is copied), with their digests and each rank's chunk digests.

    ``offsets``: where each variable lies in ``arena`` (default: ``collective.plan.layout``; a
    model served from its files has the files' offsets). ``drop(start, end)``: called for each
    range of ``arena`` once hashed (a mapped file's pages leave the chief)."""

    def __init__(self, specs: Sequence[VariableSpec], arena: np.ndarray, request, world: int,
                 chunk_bytes: int, *, offsets: Sequence[int] | None = None,
                 drop: Callable[[int, int], None] | None = None) -> None:
        self.world, self.chunk_bytes = world, chunk_bytes
        _, self.shard_of, self.shards = _grouped(request, world)
        by_shard = assign(specs, request, world)  # each shard laid out and hashed once, whatever its ranks
        self.pieces = [by_shard[i] for i in self.shard_of]
        self._specs = list(specs)
        flat = arena.reshape(-1).view(np.uint8)
        if offsets is None:
            offsets, self.model_bytes = layout(specs)
        else:
            self.model_bytes = int(flat.nbytes)
        views: list[ScatterView] = []
        local_entries: list[list[tuple[VariableSpec, int, str]]] = []
        chunks: list[list[str]] = []
        for pieces in by_shard:
            local = [local_spec(specs[p.index], p) for p in pieces]
            local_offsets, total = layout(local)
            segments, entries = [], []
            for p, spec, off in zip(pieces, local, local_offsets, strict=True):
                whole = specs[p.index]
                row = whole.nbytes // whole.shape[0] if whole.shape and whole.shape[0] else 0
                src = offsets[p.index] + (p.start * row if p.placement == DIM0 else 0)
                segments.append((off, src, spec.nbytes))
                entries.append((spec, off, bytes_digest(memoryview(flat[src : src + spec.nbytes]))))
                if drop is not None:
                    drop(src, src + spec.nbytes)
            view = ScatterView.within(flat, segments, total)
            digests = []
            for start in range(0, total, chunk_bytes):
                end = min(start + chunk_bytes, total)
                digests.append(bytes_digest(view.slice(start, end)))
                if drop is not None:
                    for a, b in view.sources(start, end):
                        drop(a, b)
            views.append(view)
            local_entries.append(entries)
            chunks.append(digests)
        # Per training rank: its shard's.
        self.views: list[ScatterView] = [views[i] for i in self.shard_of]
        self.local = [local_entries[i] for i in self.shard_of]  # (local spec, offset, digest)
        self.chunk_digests = [chunks[i] for i in self.shard_of]

    def plan_for(self, base: pb.Plan, index: int) -> pb.Plan:
        """Training rank ``index``'s own plan (its shard's: ``Plan.shard``): ``base`` (the round's plan of the whole model: workers,
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
            groups=base.groups, variables=variables, total_bytes=int(self.views[index].nbytes),
            chunk_bytes=base.chunk_bytes, manifest_digest=manifest_digest(variables),
            model=base.model, topology=base.topology, chunk_digests=self.chunk_digests[index],
        )
        plan.shard.index, plan.shard.world = self.shard_of[index], self.shards
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
