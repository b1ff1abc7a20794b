"""The cluster conventions users already have: TensorFlow's ``TF_CONFIG`` and torchrun's variables.

``from_environment`` reads them into a ``ClusterEnv``; ``apply_defaults`` turns that into the
``COLLECTIVE_*`` values it implies for one process; ``apply_to_environ`` sets those values
where the variable is not set yet. Precedence stays: an explicit option beats a ``COLLECTIVE_*``
variable (also one set by hand next to ``TF_CONFIG``), which beats what ``TF_CONFIG`` or torchrun
imply, which beats the default.

``TF_CONFIG`` (JSON)::

    {"cluster": {"chief": ["host:port"], "worker": ["h1:p", "h2:p"]},
     "task": {"type": "chief" | "worker", "index": i}}

The chief is ``cluster.chief[0]``; the number of workers is ``len(cluster.worker)``; a worker's
index is its preferred rank. The workers' own addresses are not used (workers connect to the
chief; they do not listen). A cluster with only ``worker`` entries is TensorFlow's other
convention: worker 0 is the chief (at ``cluster.worker[0]``) and trains too, worker ``i > 0``
is collective's worker ``i - 1``; so the chief serves ``len(cluster.worker) - 1`` workers.

torchrun (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``): ``RANK`` 0 is the chief
and trains too, ranks 1..WORLD_SIZE-1 are workers (worker index ``RANK - 1``), so ``WORLD_SIZE``
is the number of workers plus one. The chief listens at ``MASTER_ADDR:MASTER_PORT+1``: torchrun's
own rendezvous store already listens on ``MASTER_PORT`` on the first node, so the next port is
the chief's (``COLLECTIVE_CHIEF`` on every rank and ``COLLECTIVE_BIND`` on rank 0 override it).
They count as present when ``MASTER_ADDR`` or ``MASTER_PORT`` is set (``RANK`` and
``WORLD_SIZE`` alone are too generic a pair of names to mean torchrun); then all four must be
valid.

When both are present, ``TF_CONFIG`` wins. Empty variables count as unset, as everywhere.
A malformed ``TF_CONFIG`` or torchrun variable raises ``UsageError`` naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from collective.config import parse_address
from collective.errors import UsageError

ROLES = ("chief", "worker")
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# Where each launcher says which process of its host this is: ours, torchrun, Open MPI,
# MPICH / Intel MPI (Hydra), PMIx, Slurm's srun. The first one set wins.
LOCAL_RANK_VARS = (
    "COLLECTIVE_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
    "PMIX_LOCAL_RANK", "SLURM_LOCALID",
)


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's index among the training processes on its host: the device it should use
    (``cuda:<local_rank>``). From the first set of ``LOCAL_RANK_VARS``; 0 when none is set (one
    process per host). A value that is not a whole number >= 0 raises ``UsageError`` naming it."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARS:
        if _unset(environ, name):
            continue
        raw = environ[name].strip()
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise UsageError(f"{name}={raw!r} is not a local rank (a whole number >= 0); fix or unset it")
        return value
    return 0


@dataclass(frozen=True)
class ClusterEnv:
    """What the environment says about this process's place in the cluster."""

    role: str                 # "chief" or "worker"
    chief_address: str        # HOST:PORT ([v6]:PORT for an IPv6 literal)
    num_workers: int          # workers in the cluster (the chief not counted)
    worker_index: int | None  # this worker's index (preferred rank); None for the chief
    source: str               # "TF_CONFIG", "torchrun" or "COLLECTIVE_*"
    chief_trains: bool = False  # the chief is a training process too (torchrun, worker-only TF_CONFIG)

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


def _unset(environ: Mapping[str, str], name: str) -> bool:
    return not (environ.get(name) or "").strip()


def from_environment(environ: Mapping[str, str]) -> ClusterEnv | None:
    """``TF_CONFIG`` if set, else the torchrun variables if present, else None."""
    if not _unset(environ, "TF_CONFIG"):
        return _from_tf_config(environ["TF_CONFIG"])
    if not (_unset(environ, "MASTER_ADDR") and _unset(environ, "MASTER_PORT")):
        return _from_torchrun(environ)
    return None


def _tf_error(problem: str) -> UsageError:
    return UsageError(f"TF_CONFIG: {problem}")


def _from_tf_config(text: str) -> ClusterEnv:
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise _tf_error(f"not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _tf_error("must be a JSON object with 'cluster' and 'task'")
    cluster = config.get("cluster")
    if not isinstance(cluster, dict):
        raise _tf_error("has no 'cluster' object")
    chiefs = cluster.get("chief")
    if not chiefs and "chief" not in cluster:
        return _from_tf_workers_only(config, cluster)
    if not chiefs:
        raise _tf_error("cluster.chief is empty; list the chief's \"host:port\", or leave 'chief' out (worker 0 is the chief)")
    if not isinstance(chiefs, list) or not all(isinstance(a, str) for a in chiefs):
        raise _tf_error("cluster.chief must be a list of \"host:port\" strings")
    if len(chiefs) != 1:
        raise _tf_error(f"cluster.chief must list exactly one address, not {len(chiefs)}")
    workers = cluster.get("worker")
    if not isinstance(workers, list) or not all(isinstance(a, str) for a in workers):
        raise _tf_error("cluster.worker must be a list of \"host:port\" strings")
    if not workers:
        raise _tf_error("cluster.worker is empty; collective needs at least one worker")
    host, port = parse_address(chiefs[0], what="TF_CONFIG cluster.chief[0]")
    if port == 0:
        raise _tf_error(f"cluster.chief[0] {chiefs[0]!r} has port 0; give the port the chief listens on")

    kind, index = _task_index(config, ROLES, "chief")
    tasks = chiefs if kind == "chief" else workers
    if not 0 <= index < len(tasks):
        raise _tf_error(f"task index {index} is out of range: cluster.{kind} lists {len(tasks)} task(s)")
    return ClusterEnv(
        role=kind,
        chief_address=_join(host, port),
        num_workers=len(workers),
        worker_index=index if kind == "worker" else None,
        source="TF_CONFIG",
    )


def _task_index(config: dict, kinds: tuple[str, ...], default_zero: str | None) -> tuple[str, int]:
    task = config.get("task")
    if not isinstance(task, dict):
        raise _tf_error(f"has no 'task' object ({{\"type\": {' or '.join(repr(k) for k in kinds)}, \"index\": i}})")
    kind = task.get("type")
    if kind not in kinds:
        raise _tf_error(
            f"task type {kind!r} is not {' or '.join(kinds)} (collective has no ps or evaluator tasks"
            + ("; a cluster without 'chief' has only workers)" if kinds == ("worker",) else ")")
        )
    index = task.get("index", 0 if kind == default_zero else None)
    if isinstance(index, str) and index.strip().isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise _tf_error(f"task index {index!r} is not a whole number")
    return kind, index


def _from_tf_workers_only(config: dict, cluster: dict) -> ClusterEnv:
    """TensorFlow's chief-less cluster: worker 0 is the chief and trains too."""
    workers = cluster.get("worker")
    if not isinstance(workers, list) or not all(isinstance(a, str) for a in workers):
        raise _tf_error("cluster has no 'chief' and cluster.worker is not a list of \"host:port\" strings")
    if len(workers) < 2:
        raise _tf_error(
            f"cluster has no 'chief' and {len(workers)} worker(s); worker 0 is the chief, so at least "
            "two workers are needed (or add \"chief\": [\"host:port\"])"
        )
    host, port = parse_address(workers[0], what="TF_CONFIG cluster.worker[0] (the chief)")
    if port == 0:
        raise _tf_error(f"cluster.worker[0] {workers[0]!r} has port 0; give the port worker 0 (the chief) listens on")
    _, index = _task_index(config, ("worker",), None)
    if not 0 <= index < len(workers):
        raise _tf_error(f"task index {index} is out of range: cluster.worker lists {len(workers)} task(s)")
    return ClusterEnv(
        role="chief" if index == 0 else "worker",
        chief_address=_join(host, port),
        num_workers=len(workers) - 1,
        worker_index=None if index == 0 else index - 1,
        source="TF_CONFIG",
        chief_trains=True,
    )


def _require(environ: Mapping[str, str], name: str) -> str:
    if _unset(environ, name):
        present = [v for v in TORCHRUN_VARS if not _unset(environ, v)]
        raise UsageError(
            f"torchrun variable {name} is not set (found {', '.join(present)}); "
            f"set all of {', '.join(TORCHRUN_VARS)}, or none"
        )
    return environ[name].strip()


def _torch_int(environ: Mapping[str, str], name: str, *, low: int, high: int | None = None, what: str = "") -> int:
    raw = _require(environ, name)
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"torchrun variable {name}={raw!r} is not a whole number") from None
    if value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f"at least {low}"
        raise UsageError(f"torchrun variable {name}={raw!r} is out of range: must be {span}{what}")
    return value


def _from_torchrun(environ: Mapping[str, str]) -> ClusterEnv:
    addr = _require(environ, "MASTER_ADDR")
    if any(c.isspace() for c in addr) or addr.startswith(":") or addr.endswith(":"):
        raise UsageError(f"torchrun variable MASTER_ADDR={addr!r} is not a host name or address")
    port = _torch_int(environ, "MASTER_PORT", low=1, high=65534, what=" (the chief listens on MASTER_PORT+1)")
    world = _torch_int(environ, "WORLD_SIZE", low=2, what=" (the chief and at least one worker)")
    rank = _torch_int(environ, "RANK", low=0, high=world - 1, what=f" for WORLD_SIZE={world}")
    return ClusterEnv(
        role="chief" if rank == 0 else "worker",
        chief_address=_join(addr.strip("[]"), port + 1),  # MASTER_PORT is torchrun's own store
        num_workers=world - 1,
        worker_index=None if rank == 0 else rank - 1,
        source="torchrun",
        chief_trains=True,
    )


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    what = "TF_CONFIG's task type" + (" (without 'chief', worker 0 is the chief)" if env.chief_trains else "") \
        if env.source == "TF_CONFIG" else "RANK" if env.source == "torchrun" else env.source
    return (
        f"{env.source} makes this process the {env.role}, but it was started as a {role}; "
        f"check {what} (the {env.role} is `python -m {env.role}`)"
    )


def apply_to_environ(role: str, environ: MutableMapping[str, str] | None = None) -> ClusterEnv | None:
    """Read ``TF_CONFIG`` / torchrun from ``environ`` (``os.environ``) and set the implied
    ``COLLECTIVE_*`` variables that are unset or empty. Returns what was found (None: nothing);
    log ``env.describe()`` and ``role_mismatch(env, role)`` once logging is configured.

    Call it before building the argument parser: ``config.add_option`` reads the environment
    when the parser is built. Raises ``UsageError`` on a malformed ``TF_CONFIG``/torchrun value.
    """
    environ = os.environ if environ is None else environ
    env = from_environment(environ)
    if env is None:
        return None
    for name, value in apply_defaults(env, role).items():
        if _unset(environ, name):
            environ[name] = value
    return env


# --- the training roles of this process ---------------------------------------------------------


@dataclass(frozen=True)
class Roles:
    """Where this process stands: training rank, number of training processes, the chief's
    address (None under MPI or alone) and where that came from."""

    rank: int
    world_size: int
    chief: str | None
    source: str
    mpi: bool = False


MPI_VARS = (  # (rank, size) as each MPI launcher sets them
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "PMI_SIZE"))


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name].strip()
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not a whole number") from None


def resolve_roles(
    rank: int | None, world_size: int | None, chief: str | None, env: Mapping[str, str] | None = None
) -> Roles:
    """Arguments, else COLLECTIVE_RANK + COLLECTIVE_WORLD_SIZE (+ COLLECTIVE_CHIEF), else TF_CONFIG,
    else torchrun, else MPI's launcher variables, else a single process. Raises UsageError
    naming the setting that is missing or out of range."""
    env = os.environ if env is None else env

    def given(name: str) -> bool:
        return bool((env.get(name) or "").strip())

    chief = chief or (env.get("COLLECTIVE_CHIEF") or "").strip() or None
    source, mpi = "arguments", False
    if rank is None or world_size is None:
        # torchrun with one process: nothing to broadcast (clusterenv wants a chief and a worker).
        alone = not given("TF_CONFIG") and given("MASTER_ADDR") and (env.get("WORLD_SIZE") or "").strip() == "1"
        cluster = None if given("COLLECTIVE_WORLD_SIZE") or alone else from_environment(env)
        if given("COLLECTIVE_WORLD_SIZE"):
            source = "COLLECTIVE_*"
            world_size = world_size if world_size is not None else _int_var(env, "COLLECTIVE_WORLD_SIZE")
            if rank is None:
                if not given("COLLECTIVE_RANK"):
                    raise UsageError("COLLECTIVE_WORLD_SIZE is set but COLLECTIVE_RANK is not: set this process's rank")
                rank = _int_var(env, "COLLECTIVE_RANK")
        elif cluster is not None:
            source = cluster.source
            rank = cluster.rank if rank is None else rank
            world_size = cluster.world_size if world_size is None else world_size
            chief = chief or cluster.chief_address
        elif alone:
            source, rank, world_size = "torchrun", 0 if rank is None else rank, 1 if world_size is None else world_size
        else:
            pair = next(((r, s) for r, s in MPI_VARS if given(r) and given(s)), None)
            if pair is not None:
                source, mpi = f"MPI ({pair[0]})", True
                rank = _int_var(env, pair[0]) if rank is None else rank
                world_size = _int_var(env, pair[1]) if world_size is None else world_size
            else:
                source = "no cluster settings: a single process"
                rank = 0 if rank is None else rank
                world_size = 1 if world_size is None else world_size
    if world_size < 1:
        raise UsageError(f"world size {world_size} (from {source}) must be at least 1")
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} (from {source}) is out of range: must be 0..{world_size - 1}")
    if world_size > 1 and not mpi and not chief:
        raise UsageError(
            f"rank {rank} of {world_size} (from {source}) needs the chief's address: pass chief='HOST:PORT' "
            "or set COLLECTIVE_CHIEF on every rank"
        )
    return Roles(rank, world_size, chief, source, mpi)


def mpi_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank as the MPI launcher set it, or None outside MPI (or unreadable)."""
    for r, _ in MPI_VARS:
        raw = (env.get(r) or "").strip()
        if raw.isdigit():
            return int(raw)
    return None
