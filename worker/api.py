"""The worker's Python API, for a training script that joins the cluster in-process.

    from worker.api import join_cluster
    result = join_cluster("chief:50051", devices="cpu:0,cpu:1", token=os.environ["COLLECTIVE_TOKEN"])
    for var in result.variables.trainable_variables:
        ...  # var.replicas[i] is the copy on result.devices[i]

``join_cluster`` blocks until the chief releases start, and returns the verified variables
(their set is frozen: creating another raises FrozenError). It raises a ``CollectiveError``
naming the phase and culprit if the round fails; every wait in it has a deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

from collective._proto import collective_pb2 as pb
from collective.config import Timeouts
from collective.model import VariableSpec
from collective.transport.grpc import GrpcChiefLink, TlsFiles, relay_client_tls
from worker.agent import WorkerAgent, WorkerResult

__all__ = ["join_cluster", "WorkerResult"]


def join_cluster(
    chief: str,
    *,
    devices: str | Sequence[str] = "cpu:0",
    worker_id: str | None = None,
    rank: int = -1,
    token: str | None = None,
    timeouts: Timeouts | None = None,
    expected: Sequence[VariableSpec] | None = None,
    tls: TlsFiles | None = None,
    shm: bool = True,
    relay_host: str | None = "0.0.0.0",
) -> WorkerResult:
    """Join the chief at ``chief`` and return once start is released (see the module doc).

    ``expected``: the variables this process builds itself (SPMD style); the chief refuses the
    join before any byte moves if its model differs, listing every difference.
    """
    from worker.relay import Relay

    t = timeouts or Timeouts()
    link = GrpcChiefLink(chief, token=token, tls=tls)
    # The relay listens on every interface; the chief tells children the address it saw us at.
    relay = Relay(f"{relay_host}:0", token=token, tls=tls, stall_timeout=t.stall) if relay_host else None

    def connect(parent: pb.WorkerInfo, name: str) -> GrpcChiefLink:
        return GrpcChiefLink(parent.relay_address, token=token, tls=relay_client_tls(tls, parent), name=name)

    try:
        agent = WorkerAgent(
            link, worker_id=worker_id, devices=devices, preferred_rank=rank, timeouts=timeouts, expected=expected,
            shm=shm,
            relay=relay,
            connect=connect,
        )
        return agent.run()
    finally:
        link.close()
        if relay is not None:
            relay.stop()
