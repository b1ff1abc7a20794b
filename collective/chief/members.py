"""The chief's view of its members: the round's phases, a member's record, and what a ready
report must show. (The model's arena is ``chief/arena.py``'s.)"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field

from collective import logs
from collective._proto import collective_pb2 as pb
from collective.digest import worker_digest
from collective.plan import differing_chunk, overlapping
from collective.variables import replica_name


class Phase(enum.Enum):
    JOINING = "joining"
    BROADCASTING = "broadcasting"
    STARTED = "started"
    FAILED = "failed"


@dataclass
class Member:
    rank: int
    worker_id: str
    incarnation: str
    host: str
    devices: list[str]
    peer: str
    pid: int
    phase: str = "joined"
    bytes_sent: int = 0
    worker_digest: str = ""
    prepared: bool = False
    mapped: bool = False  # took the chief's arena through shared memory (no stream)
    told: bool = False
    gone: bool = False  # after the outcome, a call of its was cut off: it cannot be told (Supervisor.linger)
    joined_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    relay_port: int = 0
    relay_cert: bytes = b""  # server-only TLS: the certificate its relay serves
    bytes_reported: int = 0  # what its heartbeats say it holds, from whichever sender
    lost_at: float = 0.0  # phase "lost": when, and why (collective.chief.rejoin)
    lost_reason: str = ""
    # Proof of identity (never printed, logged, or put in the plan or a status): the secret the
    # chief made for this member and sent it alone (JoinReply.secret), required on its every
    # later call; and the key its process joined with, which a retried join must repeat.
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    join_key: str = field(default="", repr=False)

    @classmethod
    def joining(cls, req: pb.JoinRequest, rank: int, devices: list[str], peer: str) -> Member:
        """The member a JoinRequest makes, in ``rank``, with a fresh secret."""
        return cls(rank, req.worker_id, req.incarnation, req.host or peer, devices, peer, req.pid,
                   relay_port=req.relay_port, relay_cert=req.relay_cert, join_key=req.join_key)

    def received(self) -> int:
        """Bytes of the arena this worker holds: what the chief sent it, or what its heartbeats
        report (a relay-fed worker gets nothing from the chief)."""
        return max(self.bytes_sent, self.bytes_reported)

    def relay_address(self) -> str:
        """Where this worker relays: the address it connected from, with its relay port."""
        if not self.relay_port:
            return ""
        kind, _, rest = self.peer.partition(":")
        host = rest.rpartition(":")[0] if kind in ("ipv4", "ipv6") else ""
        return f"{host}:{self.relay_port}" if host else ""

    def name(self) -> str:
        return f"worker {logs.printable(self.worker_id)} (rank {self.rank}, host {logs.printable(self.host)})"

    def replica_names(self, variable: str) -> list[str]:
        return [replica_name(variable, i) for i in range(len(self.devices))]


class _ChiefReplicas(Member):
    """The chief's own replicas when the chief trains too: checked as a worker's are, but never
    a member of the plan (no rank among the workers, no stream, no heartbeat)."""

    def name(self) -> str:
        return f"the chief's own replicas (training rank 0, host {self.host})"


def report_problem(plan: pb.Plan, m: Member, req: pb.ReadyRequest) -> str | None:
    """The first difference between a member's ready report and the plan, or None.

    Every replica arena (one per device) must have the plan's chunk digests. A chunk that
    differs is named by the variables it holds: one variable's replica exactly, several as
    the range of their names.
    """
    want = list(plan.chunk_digests)
    if [(d.replica, d.device) for d in req.devices] != list(enumerate(m.devices)):
        return (
            f"ready report covers devices {[d.device for d in req.devices]}; "
            f"the worker joined with {list(m.devices)}"
        )
    for d in req.devices:
        got = list(d.chunk_digests)
        differs = differing_chunk(plan, got, want)
        if differs is None:
            continue
        if len(got) != len(want):
            return f"replicas on {d.device}: {len(got)} chunk digests, the plan has {len(want)}"
        start, end = differs
        k = start // plan.chunk_bytes
        names = [v.name for v in overlapping(plan, start, end)]
        if len(names) == 1:
            what = f"variable {names[0]!r}: replica {replica_name(names[0], d.replica)!r}"
        elif names:
            what = (f"one of the {len(names)} variables {names[0]!r}..{names[-1]!r}: replicas "
                    f"{replica_name(names[0], d.replica)!r}..{replica_name(names[-1], d.replica)!r}")
        else:
            what = "padding between variables"
        return (f"{what} on {d.device}: bytes {start}..{end} have digest {got[k]}, "
                f"the chief's are {want[k]}")
    expected = worker_digest(plan.manifest_digest, [want] * len(m.devices))
    if req.worker_digest != expected:
        return f"worker digest {req.worker_digest} differs from the chief's {expected}"
    return None
