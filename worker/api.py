"""The worker's Python API: ``join_cluster``, kept as a thin alias of ``collective.join``.

    import collective
    result = collective.join("chief:50051", devices="cpu:0,cpu:1")
    for var in result.variables.trainable_variables:
        ...  # var.replicas[i] is the copy on result.devices[i]

``join_cluster(chief, ...)`` is ``collective.join(chief, ...)``: it reads the same environment
as ``python -m worker`` for every argument not given, blocks until the chief releases start and
returns the verified variables (their set is frozen: creating another raises FrozenError). It
raises a ``CollectiveError`` naming the phase and culprit if the round fails; every wait in it
has a deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

from collective.config import Timeouts
from collective.model import VariableSpec
from worker.agent import WorkerResult

__all__ = ["join_cluster", "WorkerResult"]


def join_cluster(
    chief: str | None = None,
    *,
    devices: str | Sequence[str] | None = None,
    worker_id: str | None = None,
    rank: int | None = None,
    token: str | None = None,
    timeouts: Timeouts | None = None,
    expected: Sequence[VariableSpec] | None = None,
    tls=None,
    shm: bool | None = None,
    relay_host: str | None = "0.0.0.0",
) -> WorkerResult:
    """``collective.join``: see the module doc."""
    from collective._api import join

    return join(chief, devices=devices, worker_id=worker_id, rank=rank, token=token, timeouts=timeouts,
                expected=expected, tls=tls, shm=shm, relay_host=relay_host)
