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

from collective.chief.reports import write_result
from collective.chief.service import ChiefService
from collective.replicas import hold_chief_replicas
from collective.variables import VariableStore

log = logging.getLogger("collective.chief")

Drive = Callable[[ChiefService, "Callable[[], None] | None"], None]


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
    (store, digest) or None); the outcome is ``service.result()``; the drive's error is raised."""
    service = ChiefService(source, num_workers, local_devices=devices or None, **service_options)
    service.result_file = Path(result_file) if result_file else None  # written once the outcome is decided, too
    held: list[tuple[VariableStore, str]] = []

    def local() -> None:
        held.append(hold_chief_replicas(service, devices, replica_timeout))

    try:
        drive(service, local if devices else None)
        return service, (held[0] if held else None)
    finally:
        if result_file:
            write_result(Path(result_file), service.result())
        service.close()
