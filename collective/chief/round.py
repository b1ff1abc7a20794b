"""One chief round, whatever carries it: gRPC (``python -m collective.chief``, ``collective.serve``)
and MPI (``python -m collective.mpi``, ``collective.sync`` under mpiexec) both run it.

The round is the same in both: make the ``ChiefService``; if the chief trains, hold its own
verified replicas (start waits for them); let the transport drive the service until start is
released or the round fails; write the summary; release the arena. What differs is only the
``drive(service, local)`` callable the transport passes: the gRPC one serves an endpoint and
supervises the deadlines, running ``local`` beside it; the MPI one runs the collectives and
calls ``local`` once the plan is out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from collective.chief.reports import failed_summary, write_result
from collective.chief.service import ChiefService
from collective.errors import CollectiveError
from collective.replicas import hold_chief_replicas
from collective.variables import VariableStore

log = logging.getLogger("collective.chief")

Drive = Callable[[ChiefService, "Callable[[], None] | None"], None]


def load_source_reporting(ref: str, *, seed: int | None, result_file: str | None, transport: str):
    """``load_source``; a model that will not load is the round's outcome too: the summary (the
    chief blamed, phase ``load``) goes to ``result_file`` before the error is raised."""
    from collective.sources import load_source

    try:
        return load_source(ref, seed=seed)
    except CollectiveError as exc:
        _blame_chief(exc)
        if result_file:
            write_result(Path(result_file), failed_summary(exc, transport=transport, model=ref))
        raise


def _blame_chief(exc: CollectiveError) -> None:
    """An error the chief met before any round (its model, its shard request): its own, in the
    load phase, unless it names another party already. On the error itself, so every rank that
    hears it (collective.sync) reads the same culprit and phase as the summary."""
    exc.culprit, exc.phase = exc.culprit or "chief", exc.phase or "load"


def run_round(
    source: Any,
    num_workers: int,
    drive: Drive,
    *,
    devices: Sequence[str] | None = None,
    replica_timeout: float = 0.0,
    result_file: str | None = None,
    **service_options: Any,
) -> tuple[ChiefService, tuple[VariableStore, str] | None]:
    """Run one round of ``source`` to ``num_workers`` workers with ``drive``. ``devices``: the
    chief trains too and holds one replica per device, made once the plan is out (waiting up to
    ``replica_timeout`` for it). ``service_options`` go to ``ChiefService``. Returns (service,
    (store, digest) or None); the outcome is ``service.result()``; the drive's error is raised.
    ``result_file``: the summary, written as soon as the round has its outcome and again at the end."""
    transport = service_options.get("transport", "grpc")
    try:
        service = ChiefService(source, num_workers, local_devices=devices or None, **service_options)
    except CollectiveError as exc:  # the model did not fit, a bad shard request or option: no round at all
        _blame_chief(exc)
        if result_file:
            write_result(Path(result_file), failed_summary(exc, transport=transport, model=source.description))
        raise
    service.result_file = Path(result_file) if result_file else None  # written once the outcome is decided, too
    held: list[tuple[VariableStore, str]] = []

    def local() -> None:
        held.append(hold_chief_replicas(service, devices, replica_timeout))

    failure: CollectiveError | None = None
    try:
        drive(service, local if devices else None)
        return service, (held[0] if held else None)
    except CollectiveError as exc:
        failure = exc
        raise
    finally:
        if result_file:
            result = service.result()
            if failure is not None and result["error"] is None:  # the drive's own error, not the service's
                result.update({k: v for k, v in failed_summary(failure, transport=transport, model=None).items()
                               if k in ("ok", "exit_code", "error", "culprit", "error_phase")})
            write_result(Path(result_file), result)
        service.close()
