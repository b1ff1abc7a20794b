"""A cluster engine's placement as the ``COLLECTIVE_*`` defaults of ``python -m collective.chief|worker``."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from collective.clusterenv._common import ROLES, Placement, Reader
from collective.clusterenv.resolve import cluster_placement
from collective.config import parse_address

# What to check when the engine gives this process the other role.
_RANK_SETTING = {"torchrun": "RANK", "PyTorchJob": "RANK (the pod's index)", "PET_*": "PET_NODE_RANK",
                 "Slurm": "SLURM_PROCID (task 0 is the chief)"}


@dataclass(frozen=True)
class ClusterEnv:
    """What the environment says about this process's place in the cluster, in the command
    lines' terms: the chief (rank 0) or worker ``rank - 1``."""

    role: str                 # "chief" or "worker"
    chief_address: str        # HOST:PORT ([v6]:PORT for an IPv6 literal)
    num_workers: int          # workers in the cluster (the chief not counted)
    worker_index: int | None  # this worker's index (preferred rank); None for the chief
    source: str               # "TF_CONFIG", "torchrun", "PyTorchJob", "PET_*" or "Slurm"
    chief_trains: bool = False  # the chief is a training process too (all but TF_CONFIG with a chief)
    placement: Placement | None = field(default=None, compare=False, repr=False)  # all that was resolved

    @classmethod
    def of(cls, p: Placement) -> ClusterEnv:
        if p.chief is None:
            raise ValueError(f"a placement without a chief address ({p.source}) is no cluster")
        return cls(
            role="chief" if p.rank == 0 else "worker",
            chief_address=p.chief,
            num_workers=p.world_size - 1,
            worker_index=None if p.rank == 0 else p.rank - 1,
            source=p.source,
            chief_trains=p.chief_trains,
            placement=p,
        )

    @property
    def rank(self) -> int:
        """This process's training rank: 0 for the chief, worker index + 1 for a worker."""
        return 0 if self.role == "chief" else (self.worker_index or 0) + 1

    @property
    def world_size(self) -> int:
        """Training processes: the workers and the chief."""
        return self.num_workers + 1

    def describe(self) -> str:
        """One line for logs, e.g. ``TF_CONFIG: worker 1 of 3, chief at h:2222``."""
        if self.role == "chief":
            trains = " (it trains too)" if self.chief_trains else ""
            return f"{self.source}: the chief{trains}, at {self.chief_address}, of {self.num_workers} worker(s)"
        return f"{self.source}: worker {self.worker_index} of {self.num_workers}, chief at {self.chief_address}"


def from_environment(environ: Mapping[str, str]) -> ClusterEnv | None:
    """The first cluster engine present (``TF_CONFIG``, torchrun, PyTorchJob, ``PET_*``,
    Slurm; see ``cluster_placement``) as a ``ClusterEnv``, else None."""
    p = cluster_placement(environ)
    return None if p is None else ClusterEnv.of(p)


def apply_defaults(env: ClusterEnv, role: str) -> dict[str, str]:
    """The ``COLLECTIVE_*`` values ``env`` implies for a process started as ``role``.

    Chief: ``COLLECTIVE_WORKERS`` and ``COLLECTIVE_BIND`` (every interface, the chief address's
    port). Worker: ``COLLECTIVE_CHIEF``, and ``COLLECTIVE_RANK`` (the worker index, as preferred
    rank) when ``env`` says this process is a worker. The cluster-wide values hold whatever role
    ``env`` gives this process; ``role_mismatch`` says when the two disagree.
    """
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not chief or worker")
    if role == "chief":
        host, port = parse_address(env.chief_address, what=f"{env.source} chief address")
        any_host = "[::]" if ":" in host else "0.0.0.0"
        return {"COLLECTIVE_WORKERS": str(env.num_workers), "COLLECTIVE_BIND": f"{any_host}:{port}"}
    out = {"COLLECTIVE_CHIEF": env.chief_address}
    if env.role == "worker" and env.worker_index is not None:
        out["COLLECTIVE_RANK"] = str(env.worker_index)
    return out


def role_mismatch(env: ClusterEnv, role: str) -> str | None:
    """A warning when ``env`` gives this process another role than the one it was started as."""
    if env.role == role:
        return None
    if env.source == "TF_CONFIG":
        what = "TF_CONFIG's task type" + (" (without 'chief', worker 0 is the chief)" if env.chief_trains else "")
    else:
        what = _RANK_SETTING.get(env.source, env.source)
    return (
        f"{env.source} makes this process the {env.role}, but it was started as a {role}; "
        f"check {what} (the {env.role} is `python -m {env.role}`)"
    )


def apply_to_environ(role: str, environ: MutableMapping[str, str] | None = None) -> ClusterEnv | None:
    """Read the cluster engines from ``environ`` (``os.environ``) and set the implied
    ``COLLECTIVE_*`` variables that are unset or empty. Returns what was found (None: nothing);
    log ``env.describe()`` and ``role_mismatch(env, role)`` once logging is configured.

    Call it before building the argument parser: ``config.add_flags`` reads the environment
    when the parser is built. Raises ``UsageError`` on a malformed or conflicting value.
    """
    environ = os.environ if environ is None else environ
    env = from_environment(environ)
    if env is None:
        return None
    unset = Reader(environ)
    for name, value in apply_defaults(env, role).items():
        if not unset.given(name):
            environ[name] = value
    return env
