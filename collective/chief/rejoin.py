"""A worker lost mid-broadcast may come back, and the others go on meanwhile.

When a member is lost during the broadcast (its calls cut off, or its lease run out), the chief
does not fail the round at once: it waits up to ``Timeouts.rejoin`` seconds (``--rejoin-timeout``;
the default 0 fails the round at once, as before) for a process with the same worker id and a
new incarnation. Meanwhile:

* The lost worker's children move up. The chief revises its plan: every worker whose parent
  was lost receives from its nearest ancestor never lost in this round (the chief at worst); in
  a double tree, each tree on its own (``WorkerInfo.parent``, ``parent_b``). A
  child whose relay stream broke asks the chief for the current plan (``GetPlan``) and resumes
  from its new parent at the first byte it lacks (``WorkerRef.resume_from``); an ancestor holds
  at least every byte its descendants hold, so nothing waits for the restart.
* The restarted process takes the lost one's rank (with the same devices), gets the revised
  plan naming its new incarnation and relay, receives the whole arena from its own nearest live
  ancestor and verifies and reports like everyone. It feeds nobody: its former children stay
  where they moved. A rank once lost is never a parent again in this round.
* Start waits for every rank ready, the rejoined one included, every digest checked as ever.
* A lost worker not back within the window fails the round naming it ("... was lost during the
  broadcast: <why>; it did not rejoin within T s"). A lost incarnation is dead to the chief: if
  that process comes back (SIGCONT, a healed link) its calls are refused, and it exits.

A new incarnation joining while the chief still holds the old one as live (a frozen process, a
cut link not yet past its lease) is refused (ALREADY_EXISTS): without its secret, a join under
a member's id proves nothing, and a live member keeps its slot. Once the chief declares the old
one lost (its calls cut off, or its lease run out), the restart may join.

Only with heartbeats (gRPC, in-memory): under MPI (``heartbeats=False``) a lost rank fails the
round as before, since mpirun restarts the whole job, never one rank.
"""

from __future__ import annotations

import logging
import time

from collective._proto import collective_pb2 as pb
from collective.chief.members import Member, Phase
from collective.chief.state import RoundState
from collective.errors import AbortedError, AlreadyExistsError, PreconditionError

log = logging.getLogger(__name__)


def nearest_live(parents: dict[int, int], lost: set[int], rank: int) -> int:
    """Whom ``rank`` receives from when the ranks in ``lost`` are gone: its nearest ancestor
    under ``parents`` (rank -> parent rank, -1 the chief) that is not in ``lost``."""
    p = parents[rank]
    while p in lost:
        p = parents[p]
    return p


def _sender(rank: int) -> str:
    return "the chief" if rank < 0 else f"rank {rank}"


class Rejoins:
    """The rejoin state of one ``ChiefService``; every method runs with its lock held."""

    def __init__(self, service, state: RoundState) -> None:
        self._svc, self._round = service, state
        self._parents: dict[int, int] | None = None  # the plan's first parents
        self._parents_b: dict[int, int] = {}  # a double tree's tree B (WorkerInfo.parent_b): the first ones
        self.lost: set[int] = set()  # ranks lost at some point of this broadcast
        self.rejoined: list[str] = []  # worker ids, one entry per comeback

    @property
    def window(self) -> float:
        return self._svc.timeouts.rejoin

    def waits(self) -> bool:
        return bool(self._svc.heartbeats) and self.window > 0 and self._round.phase is Phase.BROADCASTING

    def lost_member(self, m: Member, reason: str) -> bool:
        """``m`` (phase "lost") was lost during the broadcast. True: the round waits for it."""
        if not self.waits():
            return False
        m.lost_at, m.lost_reason = time.monotonic(), reason
        self.lost.add(m.rank)
        self._revise()
        moved = [f"{w.worker_id} from {_sender(nearest_live(ps, self.lost, m.rank))}"
                 for ps in (self._parents, self._tree_b()) for w in self._round.plan.workers
                 if ps.get(w.rank) == m.rank]
        log.warning("%s was lost during the broadcast: %s; waiting up to %g s for it to rejoin%s", m.name(), reason,
                    self.window, f" (its children now receive: {', '.join(moved)})" if moved else "")
        self._round.cond.notify_all()
        return True

    def readmit(self, old: Member, req: pb.JoinRequest, peer: str, devices: list[str]) -> Member:
        """A new incarnation of ``old`` joins after the plan is out: admit it in ``old``'s rank
        once ``old`` is lost, or fail the round (no rejoins here), or refuse it (``old`` still
        live, other devices)."""
        self._svc.restarted(old)  # its calls were cut already: its restart is the news
        if old.phase != "lost":
            # Anyone holding the token can send a join under a worker's id; only the process
            # holding the slot has its secret. A live member keeps its slot, and the round goes on.
            raise AlreadyExistsError(
                f"worker id {old.worker_id!r} is held by a live process ({old.name()}, pid {old.pid}); a restart "
                f"may rejoin once the chief has declared that one lost (its calls cut off, or no heartbeat "
                f"within the lease)")
        if not self.waits():
            err = AbortedError(f"{old.name()} restarted (a new incarnation) after "
                               f"the broadcast began; the round cannot go on", culprit=old.worker_id, phase="broadcast")
            self._svc.fail(err)
            raise err
        if list(devices) != list(old.devices):
            raise PreconditionError(f"{old.name()} restarted with devices {','.join(devices)}, not "
                                    f"{','.join(old.devices)}; a worker rejoining the round keeps its devices")
        m = Member.joining(req, old.rank, devices, peer)
        self._round.members[m.worker_id] = m
        self.rejoined.append(m.worker_id)
        self._revise()
        log.warning("%s rejoined as incarnation %s (was %s, lost %.1f s ago: %s); it receives from %s",
                    m.name(), m.incarnation, old.incarnation, time.monotonic() - old.lost_at, old.lost_reason,
                    _sender(nearest_live(self._parents, self.lost, m.rank)))
        self._round.cond.notify_all()
        return m

    def check(self) -> None:
        """Fail the round naming the first lost worker whose window has passed."""
        now = time.monotonic()
        for m in sorted(self._round.members.values(), key=lambda m: m.rank):
            if m.phase == "lost" and now - m.lost_at > self.window:
                self._svc.fail(AbortedError(
                    f"{m.name()} was lost during the broadcast: {m.lost_reason}; it did not rejoin within "
                    f"{self.window:g} s", culprit=m.worker_id, phase="broadcast"))
                return

    def _tree_b(self) -> dict[int, int]:
        """A double tree's tree B as a parents map ({} for one tree). Tree B's ancestors of a
        worker with one parent (one mapping its host leader's arena) are its parent and tree
        B's ancestors of that leader: each tree is revised on its own."""
        return {**self._parents, **self._parents_b} if self._parents_b else {}

    def _revise(self) -> None:
        """A new plan object (workers already hold the old one): parents around the lost ranks,
        and each rank's current incarnation and relay."""
        rnd = self._round
        plan = pb.Plan()
        plan.CopyFrom(rnd.plan)
        if self._parents is None:
            self._parents = {w.rank: w.parent for w in plan.workers}
            self._parents_b = {w.rank: w.parent_b for w in plan.workers if w.HasField("parent_b")}
        tree_b = self._tree_b()
        live = {m.rank: m for m in rnd.members.values() if m.phase != "lost"}
        for w in plan.workers:
            w.parent = nearest_live(self._parents, self.lost, w.rank)
            if w.rank in self._parents_b:
                w.parent_b = nearest_live(tree_b, self.lost, w.rank)
            m = live.get(w.rank)
            if m is not None and m.incarnation != w.incarnation:
                w.incarnation, w.host, w.relay_address, w.relay_cert = (m.incarnation, m.host, m.relay_address(),
                                                                        m.relay_cert)
        rnd.plan = plan
