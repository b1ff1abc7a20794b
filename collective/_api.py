"""The implementation of the public API in ``collective/__init__.py``: ``serve``, ``join``, ``sync``.

Each call reads the same settings as the command line (``options.ChiefSettings`` /
``WorkerSettings.from_env``, made from the flag table the CLI's parsers are made from) over the
process environment plus what the cluster engine implies (``collective.clusterenv``), without
changing ``os.environ``; an explicit argument beats all of them.

The chief trains too when asked (``sync`` always asks): after the plan is released it copies
its arena once per local device (no network), hashes every replica as a worker does and
reports them to its own ``ChiefService``, which releases start only when they agree as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from collective import config
from collective._waits import (
    Awaited,
    StopSignal,
    chief_awaits,
    handlers_before_the_call,
    on_stop_signals,
    stop_on_sigterm,
    stopped_from_the_start,
    worker_awaits,
)
from collective.clusterenv import resolve_roles
from collective.config import Timeouts, parse_address
from collective.errors import AbortedError, CollectiveError, ModelError, UsageError
from collective.model import ModelSource, VariableSpec
from collective.replicas import SyncResult
from collective.variables import VariableStore

log = logging.getLogger("collective")

Values = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | ModelSource | str | os.PathLike


# --- values -> a model source ------------------------------------------------------------------


class ArraysSource:
    """A mapping of names to arrays as a ``ModelSource``: specs from each array's shape and
    dtype, values copied bit for bit (C order, byte order kept)."""

    def __init__(self, values: Mapping[str, Any], *, label: str = "arrays") -> None:
        from collective.dtypes import problem as _dtype_problem

        self.description = f"{label} ({len(values)} variables)"
        self._arrays: dict[str, np.ndarray] = {}
        for name, value in values.items():
            if not isinstance(name, str) or not name:
                raise ModelError(f"{label}: variable name {name!r} is not a non-empty string")
            a = np.asarray(value)
            problem = _dtype_problem(a.dtype)
            if problem:
                raise ModelError(f"{label}: variable {name!r}: {problem}")
            self._arrays[name] = a

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """The checked arrays by name, in the mapping's order (not copied)."""
        return self._arrays

    def specs(self) -> list[VariableSpec]:
        from collective.dtypes import wire

        return [VariableSpec(n, tuple(a.shape), wire(a.dtype)) for n, a in self._arrays.items()]

    def fill(self, spec: VariableSpec, out: np.ndarray) -> None:
        out[...] = self._arrays[spec.name]


def as_source(values: Values, *, seed: int | None = None) -> ModelSource:
    """A model source for ``values``: a mapping of arrays, a callable returning one, a
    ``ModelSource``, or a preset name / spec / .npz / .safetensors path."""
    from collective.sources import load_source

    if callable(values) and not hasattr(values, "specs"):
        values = values()
    if isinstance(values, str | os.PathLike):
        return load_source(values, seed=seed)
    if isinstance(values, Mapping):
        return ArraysSource(values)
    if hasattr(values, "specs") and hasattr(values, "fill"):
        return values  # type: ignore[return-value]
    raise UsageError(
        f"values of type {type(values).__name__} are not a mapping of arrays, a model source or a model path"
    )


# --- settings: the CLI's options, read from the environment ------------------------------------


def _environ(role: str) -> dict[str, str]:
    """os.environ plus the COLLECTIVE_* defaults TF_CONFIG / torchrun imply for ``role``."""
    from collective.clusterenv import apply_to_environ

    env = dict(os.environ)
    apply_to_environ(role, env)
    return env


# What an explicit argument of serve() / join() replaces: its COLLECTIVE_* variable(s) are not
# read at all, so a bad value there cannot fail a call that never uses it.
_TIMEOUT_OPTIONS = ("join-timeout", "stall-timeout", "ready-timeout", "start-timeout",
                    "heartbeat-interval", "heartbeat-timeout")
_TLS_OPTIONS = ("tls-ca", "tls-cert", "tls-key", "tls-server-name")


def _cli_settings(role: str, env: Mapping[str, str], given: Mapping[str, Any] | None = None):
    """The settings of ``python -m collective.<role>`` under ``env`` (``ChiefSettings`` /
    ``WorkerSettings``, made from the same flags as the command line); a bad value is a
    UsageError naming the variable. ``given``: option name -> the caller's value (None: not
    given); the variables of given options are not read, since the argument wins."""
    from collective.options import ChiefSettings, WorkerSettings

    skip: list[str] = []
    for option, value in (given or {}).items():
        if value is not None:
            skip += {"timeouts": _TIMEOUT_OPTIONS, "tls": _TLS_OPTIONS}.get(option, (option,))
    return (ChiefSettings if role == "chief" else WorkerSettings).from_env(env, skip=tuple(skip))


# --- the chief -----------------------------------------------------------------------------------


def run_chief(
    source: ModelSource | Callable[[], ModelSource],
    num_workers: int,
    *,
    bind: str,
    token: str | None,
    tls,
    timeouts: Timeouts,
    shm: bool = True,
    topology: str = "auto",
    chunk_bytes: int | None = None,
    devices: Sequence[str] | None = None,
    spmd: bool = False,
    on_listening: Callable[[str, int], None] | None = None,
    result_file: str | None = None,
    max_model_bytes: int | None = None,
    shards=None,
    from_file: bool = False,
    api: bool = False,
) -> tuple[Any, tuple[VariableStore, str] | None]:
    """One round as ``python -m collective.chief`` runs it: the chief's round (``run_round``)
    driven over gRPC (an asyncio server: its threads do not grow with the workers), the join and ready
    deadlines supervised. ``devices``: the chief trains too and holds replicas there. SIGTERM /
    SIGINT fail the round (handlers installed only on the main thread, restored after). Returns
    (service, (store, digest) or None); raises the round's error.

    The port is bound first: ``source`` may be a callable making the model source, called once
    the server listens, so a port in use is reported before a long load, and whatever fails
    before the round exists (the model, the values, ``shards``) is the answer every worker's join
    gets (``chief/pending.py``); with ``spmd`` the chief keeps answering until every rank heard
    it (up to ``PRE_SERVING_LINGER`` s). ``api``: return at once and let the server answer
    ``collective status`` for ``timeouts.status_grace`` in the background (the API: the caller
    trains meanwhile), and log a WARNING naming whom the round waits for while it waits (``_waits.Awaited``)."""
    from collective.chief.pending import PendingChief
    from collective.chief.round import run_round
    from collective.transport.registry import NETWORK, lookup

    parse_address(bind, what="bind address")
    endpoint = lookup(NETWORK, "endpoint").load("endpoint")(bind, token=token, tls=tls)  # refuses a half-set TLS
    pending = PendingChief(num_workers)
    address = endpoint.start(pending)
    log.debug("chief listening on %s; loading the model", address)  # "serving on" follows once loaded
    background = False
    previous = on_stop_signals(pending)
    try:
        if on_listening is not None:
            on_listening(address, endpoint.port)
        grace = timeouts.status_grace
        if api:
            timeouts = dataclasses.replace(timeouts, status_grace=0.0)
        with (Awaited("collective.sync rank 0 (the chief)" if spmd else "the chief", chief_awaits(pending),
                      timeouts.straggler_log) if api else contextlib.nullcontext()):
            if callable(source) and not hasattr(source, "specs"):
                source = source()
            out = run_round(
                source, num_workers, _grpc_drive(pending, address), devices=devices,
                replica_timeout=timeouts.join + timeouts.rpc, result_file=result_file,
                timeouts=timeouts, chunk_bytes=chunk_bytes, shm=shm, topology=topology, spmd=spmd,
                max_model_bytes=max_model_bytes, shards=shards, from_file=from_file,
            )
        if api:
            pending.retire()  # the caller holds the result; the service's memory goes now
            threading.Thread(target=_stop_later, args=(endpoint, grace), name="chief-linger", daemon=True).start()
            background = True
        return out
    except BaseException as caught:
        exc = caught.error if isinstance(caught, StopSignal) else caught
        if pending.service is None:  # failed before the round existed: every worker hears why
            pending.refuse(exc if isinstance(exc, CollectiveError) else
                           AbortedError(f"the chief failed before serving: {type(exc).__name__}: {exc}"))
            if spmd:
                # The other ranks may still be starting (importing a framework takes seconds):
                # wait for each to hear it, longer than after a round's failure.
                wait = min(timeouts.join, max(timeouts.linger, PRE_SERVING_LINGER))
                log.warning("failed before serving: %s; telling the other ranks (waiting up to %.0f s for them)",
                            exc, wait)
                pending.linger(wait)
        if exc is caught:
            raise
        raise exc from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not background:
            endpoint.stop(grace=1.0)


# How long a chief that failed before serving waits for every SPMD rank to hear why.
PRE_SERVING_LINGER = 30.0


def _stop_later(endpoint, grace: float) -> None:
    time.sleep(grace)  # `collective status --watch` sees the outcome; the caller does not wait for it
    endpoint.stop(grace=1.0)


def _grpc_drive(pending, address: str):
    """The gRPC drive of a chief round: serve the service (through ``pending``, already
    listening) until ``supervise()`` returns (start released) or raises (the round failed), the
    chief's own replicas made beside it."""

    def drive(service, local) -> None:
        pending.serve(service)
        if pending.stopped is not None:  # stopped while it loaded: the round begins failed
            service.fail(pending.stopped)
        log.info("chief %s serving on %s; waiting for %d worker(s)", service.incarnation, address,
                 service.num_workers)
        beside = None
        if local is not None:
            def hold() -> None:
                try:
                    local()
                except CollectiveError:
                    pass  # the round failed with it; supervise() raises it

            beside = threading.Thread(target=hold, name="chief-replicas", daemon=True)
            beside.start()
        service.supervise()
        if beside is not None:
            beside.join(service.timeouts.rpc)  # start was released, so its report is in

    return drive


def serve(
    values: Values | None = None,
    *,
    workers: int | None = None,
    bind: str | None = None,
    devices: str | Sequence[str] | None = None,
    trains: bool | None = None,
    token: str | None = None,
    tls=None,
    timeouts: Timeouts | None = None,
    shm: bool | None = None,
    topology: str | None = None,
    chunk_bytes: int | None = None,
    spmd: bool = False,
    on_listening: Callable[[str, int], None] | None = None,
    shards=None,
    from_file: bool | None = None,
) -> SyncResult:
    """Be the chief of one round in this process, as ``python -m collective.chief`` is. Blocks until start
    is released (every worker, and this process's own replicas if it trains, verified).

    Every argument not given comes from the same settings as the command: ``COLLECTIVE_*``
    (``COLLECTIVE_WORKERS``, ``_BIND``, ``_MODEL``, ``_TOKEN``, ``_TLS_*``, ``_SHM``,
    ``_TOPOLOGY``, ``_CHUNK_BYTES``, the timeouts, ``_DEVICES``), then what ``TF_CONFIG`` /
    torchrun imply. ``values``: a mapping of name -> array, a callable returning one, a model
    source, or a preset / spec / .npz / .safetensors path (default ``COLLECTIVE_MODEL``).
    ``trains``: hold verified replicas of the values on ``devices`` too (default: when
    ``devices`` is given or the cluster convention makes the chief a training process).
    ``on_listening(address, port)`` is called once the server listens (``bind`` port 0 picks
    one). The gRPC server's threads do not grow with the worker count; the join and ready deadlines are
    enforced; on the main thread SIGTERM and SIGINT abort the round (handlers restored after).
    ``shards``: each training rank receives a part of the model, not a replica: ``"dim0"``
    (torch's ``Shard(0)`` of every variable) or a mapping name -> ``"dim0"`` / ``"all"`` / rank(s)
    (``collective.shards``); the training ranks are the workers, after this process if it trains.
    ``from_file``: serve a ``.safetensors`` model (a file, a sharded checkpoint's index or its
    directory, given as ``values``) straight from its files, mapped read-only, without a copy in
    memory (default ``COLLECTIVE_FROM_FILE``; see the docs, "Models").

    Returns a ``SyncResult`` (rank 0; ``summary`` is the round's summary; ``devices`` is empty
    when the chief does not train). Raises the round's ``CollectiveError`` (``JoinTimeoutError``,
    ``DeadlineError``, ``AbortedError`` naming the culprit) or ``UsageError`` for bad settings.
    """
    from collective.clusterenv import from_environment
    from collective.config import timeouts_from_args, tls_from_args
    from collective.keys import local_devices

    env = _environ("chief")
    args = _cli_settings("chief", env, {
        "workers": workers, "bind": bind, "token": token, "tls": tls, "timeouts": timeouts, "shm": shm,
        "topology": topology, "chunk-bytes": chunk_bytes, "model": values, "shards": shards,
        "from-file": from_file,
    })
    workers = workers if workers is not None else args.workers
    if workers is None:
        raise UsageError("the number of workers is required: pass workers=N or set COLLECTIVE_WORKERS")
    if trains is None:
        cluster = from_environment(env)
        trains = devices is not None or bool(cluster and cluster.chief_trains)
    with config.reading(env):
        devices = local_devices(devices if devices is not None else config.env_default("devices", "cpu:0"))
    request = shards if shards is not None else args.shards

    def load() -> ModelSource:  # called once the port is bound: what it raises reaches every worker
        source = as_source(values if values is not None else args.model, seed=args.seed)
        if request is not None:
            from collective.shards import normalize

            normalize(request, [s.name for s in source.specs()], workers + (1 if trains else 0))
        return source

    service, held = run_chief(
        load, workers,
        bind=bind or args.bind,
        token=token if token is not None else args.token,
        tls=tls if tls is not None else tls_from_args(args),
        timeouts=timeouts or timeouts_from_args(args),
        shm=args.shm if shm is None else shm,
        topology=topology or args.topology,
        chunk_bytes=chunk_bytes or args.chunk_bytes,
        devices=devices if trains else None,
        spmd=spmd,
        on_listening=on_listening,
        shards=request,
        from_file=args.from_file if from_file is None else from_file,
        api=True,
    )
    store, digest = held if held else (VariableStore(), "")
    store.start()
    placed = None
    if held and service.sharded:
        from collective.shards import placements

        placed = placements(service.await_plan(0.0))
    return SyncResult(0, workers + 1, list(devices) if trains else [], store, digest, service.result(), shards=placed)


# --- a worker ------------------------------------------------------------------------------------


def join(
    chief: str | None = None,
    *,
    devices: str | Sequence[str] | None = None,
    rank: int | None = None,
    worker_id: str | None = None,
    token: str | None = None,
    tls=None,
    timeouts: Timeouts | None = None,
    expected: Sequence[VariableSpec] | None = None,
    shm: bool | None = None,
    relay_host: str | None = "auto",
    who: str | None = None,
):
    """Join the chief as a worker in this process, as ``python -m collective.worker`` does. Blocks until
    start is released and returns the ``WorkerResult`` (``variables``: the verified replicas,
    ``var.replicas[i]`` on ``devices[i]``; the set is frozen).

    Every argument not given comes from ``COLLECTIVE_*`` (``COLLECTIVE_CHIEF``, ``_DEVICES``,
    ``_RANK`` as preferred worker rank, ``_WORKER_ID``, ``_TOKEN``, ``_TLS_*``, ``_SHM``,
    ``_EXPECT_MODEL``, the timeouts), then ``TF_CONFIG`` / torchrun. ``expected``: the
    variables this process builds itself; the chief refuses the join before any byte moves if
    its model differs, listing every difference. ``relay_host``: where this worker's relay
    listens; "auto" is the interface that reaches the chief; None: never relay to other
    workers (star topology for this worker). ``who``: this process in the WARNING it logs
    after ``Timeouts.straggler_log`` s of waiting, then every 3 times that, naming whom the
    round still waits for (default ``worker <id>``). On the main thread SIGTERM ends the call
    with ``AbortedError`` "... stopped by SIGTERM while <phase>" (exit status 143). Raises a ``CollectiveError`` naming the phase and
    the culprit; every wait has a deadline.
    """
    from collective.config import timeouts_from_args, tls_from_args
    from collective.transport.grpc import relay_client_tls
    from collective.transport.registry import NETWORK, lookup
    from collective.worker.agent import WorkerAgent
    from collective.worker.relay import Relay, host_towards

    args = _cli_settings("worker", _environ("worker"), {
        "chief": chief, "token": token, "tls": tls, "timeouts": timeouts, "shm": shm, "devices": devices,
        "rank": rank, "worker-id": worker_id, "expect-model": expected,
    })
    chief = chief or args.chief
    if not chief:
        raise UsageError("the chief's address is required: pass chief='HOST:PORT' or set COLLECTIVE_CHIEF")
    parse_address(chief, what="chief address")
    token = token if token is not None else args.token
    tls = tls if tls is not None else tls_from_args(args)
    t = timeouts or timeouts_from_args(args)
    if expected is None and args.expect_model:
        expected = as_source(args.expect_model).specs()
    Link = lookup(NETWORK, "link").load("link")  # noqa: N806 - a class
    link = Link(chief, token=token, tls=tls)
    # The chief tells children the address it saw us at: the interface that reaches the chief.
    if relay_host == "auto":
        relay_host = host_towards(chief)
    relay = None

    def connect(parent, name: str):
        # A parent relay is verified as the plan says (its worker id, or its own certificate).
        return Link(parent.relay_address, token=token, tls=relay_client_tls(tls, parent), name=name)

    previous: dict[int, Any] = {}
    try:
        # Inside the try: a Ctrl-C right after the relay server started still stops it here,
        # not in grpc's finaliser racing its serving thread (a ValueError traceback at exit).
        relay = Relay(f"{relay_host}:0", token=token, tls=tls, stall_timeout=t.stall) if relay_host else None
        agent = WorkerAgent(
            link, worker_id=worker_id or args.worker_id, devices=devices if devices is not None else args.devices,
            preferred_rank=rank if rank is not None else args.rank, timeouts=t, expected=expected,
            shm=args.shm if shm is None else shm, relay=relay, connect=connect,
        )
        previous = stop_on_sigterm(f"worker {agent.worker_id}", agent.worker_id)
        with Awaited(who or f"worker {agent.worker_id}", worker_awaits(link, f"the chief at {chief}", t.rpc),
                      t.straggler_log):
            return agent.run()
    except StopSignal as stop:  # a SIGTERM outside the agent's run (``agent.run`` raises the error itself)
        raise stop.error from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        link.close()
        if relay is not None:
            relay.stop()


# --- SPMD: every rank calls sync ----------------------------------------------------------------


def _alone(source: ModelSource, devices: list[str]) -> tuple[VariableStore, str]:
    """World size 1: the replicas are copies of the values, verified as the chief's are."""
    from collective._proto import collective_pb2 as pb
    from collective.chief.arena import materialize
    from collective.digest import worker_digest
    from collective.plan import DEFAULT_CHUNK_BYTES, build_plan
    from collective.worker.agent import make_replicas, verify_replicas

    specs, arena, digests = materialize(source)
    plan = build_plan(specs, digests, [pb.WorkerInfo(rank=0, worker_id="local", devices=devices)], arena=arena,
                      chunk_bytes=DEFAULT_CHUNK_BYTES, chief_incarnation="local", model=source.description)
    store, arenas = make_replicas(plan, arena, devices)
    verified = verify_replicas(plan, arenas, devices)
    return store, worker_digest(plan.manifest_digest, [d.chunk_digests for d in verified])


@stopped_from_the_start
def sync(
    values: Values | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    chief: str | None = None,
    devices: str | Sequence[str] | None = None,
    token: str | None = None,
    tls=None,
    timeouts: Timeouts | None = None,
    shm: bool | None = None,
    bind: str | None = None,
    shards=None,
    from_file: bool | None = None,
) -> SyncResult:
    """Make every training process hold rank 0's values, bit for bit. SPMD: every rank calls it.

    Rank 0 is the chief and trains too: it serves ``values`` to the other ``world_size - 1``
    ranks and holds verified copies of them on its own ``devices`` (no network copy). Every
    other rank receives them, one replica per device; if it passes ``values`` too, those are its
    *declared* variables (names, shapes, dtypes; their contents are ignored) and any difference
    from rank 0's fails every rank, naming this rank and listing each difference, before any
    byte moves. All ranks return once start is released.

    Roles: arguments, else ``COLLECTIVE_RANK`` + ``COLLECTIVE_WORLD_SIZE`` (+ ``COLLECTIVE_CHIEF``,
    rank 0's ``host:port``), else ``TF_CONFIG`` (a cluster of only workers: worker 0 is rank 0),
    else torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` (the chief listens on
    ``MASTER_PORT + 1``), else Trainer v2 / JobSet's ``PET_*``, else a Kubeflow PyTorchJob
    (``WORLD_SIZE`` counts pods), else an srun step (``SLURM_PROCID``/``SLURM_NTASKS``, the chief
    on the step's first node), else ``mpiexec`` (``OMPI_COMM_WORLD_*``/``PMI_*``: the round runs
    over MPI), else a single process (world size 1: copies of ``values``). One resolver decides:
    ``collective.clusterenv.resolve_placement``; ``collective doctor`` prints its answer. ``devices``: this
    process's replicas (default ``COLLECTIVE_DEVICES``, else ``cpu:0``). ``bind``: rank 0's
    listen address (default ``COLLECTIVE_BIND``, else every interface on the chief's port).

    ``shards`` (rank 0's argument; the others learn it from their plan): every rank receives
    only a part of the model, ``"dim0"`` (torch's ``Shard(0)`` over the world: rank r holds rows
    ``r*ceil(n/W)..`` of each variable, a 0-d one whole) or a mapping name -> ``"dim0"`` /
    ``"all"`` / a rank / a list of ranks (``"*"``: every other variable); ``result.arrays(i)``
    then holds this rank's pieces, named as the variables, and ``result.shards`` says which rows.
    Over gRPC, and under mpiexec (each rank's stream point to point from rank 0).

    ``from_file`` (rank 0's argument; default ``COLLECTIVE_FROM_FILE``, else off): ``values`` is
    a ``.safetensors`` file, a sharded checkpoint's index or its directory, and rank 0 serves it
    straight from its files, mapped read-only, instead of a copy in its memory (``serve``'s
    ``from_file``); with ``shards`` it then holds only its own shard and the files' pages.

    Returns a ``SyncResult``; ``result.arrays(i)`` is name -> the array on ``devices[i]``.
    Raises ``UsageError`` for bad roles or values, otherwise the round's ``CollectiveError``
    (the same one on every rank). What rank 0 finds wrong before it serves (its values, its
    ``shards``, its model) is every rank's error, over gRPC and under mpiexec alike. Under MPI,
    a failure of one other rank alone aborts the job (``MPI_Abort``), since the other ranks
    could not leave their collectives otherwise.
    """
    from collective.keys import local_devices

    roles = resolve_roles(rank, world_size, chief)
    env = dict(os.environ)
    # Rank 0 of a gRPC round checks its values and shards after binding its port (``serve``),
    # so what is wrong with them reaches every rank, not only this one.
    chief_over_grpc = roles.rank == 0 and roles.world_size > 1 and not roles.mpi

    def prepare() -> tuple[list[str], ModelSource | None, bool]:
        """This rank's checks before the round: (devices, source, from_file), or raise."""
        if roles.rank == 0 and values is None:
            raise UsageError("rank 0 must pass the values to broadcast: collective.sync(values)")
        with config.reading(env):
            devs = local_devices(devices if devices is not None else config.env_default("devices", "cpu:0"))
        log.info("sync: rank %d of %d (%s), devices %s", roles.rank, roles.world_size, roles.source, ",".join(devs))
        source = as_source(values) if values is not None and not chief_over_grpc else None
        if shards is not None and roles.rank == 0 and not chief_over_grpc:
            from collective.shards import normalize

            normalize(shards, [s.name for s in source.specs()], roles.world_size)  # a bad request fails before any work
        given = from_file
        if given is None and roles.rank == 0 and roles.world_size > 1:  # rank 0's argument alone
            with config.reading(env):
                given = config.parse_bool(config.env_default("from-file", False))
        return devs, source, bool(given)

    if roles.mpi and roles.world_size > 1:
        from collective.mpi import sync_over_mpi

        # Every rank joins MPI before any check can fail: a rank that ends before MPI_Init
        # leaves the others spinning inside theirs for ever (deaf to signals). Rank 0's failure
        # is then every rank's answer at the join step.
        with handlers_before_the_call():  # a rank blocked in MPI would not run a Python handler
            return sync_over_mpi(prepare, roles, timeouts, shards=shards)
    devices, source, from_file = prepare()
    if roles.world_size == 1:
        store, digest = _alone(source, devices)
        store.start()
        return SyncResult(0, 1, devices, store, digest)
    if roles.rank == 0:
        host, port = parse_address(roles.chief, what="the chief's address")
        bind = bind or (env.get("COLLECTIVE_BIND") or "").strip() or _bind_for(host, port)
        result = serve(
            values, workers=roles.world_size - 1, bind=bind, devices=devices, trains=True, token=token, tls=tls,
            timeouts=timeouts, shm=shm, spmd=True, shards=shards, from_file=from_file,
        )
        return result
    worker = join(
        roles.chief, devices=devices, rank=roles.rank - 1, worker_id=_worker_id(roles.rank, env), token=token,
        tls=tls, timeouts=timeouts, expected=source.specs() if source is not None else None, shm=shm,
        who=f"collective.sync rank {roles.rank}",
    )
    if worker.rank != roles.rank - 1:
        log.warning("rank %d was given worker rank %d by the chief (another process claimed %d)",
                    roles.rank, worker.rank, roles.rank - 1)
    from collective.shards import placements

    return SyncResult(worker.rank + 1, roles.world_size, list(worker.devices), worker.variables, worker.worker_digest,
                      shards=placements(worker.plan), bytes_received=worker.bytes_received,
                      plan_bytes=worker.plan.ByteSize())


def _bind_for(host: str, port: int) -> str:
    """Where rank 0 listens by default: the chief's own address when it is a loopback one (the
    other ranks are on this host; nobody else can reach it), else every interface."""
    from collective.transport.grpc.server import is_loopback

    if is_loopback(host):
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"[::]:{port}" if ":" in host else f"0.0.0.0:{port}"


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``), after a hand-off
    has freed the values a framework's tensors held before: freed blocks below glibc's mmap
    threshold (a few MiB each, as most tensors are) otherwise stay in this process's RSS. A
    no-op where there is no glibc. The round's own objects (the chief's service and arena, the
    values it served) hold each other, so a collection comes first: until then they are only
    unreachable; and a parked call of the round that the parking thread is answering right now
    holds them until it is answered, so that comes first (at most 2 s)."""
    import gc

    from collective import parking
    from collective.transport.grpc.admission import trim_heap

    parking.settle(2.0)
    gc.collect()  # all generations: automatic collections during the call may have aged them
    trim_heap()


def _worker_id(rank: int, env: Mapping[str, str]) -> str:
    """``COLLECTIVE_WORKER_ID`` if set, else ``rank-<r>@<host>``: errors then name the training
    rank and the host it runs on."""
    return (env.get("COLLECTIVE_WORKER_ID") or "").strip() or f"rank-{rank}@{socket.gethostname()}"
