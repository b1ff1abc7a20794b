"""``mpiexec -n N+1 python -m collective.mpi``: the same round over MPI. Rank 0 is the chief.

Rank 0 loads the model, runs ``ChiefService`` behind the MPI driver and prints the summary
table (and, with ``--json``, the JSON line of ``collective launch``). Ranks 1..N run
``WorkerAgent`` with an MPI link. Any failure ends every rank with a non-zero exit: a failure all
ranks learn together exits normally; a failure of one rank aborts the job (MPI_Abort) after one
log line naming the rank, its host and the cause. A watchdog bounds every phase.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys

from collective import logs
from collective.config import (
    add_max_model_bytes_option,
    add_option,
    add_timeout_options,
    positive_int,
    timeouts_from_args,
)
from collective.errors import CollectiveError, UsageError

log = logging.getLogger("collective.mpi")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpiexec -n N+1 python -m collective.mpi", description=__doc__)
    add_option(p, "model", help="preset (mlp, transformer-100m), .yaml/.json spec, .npz or .safetensors", default="mlp")
    add_option(p, "seed", help="seed for initializer specs", type=int, default=None)
    add_max_model_bytes_option(p)
    add_option(p, "devices-per-worker", help="devices (replicas) per worker", type=positive_int, default=1)
    add_option(p, "chunk-bytes", help="bytes per chunk: the unit of keys, trailers and checks", type=positive_int,
               default=None)
    add_option(p, "split-bytes", help="largest Bcast call, whole chunks (default 256 MiB; must stay below 2 GiB)",
               type=positive_int, default=None)
    add_timeout_options(p, "join", "ready", "start")
    add_option(p, "log-format", help="text or json", default="text", choices=["text", "json"])
    p.add_argument("--json", action="store_true", help="rank 0 prints the summary as one JSON line last")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    from collective.transport.mpi import PhaseWatchdog, abort

    comm = MPI.COMM_WORLD
    rank = comm.rank
    logs.configure("chief" if rank == 0 else "worker", fmt=args.log_format)
    if comm.size < 2:
        log.error("collective.mpi needs at least 2 ranks (rank 0 is the chief): run mpiexec -n N+1 with N >= 1 workers")
        return 2
    watchdog = PhaseWatchdog(comm)
    try:
        code = _chief(comm, args, watchdog) if rank == 0 else _worker(comm, args, watchdog)
    except CollectiveError as exc:
        who = "chief" if rank == 0 else "worker"
        log.error("rank %d (%s on %s) failed: %s", rank, who, socket.gethostname(), exc)
        abort(comm, exc.exit_code)
    except BaseException:
        log.exception("rank %d failed with an unexpected error; aborting the job", rank)
        abort(comm, 1)
    watchdog.stop()
    return code


def _chief(comm, args, watchdog) -> int:
    from chief.service import ChiefService
    from collective.launch import summary_table
    from collective.plan import DEFAULT_CHUNK_BYTES
    from collective.sources import load_source
    from collective.transport.mpi import MpiChiefDriver

    timeouts = timeouts_from_args(args)
    watchdog.phase("load model", timeouts.join)
    source = load_source(args.model, seed=args.seed)
    service = ChiefService(
        source, comm.size - 1, timeouts=timeouts, chunk_bytes=args.chunk_bytes or DEFAULT_CHUNK_BYTES, transport="mpi",
        heartbeats=False, max_model_bytes=args.max_model_bytes,
    )
    log.info("chief %s on rank 0; %d worker rank(s)", service.incarnation, comm.size - 1)
    if args.split_bytes and args.split_bytes >= 2**31:
        raise UsageError(f"--split-bytes {args.split_bytes} must stay below 2 GiB, MPI's count limit")
    MpiChiefDriver(comm, service, watchdog, timeouts, split_bytes=args.split_bytes).serve()
    result = service.result()
    print(summary_table(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    if not result["ok"]:
        log.error("round failed: %s", result["error"])
        return 1
    log.info("training started: %d workers hold identical variables", comm.size - 1)
    return 0


def _worker(comm, args, watchdog) -> int:
    from collective.transport.mpi import MpiChiefLink
    from worker.agent import WorkerAgent

    timeouts = timeouts_from_args(args)
    watchdog.phase("join", timeouts.join)
    devices = [f"cpu:{i}" for i in range(args.devices_per_worker)]
    link = MpiChiefLink(comm, watchdog, timeouts, split_bytes=args.split_bytes)
    agent = WorkerAgent(
        link,
        worker_id=f"mpi-rank-{comm.rank}",
        devices=devices,
        preferred_rank=comm.rank - 1,
        timeouts=timeouts,
    )
    try:
        result = agent.run()
    except CollectiveError as exc:
        if exc is link.announced:  # every rank got it at the same step: no need to abort them
            log.error("rank %d (worker on %s): %s", comm.rank, socket.gethostname(), exc)
            return exc.exit_code
        raise
    result.log_started()
    return 0


if __name__ == "__main__":
    sys.exit(main())
