"""The chief process's main loop: the join and ready deadlines, the heartbeat leases, the log of
whom the round waits for, and the linger that lets every worker hear the outcome from the chief.

``Supervisor`` runs under its ``ChiefService``'s lock and changes the round only through it
(``fail``, ``lost``, the rejoin window), as ``chief/rejoin.py`` does.
"""

from __future__ import annotations

import logging
import threading
import time

from collective import logs, parking
from collective._proto import collective_pb2 as pb
from collective.chief import reports
from collective.chief.members import Phase
from collective.chief.state import RoundState
from collective.errors import AbortedError, DeadlineError, JoinTimeoutError

log = logging.getLogger(__name__)

# How long a worker's call cut off mid-broadcast waits for that worker's own report of why it
# went (seconds): the report and the cut travel on different connections, in either order.
CAUSE_GRACE = 0.75


class Supervisor:
    """The deadlines and leases of one ``ChiefService`` round, and whom it waits for."""

    def __init__(self, svc, state: RoundState) -> None:
        self._svc, self._round = svc, state
        self._last_log = state.started_at
        self._tick: tuple[float, float, int] | None = None  # run()'s last turn: clock, CPU, members
        # incarnation -> (ref, reason) of a member whose cut calls wait for its cause (await_cause)
        self._awaiting: dict[str, tuple[pb.WorkerRef, str]] = {}

    def waiting_for(self) -> str:
        """Whom the round waits for: free ranks while joining, then each member not yet ready."""
        svc, rnd = self._svc, self._round
        if rnd.phase is Phase.JOINING:
            missing, ranks = self._missing()
            if not missing:
                return "the model's files to be read and hashed"
            return f"{missing} more worker(s) to join (free {ranks.replace('rank(s)', 'ranks')})"
        total = svc.arena.nbytes / 2**20
        late = [
            m.name() + (f" [receiving {m.received() / 2**20:.1f}/{total:.1f} MiB]" if m.phase == "receiving" else f" [{m.phase}]")
            for m in sorted(rnd.members.values(), key=lambda m: m.rank)
            if m.phase not in ("ready", "started")
        ]
        if rnd.local is not None and rnd.local.phase != "ready":
            late.append(rnd.local.name())
        if rnd.plan is not None and rnd.plan.digests_follow:  # the workers check against them
            late.insert(0, "the model's files to be read and hashed (the chief)")
        return ", ".join(late) or "nobody"

    def _missing(self) -> tuple[int, str]:
        """How many workers have not joined, and their free ranks as the user knows them: in
        SPMD (``collective.sync``) the training ranks, worker rank + 1 (rank 0 is the chief)."""
        svc, rnd = self._svc, self._round
        taken = {m.rank for m in rnd.members.values()}
        free = [r for r in range(svc.num_workers) if r not in taken]
        if svc.spmd:
            return svc.num_workers - len(rnd.members), "training rank(s) " + ",".join(str(r + 1) for r in free)
        return svc.num_workers - len(rnd.members), "rank(s) " + ",".join(map(str, free))

    def joined_summary(self) -> str:
        svc, rnd = self._svc, self._round
        rank = "training rank {}" if svc.spmd else "rank {}"  # SPMD: rank 0 is the chief
        names = ", ".join(f"{m.worker_id} " + rank.format(m.rank + svc.spmd)
                          for m in sorted(rnd.members.values(), key=lambda m: m.rank))
        return f"{len(rnd.members)}/{svc.num_workers} workers joined ({names or 'none'})"

    def check_leases(self) -> None:
        svc, rnd = self._svc, self._round
        if not svc.heartbeats or rnd.phase not in (Phase.JOINING, Phase.BROADCASTING):
            return
        svc.rejoins.check()
        now = time.monotonic()
        for m in list(rnd.members.values()):
            silent = now - m.last_seen
            if silent > svc.timeouts.lease and not m.told and m.phase != "lost":
                ref = pb.WorkerRef(worker_id=m.worker_id, incarnation=m.incarnation, secret=m.secret)
                svc.lost(ref, f"no heartbeat for {silent:.1f} s (lease {svc.timeouts.lease:g} s)")

    def await_cause(self, m, ref: pb.WorkerRef, reason: str) -> None:
        """``svc.lost(ref, reason)`` in up to ``CAUSE_GRACE`` s, unless ``m`` says why it went
        meanwhile (its ReportFailure fails the round naming the cause) or the round ends
        otherwise. A worker that failed reports, then exits, and the cut of its presence call
        may come first. In a thread: ``lost`` is a transport's callback. Call with the lock held."""
        rnd = self._round
        if m.incarnation in self._awaiting:  # one wait per member, however many of its calls are cut
            return
        self._awaiting[m.incarnation] = (ref, reason)

        def wait() -> None:
            with rnd.cond:
                rnd.wait(lambda: m.told or rnd.phase is not Phase.BROADCASTING, CAUSE_GRACE)
                self.cut_now(m)

        threading.Thread(target=wait, name="await-cause", daemon=True).start()

    def cut_now(self, m) -> None:
        """Declare ``m`` lost now if its calls were cut and it is still given the time to say why
        (``await_cause``): a restart of it joining is news enough that the old process is gone.
        Only the holder's own calls (its secret) start that wait, so no one else can end it."""
        held = self._awaiting.pop(m.incarnation, None)
        if held is not None:
            self._svc.lost(*held, after_grace=True)

    def stopped(self) -> bool:
        """Fail the round naming the chief if this loop did not run for about a lease while
        workers were members (SIGSTOP and SIGCONT, a paused VM, a process starved of CPU): the
        workers gave up on a silent chief by then, and the calls they left cut off must not be
        blamed on them. True if so. Also asked by ``lost``, which may run first after a wake."""
        svc, rnd = self._svc, self._round
        if self._tick is None:  # not supervised (yet): nothing to measure
            return False
        now, cpu = time.monotonic(), time.process_time()
        (then, cpu_then, members), self._tick = self._tick, (now, cpu, len(rnd.members))
        members = max(members, len(rnd.members))  # one may have joined just before the stop
        gap = now - then
        # A turn takes at most lease/4. A worker whose last answer came a heartbeat before the
        # stop gives up after lease - heartbeat of it.
        t = svc.timeouts
        if not svc.heartbeats or not members or gap <= max(t.lease - t.heartbeat, t.lease / 2):
            return False
        # Stopped, the process uses no CPU; busy (a long call holding the lock), it does.
        how = "stopped" if cpu - cpu_then < gap / 2 else "too busy to answer"
        svc.fail(AbortedError(
            f"the chief was {how} for {gap:.1f} s ({'frozen' if how == 'stopped' else 'unresponsive'}); the "
            f"workers gave up on it (their lease is {svc.timeouts.lease:g} s) during {rnd.phase.value}",
            culprit="chief", phase=rnd.phase.value))
        return True

    def _poll(self) -> float:
        t = self._svc.timeouts
        return min(t.straggler_log, t.heartbeat / 2, t.lease / 4)

    def _log_stragglers(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log >= self._svc.timeouts.straggler_log:
            self._last_log = now
            log.info(fmt, *args)

    def run(self) -> None:
        """Block until the round has an outcome, enforcing the join and ready deadlines.

        Returns when start was released; raises the round's error otherwise. Logs whom it is
        waiting for every ``timeouts.straggler_log`` seconds.
        """
        logs.phase("join")
        svc, rnd = self._svc, self._round
        t = svc.timeouts
        with rnd.cond:
            self._tick = (time.monotonic(), time.process_time(), len(rnd.members))
            deadline = rnd.started_at + t.join
            while rnd.phase is Phase.JOINING and not self.stopped():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing, ranks = self._missing()
                    why = (f"missing: {missing} worker(s) for {ranks}" if missing
                           else "the model's files were still being read and hashed")
                    err = JoinTimeoutError(
                        f"{self.joined_summary()}; {why} after the {t.join:g} s join timeout", phase="join"
                    )
                    svc.fail(err)  # the lock is reentrant
                    break
                self.check_leases()
                if not rnd.wait(lambda: rnd.phase is not Phase.JOINING, min(left, self._poll())):
                    self._log_stragglers("waiting for %s; %s", self.waiting_for(), self.joined_summary())
            deadline = time.monotonic() + t.ready
            while rnd.phase is Phase.BROADCASTING and not self.stopped():
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [m.worker_id for m in rnd.members.values() if m.phase not in ("ready", "started")]
                    err = DeadlineError(f"not every worker was ready within {t.ready:g} s; not ready: {self.waiting_for()}",
                                        culprit=late[0] if len(late) == 1 else None, phase="broadcast")
                    svc.fail(err)  # the lock is reentrant
                    break
                self.check_leases()
                if not rnd.wait(lambda: rnd.phase is not Phase.BROADCASTING, min(left, self._poll())):
                    self._log_stragglers("broadcasting; waiting for %s", self.waiting_for())
            reports.write_outcome(svc, rnd)  # before lingering: the outcome may be all a stopped chief leaves
            self.linger()
            rnd.wait(lambda: False, t.status_grace)  # let `collective status --watch` see the outcome
            parked = parking.stats()
            if parked["tries"] or parked["checks"]:  # a server that parks its calls (collective.parking)
                log.debug("parked calls: %d tried again, %d predicates asked, %d looked at, %d still parked",
                         parked["tries"], parked["checks"], parked["looked"], parked["parked"])
            if rnd.phase is Phase.FAILED:
                raise rnd.error or AbortedError("the round failed")

    def linger(self) -> None:
        """Keep serving after the outcome until every worker has heard it from us, not from a dead
        port: a worker on a loaded host may ask for start long after it was released, and one the
        chief stopped for first would fail its job. A worker that cannot hear is not waited for:
        one whose call was cut off (its process gone: ``ChiefService.lost``), or one silent for a
        lease since the outcome (frozen; with heartbeats only: a worker asking for start still
        heartbeats). At most ``Timeouts.linger`` s (``--linger``); who was not told is logged then."""
        rnd, t = self._round, self._svc.timeouts
        since = time.monotonic()
        end = since + t.linger
        while not rnd.wait(lambda: self._everyone_heard(since), min(max(end - time.monotonic(), 0.0), self._poll())):
            waiting = [m for m in self._by_rank() if not self._heard(m, since)]
            if time.monotonic() >= end:
                log.warning("stopping after the %g s linger (--linger) with %d worker(s) not told the outcome: %s",
                            t.linger, len(waiting), logs.first_of([m.name() for m in waiting], 20, ", "))
                return
            self._log_stragglers("%s; telling the outcome to %d worker(s) that have not asked for it yet",
                                 rnd.phase.value, len(waiting))
        untold = [m.name() + (" (a call of its was cut off)" if m.gone else " (silent for a lease)")
                  for m in self._by_rank() if not m.told]
        if untold:
            log.warning("%d worker(s) did not hear the outcome: %s", len(untold), logs.first_of(untold, 20, ", "))

    def _by_rank(self) -> list:
        return sorted(self._round.members.values(), key=lambda m: m.rank)

    def _heard(self, m, since: float, now: float | None = None) -> bool:
        """``m`` was told the outcome, or cannot be (``linger``)."""
        if m.told or m.gone:
            return True
        svc = self._svc
        now = time.monotonic() if now is None else now
        return svc.heartbeats and now - max(m.last_seen, since) > svc.timeouts.lease

    def _everyone_heard(self, since: float) -> bool:
        """Every member heard the outcome or cannot (``_heard``); after an SPMD failure, every rank did (members or not)."""
        svc, rnd, now = self._svc, self._round, time.monotonic()
        if not all(self._heard(m, since, now) for m in rnd.members.values()):
            return False
        if svc.spmd and rnd.phase is Phase.FAILED:
            return len(rnd.told_outside | set(rnd.members)) >= svc.num_workers
        return True
