"""Where this process stands in the cluster, from the conventions users already have.

One resolver, ``resolve_placement(rank, world_size, chief, env)`` -> ``Placement`` (rank, world
size, local rank, node and node count, the chief's address, ``source`` and the variables read),
walks the engines in one precedence order; the first one present decides, and a malformed,
half-set or conflicting value of that engine raises ``UsageError`` naming the variables and
their values (it does not fall through to the next engine). Empty variables count as unset.

1. explicit arguments (``collective.sync(rank=, world_size=, chief=)``);
2. ``COLLECTIVE_RANK`` + ``COLLECTIVE_WORLD_SIZE`` (+ ``COLLECTIVE_CHIEF``, rank 0's ``host:port``);
3. ``TF_CONFIG`` (JSON)::

       {"cluster": {"chief": ["host:port"], "worker": ["h1:p", "h2:p"]},
        "task": {"type": "chief" | "worker", "index": i}}

   The chief is ``cluster.chief[0]`` (rank 0; it does not train), worker *i* is rank *i + 1*.
   The workers' own addresses are not used (workers connect to the chief; they do not listen),
   only their hosts (``node``: the index of this task's host among the distinct hosts). A
   cluster with only ``worker`` entries is TensorFlow's other convention: worker 0 is the chief
   (at ``cluster.worker[0]``) and trains too, worker *i* is rank *i*.
4. torchrun (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``; also ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` = node, ``TORCHELASTIC_RUN_ID``): RANK 0 is the chief
   and trains too. The chief listens at ``MASTER_ADDR:MASTER_PORT+1`` (torchrun's store holds
   ``MASTER_PORT``). Present when ``MASTER_ADDR`` or ``MASTER_PORT`` is set (``RANK`` and
   ``WORLD_SIZE`` alone are too generic to mean torchrun); then all four must be valid.
5. ``PET_*`` without torchrun (Kubeflow Trainer v2 / JobSet set ``PET_NNODES``,
   ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` for
   torchrun to read): only one process per node can be placed, rank ``PET_NODE_RANK`` of
   ``PET_NNODES``, chief at ``PET_MASTER_ADDR:PET_MASTER_PORT+1``; ``PET_NPROC_PER_NODE``
   other than 1 is an error saying to start the processes with torchrun.
6. Kubeflow PyTorchJob (training-operator v1) without torchrun: ``MASTER_*``, ``RANK``,
   ``WORLD_SIZE`` beside ``PET_*`` but none of torchrun's own ``LOCAL_RANK`` /
   ``LOCAL_WORLD_SIZE`` / ``TORCHELASTIC_RUN_ID``. ``RANK`` is the pod's index, so this is
   only right with one process per pod: ``PET_NPROC_PER_NODE`` > 1, or a ``WORLD_SIZE`` that
   is not ``PET_NNODES`` x 1, is an error saying to start the processes with torchrun.
7. Slurm, a task of an srun step (``SLURM_PROCID`` and ``SLURM_NTASKS`` plus one of srun's
   ``SLURM_STEP_NODELIST`` / ``SLURM_STEP_NUM_TASKS`` / ``SLURM_STEP_NUM_NODES``; an sbatch
   batch script has no step and is not placed): rank ``SLURM_PROCID`` of
   ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), local rank ``SLURM_LOCALID``, node
   ``SLURM_NODEID`` of the step's node list (``SLURM_STEP_NODELIST``, else
   ``SLURM_JOB_NODELIST``, expanded by ``expand_nodelist``). The chief is task 0, on the first
   node of that list. **Its port**: ``COLLECTIVE_PORT`` if set, else ``MASTER_PORT + 1`` if
   ``MASTER_PORT`` is set, else ``20000 + SLURM_JOB_ID % 10000``: every task computes the same
   port without talking, two jobs sharing a node rarely collide, and a requeued job (same
   id) gets the same port again. Two concurrent steps of one job whose first node is the same
   need ``COLLECTIVE_PORT`` (or ``COLLECTIVE_CHIEF``) each. srun ``--mpi=pmi2|pmix`` also
   sets ``PMI_*`` / ``PMIX_RANK``: Slurm wins when they agree with it; when they do not,
   ``mpirun`` started this process inside a step (its daemons are the step's tasks) and MPI
   places it.
8. MPI launcher variables (``OMPI_COMM_WORLD_RANK``/``SIZE``, ``PMI_RANK``/``PMI_SIZE``,
   ``PMIX_RANK``): the round runs over MPI, no chief address;
9. else a single process (rank 0 of 1).

``COLLECTIVE_CHIEF`` replaces any engine's chief address and ``COLLECTIVE_PORT`` the port of
every engine that derives one (torchrun, PyTorchJob, PET_*, Slurm). The local rank is
``COLLECTIVE_LOCAL_RANK``, else the engine's own (``LOCAL_RANK``, ``SLURM_LOCALID``), else the
first of ``LOCAL_RANK_VARS``. Where the engine does not say which node, a Kubernetes Indexed Job's
``JOB_COMPLETION_INDEX`` (the pod's index; JobSet pods have it too) is the node, unless JobSet's
``JOB_INDEX`` / ``JOB_GLOBAL_INDEX`` say there are several Jobs.

The command lines (``python -m collective.chief|worker``) take the cluster engines (3-7) as
defaults: ``apply_to_environ`` sets the ``COLLECTIVE_*`` variables a ``ClusterEnv``
implies (``apply_defaults``) where they are unset, so an explicit option beats a
``COLLECTIVE_*`` variable, which beats the engine, which beats the default. Rank 0 is the chief
(it trains too, but for a TF_CONFIG with a ``chief``); rank *r* > 0 is worker *r - 1*.
"""

from collective.clusterenv._common import (
    CLUSTER_VARS,
    JOBSET_VARS,
    LOCAL_RANK_VARS,
    MPI_VARS,
    PET_VARS,
    ROLES,
    SINGLE,
    SLURM_BASE_PORT,
    SLURM_PORT_SPAN,
    SLURM_STEP_VARS,
    TORCHRUN_OWN_VARS,
    TORCHRUN_VARS,
    Placement,
)
from collective.clusterenv.defaults import (
    ClusterEnv,
    apply_defaults,
    apply_to_environ,
    from_environment,
    role_mismatch,
)
from collective.clusterenv.nodelist import expand_nodelist
from collective.clusterenv.resolve import (
    Roles,
    cluster_placement,
    local_rank,
    mpi_rank,
    resolve_placement,
    resolve_roles,
)

__all__ = [
    "CLUSTER_VARS", "JOBSET_VARS", "LOCAL_RANK_VARS", "MPI_VARS", "PET_VARS", "ROLES", "SINGLE",
    "SLURM_BASE_PORT", "SLURM_PORT_SPAN", "SLURM_STEP_VARS", "TORCHRUN_OWN_VARS", "TORCHRUN_VARS",
    "ClusterEnv", "Placement", "Roles", "apply_defaults", "apply_to_environ", "cluster_placement",
    "expand_nodelist", "from_environment", "local_rank", "mpi_rank", "resolve_placement", "resolve_roles",
    "role_mismatch",
]
