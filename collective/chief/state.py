"""The state of one chief round, as one public object: who joined, the phase, the plan, the
error, the clock marks of the summary. ``ChiefService`` changes it; ``supervise``, ``rejoin`` and
``reports`` take it as an argument and read (or, through the service, change) it under ``cond``.
"""

from __future__ import annotations

import threading
import time

from collective import parking
from collective._proto import collective_pb2 as pb
from collective.chief.members import Member, Phase
from collective.errors import CollectiveError


class RoundState:
    """One round's state. Read and write every field with ``cond`` held (reentrant: a failure
    may be declared under it); ``wait`` blocks on it, or parks a server's call."""

    def __init__(self, local: Member | None, created_at: float) -> None:
        # a parking.Condition, so a server may park the calls that wait on it
        self.cond = parking.Condition(threading.RLock())
        self.members: dict[str, Member] = {}  # by worker id; a rejoin replaces its entry
        self.local = local  # the chief's own replicas when it trains too, else None
        # Processes told the failure that never became members (refused, or joining after the end):
        # an SPMD chief lingers until every rank has heard, so a slow rank hears the cause, not a dead port.
        self.told_outside: set[str] = set()
        self.phase = Phase.JOINING
        self.error: CollectiveError | None = None  # the first failure: what every worker is told
        self.plan: pb.Plan | None = None  # once released (a rejoin revises it: a new object)
        # The clock (monotonic): the model loaded from, the round serving from, the phase
        # entered, the first byte sent, start released; ``marks``: plan released, last byte sent.
        self.created_at = created_at
        self.started_at = self.phase_at = time.monotonic()
        self.first_byte_at: float | None = None
        self.ready_at: float | None = None
        self.marks: dict[str, float] = {}
        # The barrier before the first byte (``all_prepared``): members marked prepared (one
        # replaced by a rejoin still counts, so it never counts short), and whether every member
        # was prepared once (the barrier then stays open).
        self.prepared_count = 0
        self.barrier_open = False

    def mark_prepared(self, m: Member) -> None:
        if not m.prepared:
            m.prepared = True
            self.prepared_count += 1

    def all_prepared(self) -> bool:
        """Every member prepared (once true, true for the round: the first bytes are out). Each
        parked AwaitPrepared asks it, so it reads the members only once the count says they may
        all be: 1,024 workers asking it of 1,024 members was a million reads a barrier."""
        if not self.barrier_open and self.prepared_count >= len(self.members):
            self.barrier_open = all(x.prepared for x in self.members.values())
        return self.barrier_open

    def plan_complete(self) -> bool:
        """The plan is out with every digest (none to follow: ``Plan.digests_follow``)."""
        return self.plan is not None and not self.plan.digests_follow

    def wait(self, predicate, timeout: float, key: str | None = None) -> bool:
        """Blocks, or in a server's poll mode raises parking.NotYet: the caller parks, holding no
        thread. ``key``: what it waits for, the same predicate for every caller (parking.wait_for)."""
        return parking.wait_for(self.cond, predicate, timeout, key)
