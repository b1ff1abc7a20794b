"""What every engine shares: the variable names, the ``Placement`` result and the readers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from collective.errors import UsageError

ROLES = ("chief", "worker")
TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# Only torchrun (torch.distributed.run) sets these in the processes it starts: they tell a
# torchrun child from a pod where the Kubeflow PyTorchJob operator set MASTER_*/RANK/WORLD_SIZE.
TORCHRUN_OWN_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
# Kubeflow Trainer v2 / JobSet (and training-operator v1 with nprocPerNode): torchrun's options.
PET_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
# srun sets these for the tasks of a step; an sbatch batch script (no step) has none of them.
SLURM_STEP_VARS = ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES")
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# Kubernetes Indexed Jobs (JOB_COMPLETION_INDEX: the pod's index in its Job) and JobSet's
# identity, when the pod template maps JobSet's labels into the environment.
JOBSET_VARS = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_GLOBAL_INDEX", "JOB_COMPLETION_INDEX")
MPI_VARS = (  # (rank, size) as each MPI launcher sets them
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "PMI_SIZE"))
# Where each launcher says which process of its host this is: ours, torchrun, Open MPI,
# MPICH / Intel MPI (Hydra), PMIx, Slurm's srun. The first one set wins.
LOCAL_RANK_VARS = (
    "COLLECTIVE_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
    "PMIX_LOCAL_RANK", "SLURM_LOCALID",
)
# The variables whose presence places a process (besides COLLECTIVE_*): what `collective
# launch` removes from its children, which form a cluster of their own.
CLUSTER_VARS = ("TF_CONFIG", *TORCHRUN_VARS, *PET_VARS, "SLURM_PROCID", "SLURM_NTASKS")
SINGLE = "no cluster settings: a single process"
SLURM_BASE_PORT, SLURM_PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class Placement:
    """Where this process stands, from one engine (``source``).

    ``rank`` / ``world_size``: training rank and number of training processes (rank 0 is the
    chief). ``local_rank``: the index among this host's training processes (its device).
    ``node``: which host group this process is on (0-based), and ``nodes`` how many there are,
    None when the engine does not say. ``chief``: rank 0's ``HOST:PORT``, None under MPI or for a
    single process. ``variables``: the (name, value) pairs read, in order. ``mpi``: the round
    runs over MPI. ``chief_trains``: rank 0 is a training process (all but a TF_CONFIG with a
    ``chief`` entry). ``note``: what the engine walk noticed but did not use (doctor shows it).
    """

    rank: int
    world_size: int
    local_rank: int = 0
    node: int | None = None
    nodes: int | None = None
    chief: str | None = None
    source: str = SINGLE
    variables: tuple[tuple[str, str], ...] = ()
    mpi: bool = False
    chief_trains: bool = True
    note: str = ""

    def describe(self) -> str:
        """One line, e.g. ``rank 1 of 4, local rank 1, node 0 of 2, chief at n1:20123 (from Slurm)``."""
        where = f"node {self.node}" if self.node is not None else "node ?"
        if self.nodes is not None:
            where += f" of {self.nodes}"
        chief = f"chief at {self.chief}" if self.chief else "over MPI" if self.mpi else "no chief"
        return (f"rank {self.rank} of {self.world_size}, local rank {self.local_rank}, {where}, {chief} "
                f"(from {self.source})")

    def report(self, width: int = 60) -> str:
        """``describe()`` plus the variables read (values cut at ``width``) and the note."""
        out = self.describe()
        if self.variables:
            shown = ", ".join(f"{k}={_cut(v, width)}" for k, v in self.variables)
            out += f"; read {shown}"
        if self.note:
            out += f"; note: {self.note}"
        return out


def _cut(value: str, width: int) -> str:
    return value if len(value) <= width else value[: width - 3] + "..."


class Reader:
    """Reads variables from one environment and records those that were set, in order."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env
        self.read: dict[str, str] = {}

    def get(self, name: str) -> str | None:
        """The stripped value, or None when unset or empty (empty counts as unset)."""
        value = (self.env.get(name) or "").strip()
        if not value:
            return None
        self.read[name] = value
        return value

    def given(self, name: str) -> bool:
        return bool((self.env.get(name) or "").strip())

    def any(self, names) -> bool:
        return any(self.given(n) for n in names)

    def number(self, name: str, engine: str, *, low: int | None = 0, high: int | None = None, what: str = "",
            required: str | None = None) -> int | None:
        """``name`` as a whole number in ``low..high`` (None: unset). Errors name the variable:
        ``{engine} variable NAME='x' is ...``; ``required`` (a hint) makes an unset one an error."""
        raw = self.get(name)
        if raw is None:
            if required is not None:
                raise UsageError(f"{engine} variable {name} is not set; {required}")
            return None
        try:
            value = int(raw)
        except ValueError:
            raise UsageError(f"{engine} variable {name}={raw!r} is not a whole number") from None
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f"at least {low}"
            raise UsageError(f"{engine} variable {name}={raw!r} is out of range: must be {span}{what}")
        return value

    def variables(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.read.items())


def join_address(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_local_rank(r: Reader, first: tuple[str, ...] = ()) -> int:
    """``COLLECTIVE_LOCAL_RANK``, then the engine's own variables (``first``), then the other
    launchers' (``LOCAL_RANK_VARS``); 0 when none is set."""
    for name in dict.fromkeys(("COLLECTIVE_LOCAL_RANK", *first, *LOCAL_RANK_VARS)):
        raw = r.get(name)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise UsageError(f"{name}={raw!r} is not a local rank (a whole number >= 0); fix or unset it")
        return value
    return 0


def pod_index(r: Reader) -> int | None:
    """``JOB_COMPLETION_INDEX`` (Kubernetes sets it in every pod of an Indexed Job, JobSet's
    included) as the host-group index, when no JobSet variable says there are several Jobs
    (then the index counts pods of this Job only, not of the whole set)."""
    if not r.given("JOB_COMPLETION_INDEX"):
        return None
    for name in ("JOB_INDEX", "JOB_GLOBAL_INDEX"):
        if (r.get(name) or "0") != "0":
            return None
    for name in ("REPLICATED_JOB_REPLICAS", "GLOBAL_REPLICAS"):
        if (r.get(name) or "1") != "1":
            return None
    raw = r.get("JOB_COMPLETION_INDEX") or ""
    return int(raw) if raw.isdigit() else None
