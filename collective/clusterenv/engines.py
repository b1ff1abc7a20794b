"""One function per engine: ``Reader`` -> ``Placement``, or None when the engine is absent.

Each one reads only its own variables (and the shared local-rank / pod-index ones) and raises
``UsageError`` naming the variables and their values when they are half set or disagree.
``collective.clusterenv.resolve`` walks them in precedence order.
"""

from __future__ import annotations

import json

from collective.clusterenv._common import (
    MPI_VARS,
    PET_VARS,
    ROLES,
    SLURM_BASE_PORT,
    SLURM_NODELIST_VARS,
    SLURM_PORT_SPAN,
    SLURM_STEP_VARS,
    TORCHRUN_OWN_VARS,
    TORCHRUN_VARS,
    Placement,
    Reader,
    join_address,
    pod_index,
    read_local_rank,
)
from collective.clusterenv.nodelist import expand_nodelist
from collective.config import parse_address
from collective.errors import UsageError

# --- COLLECTIVE_* ---------------------------------------------------------------------------------


def whole(r: Reader, name: str) -> int:
    raw = r.get(name) or ""
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name}={raw!r} is not a whole number") from None


def collective_vars(r: Reader, rank: int | None, world: int | None) -> Placement | None:
    """``COLLECTIVE_WORLD_SIZE`` + ``COLLECTIVE_RANK`` (an explicit argument replaces either);
    the chief is ``COLLECTIVE_CHIEF`` (filled in by the resolver)."""
    if not r.given("COLLECTIVE_WORLD_SIZE"):
        return None
    world = world if world is not None else whole(r, "COLLECTIVE_WORLD_SIZE")
    if rank is None:
        if not r.given("COLLECTIVE_RANK"):
            raise UsageError("COLLECTIVE_WORLD_SIZE is set but COLLECTIVE_RANK is not: set this process's rank")
        rank = whole(r, "COLLECTIVE_RANK")
    return Placement(rank, world, read_local_rank(r), pod_index(r), None, None, "COLLECTIVE_*", r.variables())


# --- TF_CONFIG ------------------------------------------------------------------------------------


def _tf_error(problem: str) -> UsageError:
    return UsageError(f"TF_CONFIG: {problem}")


def tf_config(r: Reader) -> Placement | None:
    """The chief is ``cluster.chief[0]`` (it does not train) and worker *i* is rank *i + 1*; or,
    without ``chief``, worker 0 is the chief and trains and worker *i* is rank *i*. ``node``:
    the index of this task's host among the distinct hosts of the cluster, in order."""
    text = r.get("TF_CONFIG")
    if text is None:
        return None
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
        return _tf_workers_only(r, config, cluster)
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
    rank = 0 if kind == "chief" else index + 1
    return _tf_placement(r, [chiefs[0], *workers], rank, join_address(host, port), chief_trains=False)


def _tf_workers_only(r: Reader, config: dict, cluster: dict) -> Placement:
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
    return _tf_placement(r, workers, index, join_address(host, port), chief_trains=True)


def _tf_placement(r: Reader, tasks: list[str], rank: int, chief: str, *, chief_trains: bool) -> Placement:
    hosts = [_host_of(a) for a in tasks]  # tasks in rank order
    distinct = list(dict.fromkeys(hosts))
    return Placement(rank, len(tasks), read_local_rank(r), distinct.index(hosts[rank]), len(distinct), chief,
                     "TF_CONFIG", r.variables(), chief_trains=chief_trains)


def _host_of(address: str) -> str:
    try:
        return parse_address(address, what="TF_CONFIG task")[0]
    except UsageError:  # the workers' own addresses are not used; only their hosts are compared
        return address


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


# --- chief ports ----------------------------------------------------------------------------------


def collective_port(r: Reader) -> int | None:
    return r.number("COLLECTIVE_PORT", "environment", low=1, high=65535, what=" (the chief's port)")


def _master(r: Reader, addr_var: str, port_var: str, engine: str, require=None) -> tuple[str, int]:
    """``addr_var`` and ``port_var`` (the rendezvous store's); the chief's port is
    ``COLLECTIVE_PORT`` if set, else the store's port + 1. ``require(name)`` raises when unset."""
    if require:
        require(r, addr_var)
    addr = r.get(addr_var) or ""
    if any(c.isspace() for c in addr) or addr.startswith(":") or addr.endswith(":"):
        raise UsageError(f"{engine} variable {addr_var}={addr!r} is not a host name or address")
    own = collective_port(r)
    if require:
        require(r, port_var)
    port = r.number(port_var, engine, low=1, high=65535 if own else 65534,
                    what=f" (the chief listens on {port_var}+1)")
    return addr, own or port + 1


def _fixed_nnodes(r: Reader) -> int | None:
    """``PET_NNODES`` when it is one number (torchrun also takes an elastic range ``1:4``)."""
    raw = r.get("PET_NNODES")
    if raw is None or ":" in raw:
        return None
    return r.number("PET_NNODES", "PET", low=1)


def _pet_node_rank(r: Reader, nnodes: int | None) -> int | None:
    return r.number("PET_NODE_RANK", "PET", low=0, high=None if nnodes is None else nnodes - 1,
                    what="" if nnodes is None else f" for PET_NNODES={nnodes}")


# --- torchrun and the Kubeflow PyTorchJob ----------------------------------------------------------


def _require_torchrun(r: Reader, name: str) -> None:
    if not r.given(name):
        present = [v for v in TORCHRUN_VARS if r.given(v)]
        raise UsageError(
            f"torchrun variable {name} is not set (found {', '.join(present)}); "
            f"set all of {', '.join(TORCHRUN_VARS)}, or none"
        )


def torch_family(r: Reader, *, alone_ok: bool) -> Placement | None:
    """``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``: torchrun's, or, without
    torchrun's own variables but with ``PET_*`` beside them, the Kubeflow PyTorchJob
    operator's (``RANK`` the pod's index). The chief listens at ``MASTER_PORT + 1``.

    ``alone_ok``: ``WORLD_SIZE=1`` is a single process (for ``sync``), not an error."""
    if not (r.given("MASTER_ADDR") or r.given("MASTER_PORT")):
        return None
    own = r.any(TORCHRUN_OWN_VARS)
    if not own and not r.given("RANK") and not r.given("WORLD_SIZE") and slurm_step(r):
        return None  # MASTER_* exported for an srun step: Slurm places the task, MASTER_PORT+1 its port
    source = "torchrun" if own or not r.any(PET_VARS) else "PyTorchJob"
    if alone_ok and r.given("MASTER_ADDR") and r.get("WORLD_SIZE") == "1":
        return Placement(0, 1, read_local_rank(r, ("LOCAL_RANK",)), None, None, None, source, r.variables())
    addr, port = _master(r, "MASTER_ADDR", "MASTER_PORT", "torchrun", _require_torchrun)
    _require_torchrun(r, "WORLD_SIZE")
    world = r.number("WORLD_SIZE", "torchrun", low=2, what=" (the chief and at least one worker)")
    _require_torchrun(r, "RANK")
    rank = r.number("RANK", "torchrun", low=0, high=world - 1, what=f" for WORLD_SIZE={world}")
    chief = join_address(addr, port)
    nnodes = _fixed_nnodes(r)
    pet_node = _pet_node_rank(r, nnodes)
    if source == "torchrun":
        lws = r.number("LOCAL_WORLD_SIZE", "torchrun", low=1)
        r.number("LOCAL_RANK", "torchrun", low=0, high=None if lws is None else lws - 1,
                 what="" if lws is None else f" for LOCAL_WORLD_SIZE={lws}")
        r.get("TORCHELASTIC_RUN_ID")
        nodes = r.number("GROUP_WORLD_SIZE", "torchrun", low=1) or nnodes
        node = r.number("GROUP_RANK", "torchrun", low=0, high=None if nodes is None else nodes - 1,
                        what="" if nodes is None else f" for {nodes} node(s)")
        return Placement(rank, world, read_local_rank(r, ("LOCAL_RANK",)), node, nodes, chief, source, r.variables())
    return _pytorchjob(r, rank, world, chief, nnodes, pet_node)


def _pytorchjob(r: Reader, rank: int, world: int, chief: str, nnodes: int | None, pet_node: int | None) -> Placement:
    """One process per pod (``python train.py`` as the pod's command): then ``RANK`` is the
    pod's index and ``WORLD_SIZE`` the number of pods. With several processes per pod the
    operator's ``RANK`` is still the pod's index, so only torchrun can place them."""
    nproc_raw = r.get("PET_NPROC_PER_NODE")
    nnodes_raw = r.get("PET_NNODES")
    # 'auto' / 'cpu' / 'gpu' are torchrun's words: the operator counts them as 1 in WORLD_SIZE.
    nproc = int(nproc_raw) if nproc_raw is not None and nproc_raw.isdigit() else None
    seen = ", ".join(f"{k}={v}" for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("PET_NNODES", nnodes_raw),
                                             ("PET_NPROC_PER_NODE", nproc_raw)) if v is not None)
    fix = ("start the processes with torchrun (the pod's command `torchrun train.py ...`; it reads PET_*), "
           "or give the PyTorchJob nprocPerNode: 1")
    not_torchrun = (f"Kubeflow PyTorchJob variables {seen} are set but this process was not started by torchrun "
                    f"(no {', '.join(TORCHRUN_OWN_VARS)})")
    if nproc is not None and nproc != 1:
        raise UsageError(f"{not_torchrun}: with {nproc} processes per pod RANK is the pod's index, not this "
                         f"process's rank; {fix}")
    if nnodes_raw is not None and nnodes is None:
        raise UsageError(f"{not_torchrun}: PET_NNODES={nnodes_raw!r} is an elastic range, which only torchrun "
                         f"can follow; {fix}")
    if nnodes is not None and world != nnodes:
        raise UsageError(f"{not_torchrun}: WORLD_SIZE={world} is not PET_NNODES={nnodes} x one process per pod, "
                         f"so WORLD_SIZE counts processes the pods do not run; {fix}")
    if pet_node is not None and pet_node != rank:
        raise UsageError(f"{not_torchrun}: PET_NODE_RANK={pet_node} is not RANK={rank} (one process per pod); {fix}")
    return Placement(rank, world, read_local_rank(r), rank, nnodes or world, chief, "PyTorchJob", r.variables())


# --- Kubeflow Trainer v2 / JobSet: PET_* without torchrun -------------------------------------------


def pet(r: Reader) -> Placement | None:
    """``PET_*`` (what torchrun would read) in a process torchrun did not start: one process
    per node, so rank = ``PET_NODE_RANK`` of ``PET_NNODES``; the chief listens at
    ``PET_MASTER_ADDR:PET_MASTER_PORT+1``."""
    if not r.any(PET_VARS):
        return None
    needed = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
    missing = [n for n in needed if not r.given(n)]
    if missing:
        found = ", ".join(f"{n}={r.get(n)}" for n in PET_VARS if r.given(n))
        raise UsageError(
            f"PET variable {missing[0]} is not set (found {found}) and this process was not started by torchrun: "
            f"set all of {', '.join(needed)}, or start the processes with torchrun"
        )
    nproc_raw = r.get("PET_NPROC_PER_NODE") or "1"
    nnodes_raw = r.get("PET_NNODES") or ""
    not_torchrun = (f"this process was not started by torchrun (no MASTER_ADDR, {', '.join(TORCHRUN_OWN_VARS)}), "
                    "so it is one process of its node")
    if nproc_raw != "1":
        raise UsageError(f"PET_NPROC_PER_NODE={nproc_raw!r} asks for more than one process per node, but "
                         f"{not_torchrun}: start the processes with torchrun (it reads PET_*), or set "
                         "numProcPerNode to 1")
    if ":" in nnodes_raw:
        raise UsageError(f"PET_NNODES={nnodes_raw!r} is an elastic range, which only torchrun can follow, and "
                         f"{not_torchrun}: start the processes with torchrun")
    nnodes = _fixed_nnodes(r) or 1
    node = _pet_node_rank(r, nnodes) or 0
    addr, port = _master(r, "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET")
    chief = join_address(addr, port) if nnodes > 1 else None
    return Placement(node, nnodes, read_local_rank(r), node, nnodes, chief, "PET_*", r.variables())


# --- Slurm ----------------------------------------------------------------------------------------


def slurm_step(r: Reader) -> bool:
    """A task of an srun step: ``SLURM_PROCID`` and ``SLURM_NTASKS`` and one of srun's step
    variables (a batch script has the first two, or may, but is no step)."""
    return r.given("SLURM_PROCID") and r.given("SLURM_NTASKS") and r.any(SLURM_STEP_VARS)


def _mpi_pair(r: Reader) -> tuple[str, str] | None:
    return next(((rv, sv) for rv, sv in MPI_VARS if r.given(rv) and r.given(sv)), None)


def _mpi_disagrees(r: Reader, rank: int, world: int) -> bool:
    pair = _mpi_pair(r)
    if pair is None:
        return False
    try:
        return (int(r.env[pair[0]]), int(r.env[pair[1]])) != (rank, world)
    except ValueError:
        return False  # the MPI engine names the bad value


def slurm_port(r: Reader) -> int:
    """``COLLECTIVE_PORT``, else ``MASTER_PORT + 1``, else ``20000 + SLURM_JOB_ID % 10000``."""
    own = collective_port(r)
    if own:
        return own
    master = r.number("MASTER_PORT", "Slurm", low=1, high=65534, what=" (the chief listens on MASTER_PORT+1)")
    if master:
        return master + 1
    job = r.number("SLURM_JOB_ID", "Slurm", low=0,
                   required="set COLLECTIVE_PORT to the port the chief (task 0) listens on")
    return SLURM_BASE_PORT + job % SLURM_PORT_SPAN


def slurm(r: Reader) -> Placement | None:
    """srun's task: rank ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
    local rank ``SLURM_LOCALID``, node ``SLURM_NODEID`` of the step's node list; the chief is
    task 0 on the list's first node, at ``slurm_port``. When an MPI launcher's rank and size
    disagree, mpirun started this process inside the step (its daemons are the step's tasks):
    None, and MPI places it."""
    if not slurm_step(r):
        return None
    world_var = "SLURM_STEP_NUM_TASKS" if r.given("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    world = r.number(world_var, "Slurm", low=1)
    rank = r.number("SLURM_PROCID", "Slurm", low=0, high=world - 1, what=f" for {world_var}={world}")
    if _mpi_disagrees(r, rank, world):
        return None
    local = read_local_rank(r, ("SLURM_LOCALID",))
    for name in ("SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"):
        r.get(name)
    list_var = next((n for n in SLURM_NODELIST_VARS if r.given(n)), None)
    if list_var is None:
        if world > 1:
            raise UsageError(f"Slurm variables SLURM_PROCID={rank} and {world_var}={world} are set but no node list "
                             f"({', '.join(SLURM_NODELIST_VARS)}): start the tasks with srun")
        hosts = None
    else:
        text = r.get(list_var) or ""
        hosts = expand_nodelist(text, what=list_var)
        count_var = "SLURM_STEP_NUM_NODES" if list_var == "SLURM_STEP_NODELIST" else "SLURM_JOB_NUM_NODES"
        count = r.number(count_var, "Slurm", low=1)
        if count is not None and count != len(hosts):
            raise UsageError(f"Slurm variable {count_var}={count} disagrees with {list_var}={text!r}, which names "
                             f"{len(hosts)} node(s)")
    nodes = len(hosts) if hosts else r.number("SLURM_NNODES", "Slurm", low=1)
    node = r.number("SLURM_NODEID", "Slurm", low=0)
    if node is not None and nodes is not None and node >= nodes:
        where = f"{list_var}={r.get(list_var)!r} names" if hosts else "SLURM_NNODES says there are"
        raise UsageError(f"Slurm variable SLURM_NODEID={node} is out of range: {where} {nodes} node(s) "
                         f"(0..{nodes - 1})")
    chief = join_address(hosts[0], slurm_port(r)) if world > 1 and hosts else None
    return Placement(rank, world, local, node, nodes, chief, "Slurm", r.variables())


# --- MPI launchers --------------------------------------------------------------------------------


def mpi(r: Reader) -> Placement | None:
    """``mpiexec``'s rank and size (``OMPI_COMM_WORLD_*``, ``PMI_*``): the round runs over MPI."""
    pair = _mpi_pair(r)
    if pair is None:
        return None
    rank, world = whole(r, pair[0]), whole(r, pair[1])
    note = ""
    if slurm_step(r):
        note = (f"SLURM_PROCID={r.get('SLURM_PROCID')} and SLURM_NTASKS={r.get('SLURM_NTASKS')} are the srun "
                f"step of the MPI launcher's daemons, not this process's rank: {pair[0]} places it")
    return Placement(rank, world, read_local_rank(r), pod_index(r), None, None, f"MPI ({pair[0]})", r.variables(),
                     mpi=True, note=note)
