"""The steps of a publication that follows a run (``Publication.update``): each new step's state
copied once, its element-level delta from the step before, and the two plans served for it.

What the publisher keeps: the state of the step it serves, once (a sealed memory file, the
baseline the next step's delta is made against), and that step's delta (about 2% of the state
at 1% of bf16 elements changed). During an update the new step's copy exists beside it until
the new step is served; a step just replaced stays readable until the fetches in progress of
it end (at most ``holder.CLOSE_GRACE`` s).

``copy_state`` runs on the caller's thread (the caller may change its tensors once it returns);
``finish`` (the deltas, the digests, the plans) on the publication's update thread. Only what
the step changed is hashed again: a tensor whose bytes did not change keeps its digest, a chunk
no delta touched keeps its chunk digest (the skeleton's chunks, at the arena's end, always
change: the skeleton holds the step).

A step's delta is served as a publication of its own (``delta_state``): a state whose tensors
are the changed tensors' coded deltas (``collective.delta``), in the plan's order, and whose
JSON says what it is a delta between: ``{"from": M, "to": N, "base": manifest of M,
"manifest": manifest of N, "names": [changed tensors], "deltas": [coded bytes], "tree": the
new skeleton's bytes}``. It is planned, chunked, digested and fetched like any state (striped
over holders, every chunk verified); its plan's ``model`` names it ``snapshot step N delta from
M``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from collective import dtypes
from collective._proto import collective_pb2 as pb
from collective.arena import SharedArena, new_arena
from collective.delta import SAME, make_delta, state_touched_chunks
from collective.digest import array_digest, chunk_digests
from collective.model import VariableSpec
from collective.plan import layout
from collective.replicas import variable_view
from collective.snapshot import tree

log = logging.getLogger(__name__)

DELTA_LABEL = " delta from "
"""A delta plan's ``model``: ``snapshot step N delta from M`` (then the holder's name)."""


@dataclass
class Copied:
    """One step's state, copied: its variables (the skeleton last) laid out in ``arena``."""

    step: int
    names: list[str]
    specs: list[VariableSpec]
    offsets: list[int]
    total: int
    arena: np.ndarray
    shared: SharedArena | None
    digests: list[str] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)


def _memfd_arena(total: int) -> SharedArena | None:
    """A ``SharedArena`` (a memfd, every page in place) for a copy, or None where this kernel
    or platform has none (then plain memory)."""
    try:
        return SharedArena(total, prefault=True)
    except (OSError, AttributeError) as exc:  # no memfd_create (not Linux) or no memory file left
        log.info("publish: no memory file for the copy (%s); same-host fetchers take the stream", exc)
        return None


def flat_arrays(state: Mapping, step: int) -> dict[str, np.ndarray]:
    """``state``'s tensors (contiguous) and, last, its skeleton's bytes (``tree.TREE``)."""
    skeleton, arrays = tree.flatten(state)
    out = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    out[tree.TREE] = tree.encode(skeleton, step)
    return out


def specs_of(arrays: Mapping[str, np.ndarray]) -> list[VariableSpec]:
    return [VariableSpec(n, tuple(int(d) for d in a.shape), dtypes.wire(a.dtype)) for n, a in arrays.items()]


def copy_state(state: Mapping, step: int) -> Copied:
    """``state`` at ``step`` copied into one arena (a memory file where there is one), the
    padding zeros. Nothing is hashed here."""
    arrays = flat_arrays(state, step)
    names, specs = list(arrays), specs_of(arrays)
    offsets, total = layout(specs)
    shared = _memfd_arena(total)
    arena = shared.array if shared is not None else new_arena(total)
    end = 0
    for n, off in zip(names, offsets, strict=True):
        arena[end:off] = 0  # the padding: zeros, as a ScatterView reads it (same chunk digests)
        arena[off : off + arrays[n].nbytes] = arrays[n].reshape(-1).view(np.uint8)
        end = off + arrays[n].nbytes
    arena[end:] = 0
    return Copied(step, names, specs, offsets, total, arena, shared)


def views(c: Copied) -> list[np.ndarray]:
    """Each variable of ``c`` as a typed array over its arena (no copy)."""
    return [c.arena[off : off + s.nbytes].view(dtypes.from_wire(s.dtype)).reshape(s.shape)
            for off, s in zip(c.offsets, c.specs, strict=True)]


def same_layout(a: Copied, b: Copied) -> bool:
    """Whether ``b``'s tensors are ``a``'s (names, shapes, dtypes, in order): its delta from
    ``a`` can be made (the skeletons, last, may differ in size)."""
    return a.specs[:-1] == b.specs[:-1]


def hash_all(c: Copied, chunk_bytes: int) -> None:
    """Every variable's and chunk's digest of ``c`` (a first step, or one without a delta)."""
    c.digests = [array_digest(c.arena[off : off + s.nbytes]) for off, s in zip(c.offsets, c.specs, strict=True)]
    c.chunks = chunk_digests(c.arena, chunk_bytes)


def deltas_between(base: Copied, new: Copied, chunk_bytes: int) -> tuple[list[str], list[bytes]]:
    """The coded deltas of ``new``'s tensors from ``base``'s (the changed ones: names and bytes,
    in the plan's order), with ``new``'s digests filled in: those of unchanged tensors and of
    chunks no delta touched carried over from ``base``, the rest hashed."""
    old_views, new_views = views(base), views(new)
    names, blobs, made, digests = [], [], [], []
    for i, name in enumerate(new.names[:-1]):
        d = make_delta(old_views[i], new_views[i])
        made.append(d)
        if d.kind == SAME:
            digests.append(base.digests[i])
            continue
        names.append(name)
        blobs.append(d.to_bytes())
        digests.append(array_digest(new.arena[new.offsets[i] : new.offsets[i] + new.specs[i].nbytes]))
    tree_off = new.offsets[-1]
    digests.append(array_digest(new.arena[tree_off : tree_off + new.specs[-1].nbytes]))
    touched = set(state_touched_chunks(made, new.offsets[:-1], chunk_bytes).tolist())
    first_tree_chunk = min(tree_off, base.offsets[-1]) // chunk_bytes
    chunks = []
    for c in range(-(-new.total // chunk_bytes)):
        if c in touched or c >= first_tree_chunk or c >= len(base.chunks):
            lo = c * chunk_bytes
            chunks.append(chunk_digests(new.arena[lo : min(lo + chunk_bytes, new.total)], chunk_bytes)[0])
        else:
            chunks.append(base.chunks[c])
    new.digests, new.chunks = digests, chunks
    return names, blobs


def delta_state(base_step: int, base_manifest: str, new_step: int, new_manifest: str, names: list[str],
                blobs: list[bytes], tree_bytes: np.ndarray) -> dict:
    """The state a step's delta is published as (the module's docstring)."""
    return {"from": base_step, "to": new_step, "base": base_manifest, "manifest": new_manifest, "names": names,
            "deltas": [np.frombuffer(b, dtype=np.uint8) for b in blobs], "tree": np.array(tree_bytes, copy=True)}


def variable_arrays(plan: pb.Plan, arena: np.ndarray) -> dict[str, np.ndarray]:
    """Every variable of ``plan`` as a typed view of ``arena``."""
    return {v.name: variable_view(arena, v) for v in plan.variables}
