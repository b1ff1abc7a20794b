"""``mpiexec -n N+1 python -m collective.mpi``: the same round over MPI. Rank 0 is the chief.

Rank 0 loads the model, serves the round as the chief and prints the summary table (and,
with ``--json``, the JSON line of ``collective launch``). Ranks 1..N are the workers, over an
MPI link. With ``--chief-trains`` (always under ``collective.sync``)
rank 0 also holds verified replicas of its own, one per ``--devices-per-worker`` device, and
start waits for them. Any failure ends every rank with a non-zero exit: a failure all
ranks learn together exits normally (also a worker's bad data: it reports it at the ready step);
any other failure of one rank aborts the job (MPI_Abort) after one log line naming the rank, its
host and the cause. A watchdog bounds every phase.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from collective import logs
from collective.config import Parser, add_flags, plain, timeouts_from_args
from collective.errors import CollectiveError, UsageError
from collective.options import MPI_FLAGS

log = logging.getLogger("collective.mpi")


def build_parser() -> argparse.ArgumentParser:
    p = _RankZeroParser(prog="mpiexec -n N+1 python -m collective.mpi", description=plain(__doc__))
    add_flags(p, MPI_FLAGS)
    return p


class _RankZeroParser(Parser):
    """Every rank parses the same command line: only rank 0 prints a usage error (not N+1 copies)."""

    def print_usage(self, file=None) -> None:
        from collective.clusterenv import mpi_rank

        if mpi_rank(os.environ) in (None, 0):
            super().print_usage(file)

    def exit(self, status=0, message=None):
        from collective.clusterenv import mpi_rank

        if mpi_rank(os.environ) not in (None, 0):
            message = None
        super().exit(status, message)


def _on_interrupt(signum, frame) -> None:
    """Ctrl-C on mpiexec reaches every rank: rank 0 says so once, and the job ends with exit 130
    (so mpiexec exits 130), from the handler itself, so no KeyboardInterrupt can surface as a
    traceback anywhere (an import, a thread's callback). See ``_end_job``."""
    from collective.clusterenv import mpi_rank

    rank = mpi_rank(os.environ)
    if rank in (None, 0):
        os.write(2, b"interrupted\n")
    _end_job(130, rank)


STOP_GRACE = 0.5  # seconds between rank 0's line and its MPI_Abort: the line gets out first
FOLLOWER_WAIT = 2.0  # a rank other than 0 ends the job itself if rank 0 has not done so by then


def _end_job(code: int, rank: int | None) -> None:
    """End this rank and the whole job with exit ``code``, from a stop signal's handler or once
    every rank heard rank 0's failure before serving (``refuse_joins``). Never returns.

    mpiexec SIGKILLs every rank as soon as the first one ends, and then exits 9 with its "BAD
    TERMINATION" banner: ranks that each exit after the same short moment end together only if
    their handlers ran within a few milliseconds of each other, which a loaded machine does not
    grant (a CI run beside two CPU-bound processes exited 9). So one rank ends the job for all:
    rank 0, after ``STOP_GRACE`` (its line, and the other ranks' lines, get out first), calls
    MPI_Abort(code), and mpiexec exits ``code`` whatever order the handlers ran in. Another rank
    does the same after ``FOLLOWER_WAIT`` if it is still running (the signal reached it but
    not rank 0). MPICH's own "application called MPI_Abort" line is not shown: ours named the
    cause. Before MPI is up (a signal during start-up), the rank just exits ``code``."""
    time.sleep(STOP_GRACE if rank in (None, 0) else FOLLOWER_WAIT)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 2)
        try:
            mpi.COMM_WORLD.Abort(code)
        finally:
            os._exit(code)
    os._exit(code)


def _end_together(comm, code: int) -> None:
    """Every rank heard the same failure at the same step (rank 0's before serving, through
    ``refuse_joins``, or a failed round's answer) and logs it: once all have (asleep, for at most ``2 * FOLLOWER_WAIT`` s), end the job with ``code`` (``_end_job``:
    rank 0's MPI_Abort, so mpiexec exits ``code`` rather than 9). Never returns."""
    from collective.transport.mpi import settle

    try:
        settle(comm, timeout=2 * FOLLOWER_WAIT, what="the end of the job")
    except CollectiveError:
        pass  # a rank that does not get there is ended by the abort all the same
    _end_job(code, comm.rank)


_WATCHDOG = None  # this rank's PhaseWatchdog once it exists: the phase a SIGTERM names


def _on_terminate(signum, frame) -> None:
    """SIGTERM (scancel, a preempting scheduler, mpiexec passing on its own) reaches every rank:
    each says in one line that it was stopped and in which phase, and the job ends with exit 143
    (128 + 15), from the handler, like Ctrl-C (``_end_job``)."""
    from collective.clusterenv import mpi_rank

    rank = mpi_rank(os.environ)
    phase = _WATCHDOG.current if _WATCHDOG is not None else None
    where = f" during {phase}" if phase else ""
    who = "chief" if rank in (None, 0) else "worker"
    line = f"rank {rank if rank is not None else 0} ({who} on {socket.gethostname()}) stopped by SIGTERM{where}\n"
    os.write(2, line.encode())  # one write: mpiexec interleaves the ranks' output at write boundaries
    _end_job(128 + signal.SIGTERM, rank)


def main(argv: list[str] | None = None) -> int:
    global _WATCHDOG
    from collective.entry import early_sigint

    signal.signal(signal.SIGINT, _on_interrupt)
    signal.signal(signal.SIGTERM, _on_terminate)
    if early_sigint():  # a Ctrl-C while the modules loaded (collective/__init__.py held it)
        _on_interrupt(signal.SIGINT, None)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    from collective.transport.mpi import PhaseWatchdog, abort, forget_shm_names

    comm = MPI.COMM_WORLD
    rank = comm.rank
    logs.configure("chief" if rank == 0 else "worker", fmt=args.log_format)
    if comm.size < 2:
        log.error("collective.mpi needs at least 2 ranks (rank 0 is the chief): run mpiexec -n N+1 with N >= 1 workers")
        return 2
    watchdog = _WATCHDOG = PhaseWatchdog(comm)
    if rank == 0 and args.result_file:
        Path(args.result_file).unlink(missing_ok=True)  # a previous run's must not pass for this one's
    try:
        watchdog.phase("start-up", timeouts_from_args(args).join)
        forget_shm_names(comm)  # nothing left in /dev/shm, even if the job is aborted or killed
        code = _chief(comm, args, watchdog) if rank == 0 else _worker(comm, args, watchdog)
    except CollectiveError as exc:
        who = "chief" if rank == 0 else "worker"
        log.error("rank %d (%s on %s) failed: %s", rank, who, socket.gethostname(), exc)
        if rank == 0:  # the file is how a launcher learns the cause (also when the job is aborted)
            _keep_failure(args, exc)
        if not getattr(exc, "refused", False):
            abort(comm, exc.exit_code)
        _end_together(comm, exc.exit_code)  # every rank heard it at the join step: all end with its code
    except BaseException:
        log.exception("rank %d failed with an unexpected error; aborting the job", rank)
        abort(comm, 1)
    watchdog.stop()
    return code


def _keep_failure(args, exc: CollectiveError) -> None:
    """Rank 0 fails before or outside its round: its result file, if the round wrote none."""
    from collective.chief.reports import failed_summary, write_result

    if args.result_file and not Path(args.result_file).exists():
        write_result(Path(args.result_file), failed_summary(exc, transport="mpi", model=args.model, culprit="chief"))


def _chief(comm, args, watchdog) -> int:
    from collective.chief.round import load_source_reporting
    from collective.summary import summary_table

    timeouts = timeouts_from_args(args)
    watchdog.phase("load model", timeouts.join)
    devices = [f"cpu:{i}" for i in range(args.devices_per_worker)] if args.chief_trains else None
    service, _held = run_chief_rank(
        comm, lambda: load_source_reporting(args.model, seed=args.seed, result_file=args.result_file, transport="mpi"),
        watchdog, timeouts, chunk_bytes=args.chunk_bytes, split_bytes=args.split_bytes, devices=devices,
        max_model_bytes=args.max_model_bytes, from_file=args.from_file, shards=args.shards,
        result_file=args.result_file)
    result = service.result()
    if not args.no_table:
        print(summary_table(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    if not result["ok"]:
        log.error("round failed: %s", result["error"])
        # every rank heard the failure at the same step (an unheard one aborted the job): once
        # each has logged its line, one MPI_Abort ends them all with this code (``_end_job``)
        _end_together(comm, result["exit_code"] or 1)
    log.info("training started: %d workers hold %s", comm.size - 1,
             "their shards" if args.shards is not None else "identical variables")
    return 0


def run_chief_rank(comm, source, watchdog, timeouts, *, chunk_bytes=None, split_bytes=None, devices=None,
                   spmd=False, max_model_bytes=None, from_file=False, shards=None, result_file=None):
    """Rank 0's round: the chief's round (``run_round``) driven by the MPI collectives; with
    ``devices``, the chief's own replicas too. ``source``: the model source, or a callable
    making it (its checks then fail the round as the rest does). ``from_file``: the model's
    files mapped, not copied (the plan waits for them to be read: the ranks derive every
    trailer from it). Returns (service, (store, digest) or None); the outcome is
    ``service.result()``.

    Whatever fails before the round is served (the source, the values, ``shards``, an option)
    is every other rank's answer at the join step (``refuse_joins``: the error is raised here
    with ``refused`` set); a failure after that is carried by the driver, or leaves the ranks
    out of step (the caller aborts the job)."""
    from collective.chief.round import run_round
    from collective.errors import AbortedError
    from collective.plan import DEFAULT_CHUNK_BYTES
    from collective.transport.mpi import refuse_joins
    from collective.transport.registry import lookup

    mpi = lookup("mpi", "driver")
    serving = False

    def drive(service, local) -> None:
        nonlocal serving
        serving = True
        log.info("chief %s on rank 0; %d worker rank(s)%s", service.incarnation, comm.size - 1,
                 "; rank 0 trains too" if devices else "")
        mpi.load("driver")(comm, service, watchdog, timeouts, split_bytes=split_bytes, local=local).serve()

    try:
        if split_bytes and split_bytes >= 2**31:
            raise UsageError(f"--split-bytes {split_bytes} must stay below 2 GiB, MPI's count limit")
        if callable(source) and not hasattr(source, "specs"):
            source = source()
        return run_round(
            source, comm.size - 1, drive, devices=devices, timeouts=timeouts,
            chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES, transport=mpi.name, heartbeats=mpi.heartbeats, spmd=spmd,
            max_model_bytes=max_model_bytes, from_file=from_file, shards=shards, result_file=result_file,
        )
    except Exception as exc:
        if not serving:
            refuse_joins(comm, watchdog, timeouts, exc if isinstance(exc, CollectiveError) else
                         AbortedError(f"the chief failed before serving: {type(exc).__name__}: {exc}"))
            exc.refused = True
        raise


def run_worker_rank(comm, watchdog, timeouts, devices, *, split_bytes=None, expected=None):
    """Ranks 1..N: ``WorkerAgent`` over an MPI link. A failure every rank heard at the same step
    is raised as is; any other leaves the ranks out of step and is raised with ``.unannounced``
    set, for the caller to abort the job."""
    from collective.transport.registry import lookup
    from collective.worker.agent import WorkerAgent

    watchdog.phase("join", timeouts.join)
    link = lookup("mpi", "link").load("link")(comm, watchdog, timeouts, split_bytes=split_bytes)
    agent = WorkerAgent(
        link,
        worker_id=f"mpi-rank-{comm.rank}",
        devices=devices,
        preferred_rank=comm.rank - 1,
        timeouts=timeouts,
        expected=expected,
    )
    try:
        return agent.run()
    except CollectiveError as exc:
        exc.unannounced = exc is not link.announced and not link.failure_heard
        raise


def _worker(comm, args, watchdog) -> int:
    timeouts = timeouts_from_args(args)
    devices = [f"cpu:{i}" for i in range(args.devices_per_worker)]
    try:
        result = run_worker_rank(comm, watchdog, timeouts, devices, split_bytes=args.split_bytes)
    except CollectiveError as exc:
        if not exc.unannounced:  # every rank got it at the same step: no need to abort them
            log.error("rank %d (worker on %s): %s", comm.rank, socket.gethostname(), exc)
            # the first rank to exit non-zero gets the others SIGKILLed by mpiexec, their lines
            # unwritten: every rank logs, then all end together with one code
            _end_together(comm, exc.exit_code)
        raise
    result.log_started()
    return 0


def sync_over_mpi(prepare, roles, timeouts=None, shards=None):
    """``collective.sync`` under mpiexec: rank 0 serves its values and trains too, every other
    rank receives (declaring its own values' variables if given). ``prepare()``: this rank's
    checks, called once MPI is up, returning (devices, source, from_file): a rank that ended
    before MPI_Init would leave the others spinning inside theirs, deaf even to Ctrl-C. Rank 0's
    failure before serving is every rank's answer at the join step (``refuse_joins``), raised on
    every rank; a failure every rank heard together is raised on every rank; a failure of one
    rank alone aborts the job (MPI_Abort), as the command does, since the others cannot leave
    their collectives otherwise. With ``shards`` each rank gets its own plan and its own stream,
    point to point from rank 0."""
    from mpi4py import MPI

    from collective.config import Timeouts
    from collective.errors import AbortedError
    from collective.replicas import SyncResult
    from collective.shards import placements
    from collective.transport.mpi import PhaseWatchdog, abort, refuse_joins

    comm = MPI.COMM_WORLD
    if (comm.rank, comm.size) != (roles.rank, roles.world_size):
        raise UsageError(
            f"MPI says rank {comm.rank} of {comm.size}, but {roles.source} says rank {roles.rank} of "
            f"{roles.world_size}; under mpiexec leave rank and world size to MPI"
        )
    timeouts = timeouts or Timeouts()
    watchdog = PhaseWatchdog(comm)
    try:
        if comm.rank == 0:
            try:
                try:
                    devices, source, from_file = prepare()
                except CollectiveError as exc:  # every rank's answer at the join step
                    refuse_joins(comm, watchdog, timeouts, exc)
                    raise
                service, held = run_chief_rank(comm, source, watchdog, timeouts, devices=devices, spmd=True,
                                               shards=shards, from_file=from_file)
            except CollectiveError as exc:
                # Refused at the join step: every rank raises it. Else the driver did not carry it:
                # the workers wait in a collective.
                exc.unannounced = not getattr(exc, "refused", False)
                raise
            result = service.result()
            if not result["ok"]:  # every rank heard it at the same step
                raise service.error or AbortedError(f"round failed: {result['error']}")
            store, digest = held
            store.start()
            placed = placements(service.await_plan(0.0)) if service.sharded else None
            return SyncResult(0, comm.size, list(devices), store, digest, result, shards=placed)
        try:
            devices, source, _ = prepare()
        except CollectiveError as exc:
            exc.unannounced = True  # this rank alone: it cannot take part in the round
            raise
        worker = run_worker_rank(comm, watchdog, timeouts, devices,
                                 expected=source.specs() if source is not None else None)
        return SyncResult(comm.rank, comm.size, list(worker.devices), worker.variables, worker.worker_digest,
                          shards=placements(worker.plan), bytes_received=worker.bytes_received,
                          plan_bytes=worker.plan.ByteSize())
    except Exception as exc:
        if not isinstance(exc, CollectiveError) or getattr(exc, "unannounced", False):
            log.error("rank %d on %s failed alone: %s; aborting the job", comm.rank, socket.gethostname(), exc)
            abort(comm, getattr(exc, "exit_code", 1))
        raise
    finally:
        watchdog.stop()


if __name__ == "__main__":
    sys.exit(main())
