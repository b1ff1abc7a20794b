"""Replicas: one copy of the arena per device, checked against the plan; what a process holds.

Both sides use this: a worker makes and checks its replicas from the arena it received, and a
chief that trains makes its own from the arena it serves (``hold_chief_replicas``), hashed by
the same rule so the chief compares them as a worker's. ``SyncResult`` is what a process holds
once training may start, whichever transport brought the bytes (gRPC or MPI).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from collective import dtypes
from collective._proto import collective_pb2 as pb
from collective.digest import chunk_digests, worker_digest
from collective.errors import CollectiveError, IntegrityError
from collective.plan import culprit, differing_chunk, spec_of
from collective.variables import VariableStore, variable_over


@dataclass
class SyncResult:
    """What a process holds once training may start.

    ``variables``: the mirrored variables; ``var.replicas[i]`` lives on ``devices[i]``.
    ``rank``/``world_size``: this process's training rank (the chief is rank 0) and the number
    of training processes. ``digest``: the digest of this process's replicas (every rank's
    covers the same bytes). ``summary``: on the chief, the round's summary (``collective launch
    --json``'s object); None elsewhere. ``shards``: with a sharded plan, name -> what this process
    holds of the variable (``collective.shards.Placement``: whole shape, rows of dimension 0);
    None when it holds replicas of every variable. ``bytes_received``: the model's bytes this
    process received (0 on the chief); ``plan_bytes``: the size of the plan it received.
    """

    rank: int
    world_size: int
    devices: list[str]
    variables: VariableStore = field(repr=False)
    digest: str = ""
    summary: dict | None = field(default=None, repr=False)
    shards: dict | None = field(default=None, repr=False)
    bytes_received: int = 0
    plan_bytes: int = 0

    def arrays(self, device: int = 0) -> dict[str, np.ndarray]:
        """Variable name -> the replica on ``devices[device]`` (the array itself, no copy), in
        model order. Raises IndexError for a device this process does not hold."""
        if not 0 <= device < len(self.devices):
            raise IndexError(f"device index {device} is out of range: this process holds {len(self.devices)} device(s)")
        return {v.name: v.replicas[device] for v in self.variables}


def variable_view(arena: np.ndarray, v: pb.VariableInfo, base: int = 0) -> np.ndarray:
    """Variable ``v`` as an array over its bytes in ``arena`` (no copy): a received arena, a
    replica's, or one that holds the plan's bytes from offset ``base`` on."""
    lo = v.offset - base
    return arena[lo : lo + v.nbytes].view(dtypes.from_wire(v.dtype)).reshape(tuple(v.shape))


def make_replicas(plan: pb.Plan, arena: np.ndarray, devices: Sequence[str]) -> tuple[VariableStore, list[np.ndarray]]:
    """One replica of every variable per device, and the arenas that hold them.

    Replica i of every variable lives in arena i at the plan's offsets: arena 0 is the received
    arena itself (no copy), each further device gets one copy of it. The store builds each
    variable's object when it is first used (``VariableStore.defer``), so 20,000 variables cost
    nothing here.
    """
    flat = arena.reshape(-1).view(np.uint8)
    arenas = [flat] + [flat.copy() for _ in devices[1:]]  # the copy faults its pages in once
    variables, devices = plan.variables, list(devices)

    def make(i: int):
        spec = spec_of(variables[i])
        return variable_over(
            spec.name, [variable_view(a, variables[i]) for a in arenas], devices,
            synchronization=spec.synchronization, aggregation=spec.aggregation, trainable=spec.trainable,
        )

    store = VariableStore()
    store.defer(lambda: [v.name for v in variables], make)
    return store, arenas


def verify_replicas(
    plan: pb.Plan, arenas: Sequence[np.ndarray], devices: Sequence[str], *, first: Sequence[str] | None = None
) -> list[pb.DeviceDigests]:
    """Hash every replica arena chunk by chunk and compare with the plan's chunk digests.

    ``first``: the chunk digests of arena 0 when the Receiver already verified its bytes, so
    they are not hashed twice. Raises IntegrityError naming the variable and replica of the
    first difference.
    """
    want = list(plan.chunk_digests)
    out = []
    for i, (a, device) in enumerate(zip(arenas, devices, strict=True)):
        got = list(first) if (i == 0 and first is not None) else chunk_digests(a, plan.chunk_bytes)
        differs = differing_chunk(plan, got, want)
        if differs is not None:
            k = differs[0] // plan.chunk_bytes
            pair = (got[k], want[k]) if k < min(len(got), len(want)) else None
            raise IntegrityError(culprit(plan, a, *differs, replica=(i, device), digests=pair))
        out.append(pb.DeviceDigests(device=device, replica=i, chunk_digests=got))
    return out


def hold_chief_replicas(service, devices: Sequence[str], timeout: float) -> tuple[VariableStore, str]:
    """The chief's own replicas: once the plan is out, one copy of the arena per device, each
    hashed as a worker's and reported to ``service`` (start waits for them). Any failure fails
    the round and is raised."""
    try:
        plan = service.await_plan(timeout)
        # A copy even for device 0: the chief's arena keeps serving (and may be a sealed mapping).
        store, arenas = make_replicas(plan, np.array(service.local_arena(), dtype=np.uint8, copy=True), devices)
        try:
            digests = verify_replicas(plan, arenas, devices)
        except IntegrityError as exc:
            raise IntegrityError(f"the chief's own replicas (training rank 0): {exc}") from exc
        digest = worker_digest(plan.manifest_digest, [d.chunk_digests for d in digests])
        service.report_local_ready(pb.ReadyRequest(devices=digests, worker_digest=digest))
    except CollectiveError as exc:
        service.fail(exc)
        raise
    except Exception as exc:  # MemoryError, a bug: the round must not wait for us
        err = CollectiveError(f"the chief's own replicas failed: {type(exc).__name__}: {exc}")
        service.fail(err)
        raise err from exc
    return store, digest
