"""The one resolver: arguments, then the engines in precedence order, then a single process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

import collective.clusterenv.engines as engines
from collective.clusterenv._common import (
    MPI_VARS,
    SINGLE,
    Placement,
    Reader,
    pod_index,
    read_local_rank,
)
from collective.errors import UsageError


def _cluster(r: Reader, *, alone_ok: bool) -> Placement | None:
    """The cluster engines, highest first: TF_CONFIG, torchrun / PyTorchJob, PET_*, Slurm."""
    return (engines.tf_config(r) or engines.torch_family(r, alone_ok=alone_ok) or engines.pet(r)
            or engines.slurm(r))


def _batch_note(r: Reader) -> str:
    """Why a Slurm job's process is not a Slurm task placement, when it looks like one."""
    job = r.get("SLURM_JOB_ID")
    if job is None or engines.slurm_step(r):
        return ""
    return (f"SLURM_JOB_ID={job} without an srun step (no SLURM_STEP_NODELIST / SLURM_STEP_NUM_TASKS: "
            "a batch script or salloc shell) is not a Slurm task placement; start the processes with srun")


def resolve_placement(
    rank: int | None = None,
    world_size: int | None = None,
    chief: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Placement:
    """This process's ``Placement``. Precedence: explicit arguments > ``COLLECTIVE_*``
    (``COLLECTIVE_RANK`` + ``COLLECTIVE_WORLD_SIZE``) > ``TF_CONFIG`` > torchrun > ``PET_*``
    (Kubeflow Trainer v2 / JobSet, without torchrun) > Kubeflow PyTorchJob (without torchrun)
    > Slurm (an srun step) > MPI launcher variables > a single process. ``chief`` (else
    ``COLLECTIVE_CHIEF``) replaces the engine's chief address; ``rank`` / ``world_size`` alone
    replace the engine's value. Raises ``UsageError`` naming the variables and values that are
    missing, half set, conflicting or out of range."""
    r = Reader(os.environ if env is None else env)
    chief = chief or r.get("COLLECTIVE_CHIEF")
    if rank is not None and world_size is not None:
        found = Placement(rank, world_size, read_local_rank(r), pod_index(r), None, None, "arguments")
    else:
        found = (engines.collective_vars(r, rank, world_size) or _cluster(r, alone_ok=True) or engines.mpi(r)
                 or Placement(0, 1, read_local_rank(r), pod_index(r), None, None, SINGLE, note=_batch_note(r)))
        found = _override(found, rank, world_size)
    found = _override(found, None, None, chief=chief or found.chief, variables=r.variables())
    source, rank, world_size = found.source, found.rank, found.world_size
    if world_size < 1:
        raise UsageError(f"world size {world_size} (from {source}) must be at least 1")
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} (from {source}) is out of range: must be 0..{world_size - 1}")
    if world_size > 1 and not found.mpi and not found.chief:
        raise UsageError(
            f"rank {rank} of {world_size} (from {source}) needs the chief's address: pass chief='HOST:PORT' "
            "or set COLLECTIVE_CHIEF on every rank"
        )
    return found


def _override(p: Placement, rank: int | None, world: int | None, **fields) -> Placement:
    if rank is not None:
        fields["rank"] = rank
    if world is not None:
        fields["world_size"] = world
    return replace(p, **fields) if fields else p


def cluster_placement(env: Mapping[str, str] | None = None) -> Placement | None:
    """The placement a cluster engine (TF_CONFIG, torchrun, PyTorchJob, PET_*, Slurm) gives,
    for ``python -m collective.chief|worker``: None without one, or when it places a single
    process (``srun -n 1``, one node). ``COLLECTIVE_*`` and MPI are not read (the command lines
    take ``COLLECTIVE_*`` themselves; MPI runs through ``collective.mpi``). torchrun with
    ``WORLD_SIZE=1`` is an error here (no worker for the chief)."""
    r = Reader(os.environ if env is None else env)
    found = _cluster(r, alone_ok=False)
    if found is None or found.world_size < 2:
        return None
    return _override(found, None, None, variables=r.variables())


# The names sync and the examples know.
Roles = Placement


def resolve_roles(
    rank: int | None, world_size: int | None, chief: str | None, env: Mapping[str, str] | None = None
) -> Placement:
    """``resolve_placement`` (its older name, as ``collective.sync`` calls it)."""
    return resolve_placement(rank, world_size, chief, env)


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's index among the training processes on its host: the device it should use
    (``cuda:<local_rank>``). From the first set of ``LOCAL_RANK_VARS``; 0 when none is set (one
    process per host). A value that is not a whole number >= 0 raises ``UsageError`` naming it."""
    return read_local_rank(Reader(os.environ if environ is None else environ))


def mpi_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank as the MPI launcher set it, or None outside MPI (or unreadable)."""
    for r, _ in MPI_VARS:
        raw = (env.get(r) or "").strip()
        if raw.isdigit():
            return int(raw)
    return None
