"""The worker's watch on the chief, beside the round's calls: the heartbeat (alive, how many
bytes held; the chief silent for a lease, restarted, or its round failed), the presence call held
until the round's outcome, the verdict that interrupts whatever the main thread waits on, and the
one failure report a worker sends before it goes.

``ChiefWatch`` is mixed into ``WorkerAgent``: its methods run on the agent's state. It owns the
heartbeat thread's view of the chief (``_init_watch``); it reads the agent's link, timeouts,
identity (``worker_id``, ``incarnation``, ``ref``, ``rank``) and progress (``bytes_received``,
``_last_data``).
"""

from __future__ import annotations

import logging
import threading
import time

from collective import logs
from collective._proto import collective_pb2 as pb
from collective.errors import AbortedError, ChiefUnreachableError, CollectiveError, DeadlineError
from collective.transport.api import ChiefLink

log = logging.getLogger("collective.worker.agent")  # the worker's one log, as before the split

# While a worker receives from a relay, the chief sees its progress only in its heartbeats:
# it beats at least this often then (seconds), so `collective status` and progress bars move.
PROGRESS_INTERVAL = 1.0


class ChiefWatch:
    """Heartbeat, presence, verdict and failure report (see the module's doc); mixed into
    ``WorkerAgent``."""

    def _init_watch(self) -> None:
        # The heartbeat thread's view of the chief, shared with the main thread under _beat:
        # when the chief last answered, and its verdict once it has one (the chief gone or
        # restarted, or the round failed).
        self._beat = threading.Condition()
        self._last_ok = 0.0
        self._verdict: CollectiveError | None = None
        self._beat_now = False
        self._stopped = False
        self._sources: dict[int, ChiefLink] = {}  # by tree: the relay this worker receives it from, if any
        # This worker's own phase, as its failure report names it: the log context's is the
        # process's, which another agent or an in-process chief (its supervisor says "join")
        # may have set since.
        self.phase = "-"

    def _enter(self, phase: str) -> None:
        """Begin a phase: this worker's, and the log lines'."""
        self.phase = phase
        logs.phase(phase)

    def _stop_beats(self) -> None:
        with self._beat:
            self._stopped = True
            self._beat.notify_all()

    def _interrupt(self, error: CollectiveError) -> None:
        """The heartbeat's verdict: end whatever the main thread is waiting on with ``error``: a
        call to the chief, the relay it receives from, or a same-host parent's arena."""
        with self._beat:
            if self._verdict is None:
                self._verdict = error
            sources = list(self._sources.values())
            self._beat.notify_all()
        self._aborted = error
        self.link.interrupt(error)
        for source in sources:
            source.interrupt(error)

    def _report_failure(self, exc: CollectiveError, *, stopped: bool = False) -> None:
        """Tell the chief once, before this process goes (so the chief names this cause, not the
        presence call it sees cut off when we exit); never raises. A failure the chief announced
        itself needs no echo, nor one the heartbeat found (the chief gone, frozen, restarted).
        A broken data stream while the heartbeat is content is reported too, with a short
        deadline: the chief is likely alive, and only it can tell the stream's fault from ours.
        ``stopped``: a stop signal ended this worker (its error an AbortedError of its own, not
        the chief's word, whose exit status is 128 + the signal, sent as ``stop_signal``): told within the same 5 s at most, well inside a stop's grace (10 s
        for docker stop, 30 s for Kubernetes and Slurm's KillWait); not
        while it waits for the plan, where the chief frees its slot for a restart instead of
        failing the round (its presence call cut off says it left)."""
        if self._reported or self.rank < 0 or self._verdict is not None or \
                (isinstance(exc, AbortedError) and not stopped) or (stopped and self.phase == "join"):
            return
        self._reported = True
        self.link.report_failure(
            pb.FailureReport(worker=self.ref, phase=self.phase, message=str(exc),
                             culprit=exc.culprit or "", stop_signal=exc.exit_code - 128 if stopped else 0),
            timeout=min(1.0 if isinstance(exc, ChiefUnreachableError) else 5.0, self.timeouts.rpc),
        )

    def _presence(self) -> None:
        """Hold the presence call until the round's outcome: if this process dies, the chief
        sees the call cut off at once. A failed round's answer is heeded like the heartbeat's:
        the chief counts this worker told once it has answered, and may stop serving before the
        next heartbeat (a worker waiting on a same-host parent's arena beats every
        ``heartbeat`` s). The chief's silence stays the heartbeat's to judge."""
        t = self.timeouts
        try:
            reply = self.link.presence(self.ref, timeout=t.join + t.ready + t.start + t.rpc)
        except CollectiveError as exc:
            log.debug("presence call ended: %s", exc)
            if isinstance(exc, AbortedError):  # the round failed, or this worker was declared lost
                self._heed(exc)
            return
        if reply is not None and reply.phase == "failed":
            self._heed(self._chief_failed(reply))

    def _chief_failed(self, reply: pb.HeartbeatReply) -> AbortedError:
        """The error a heartbeat's or presence call's answer of a failed round stands for."""
        return AbortedError(f"round aborted by the chief at {self.link.address}: {reply.error}")

    def _heed(self, error: CollectiveError) -> None:
        """The chief's word on the round, from a call other than the heartbeat: interrupt with it
        unless the round is over for this worker or a verdict came first."""
        with self._beat:
            if self._stopped or self._verdict is not None:
                return
        self._interrupt(error)

    def _heartbeat_loop(self, chief_incarnation: str) -> None:
        """Every interval: prove we are alive, say how many bytes we hold, and learn early if
        the chief is gone or failed.

        The chief's silence for a whole lease, a different chief incarnation or a failed round
        interrupts the main thread's call in progress (to the chief, or to the relay this worker
        receives from) with the reason. Every worker judges the chief on its own heartbeats, so
        a chain learns of a lost chief at once, not one hop at a time.
        """
        t = self.timeouts
        with self._beat:
            self._last_ok = time.monotonic()
        while True:
            with self._beat:
                relay_fed = bool(self._sources)
                interval = min(t.heartbeat, PROGRESS_INTERVAL) if relay_fed else t.heartbeat
                self._beat.wait_for(lambda: self._stopped or self._beat_now, timeout=interval)
                if self._stopped:
                    return
                self._beat_now = False
            beat = pb.HeartbeatRequest(
                worker_id=self.worker_id, incarnation=self.incarnation, bytes_received=self.bytes_received,
                secret=self.ref.secret,
            )
            try:
                reply = self.link.heartbeat(beat, timeout=min(t.heartbeat, t.lease / 2))
            except (ChiefUnreachableError, DeadlineError) as exc:
                # Data still arriving from the chief proves it alive, whatever became of the heartbeat.
                silent = time.monotonic() - max(self._last_ok, self._last_data)
                if silent > t.lease:
                    # Refused connections mean the chief is gone; unanswered ones that it is frozen.
                    frozen = isinstance(exc, DeadlineError) or "did not answer" in str(exc)
                    how = "unresponsive" if frozen else "unreachable"
                    self._interrupt(ChiefUnreachableError(
                        f"chief at {self.link.address} {how}: no heartbeat answer for {silent:.1f} s "
                        f"(lease {t.lease:g} s) during {logs.current('phase')}; last error: {exc}"
                    ))
                    return
                continue
            except CollectiveError as exc:
                self._interrupt(exc)
                return
            if reply is None:  # this backend has no heartbeats
                with self._beat:
                    self._stopped = True
                    self._beat.notify_all()
                return
            if reply.chief_incarnation != chief_incarnation:
                self._interrupt(AbortedError(
                    f"chief at {self.link.address} restarted (incarnation {reply.chief_incarnation}, "
                    f"we joined {chief_incarnation}); this round is over"
                ))
                return
            if reply.phase == "failed":
                self._interrupt(self._chief_failed(reply))
                return
            with self._beat:
                self._last_ok = time.monotonic()
                self._beat.notify_all()
