"""The handler a gRPC chief serves from the moment it binds its port, before its round exists.

The chief binds first and loads the model after (``collective._api.run_chief``), so a port in
use is reported before minutes of loading, and a worker that dials in meanwhile is held, not
refused: it joins the moment the round exists. If the chief fails before that (a model that
cannot be loaded, bad values, a bad ``shards`` request), every call is refused with that error,
so every worker hears the chief's own cause at once instead of waiting out its join timeout
and then blaming an unreachable chief.
"""

from __future__ import annotations

import time

from collective import errors as E
from collective import parking
from collective._proto import collective_pb2 as pb
from collective.logs import printable

# How long a join is held while the model loads; under the client's 5 s per-try deadline, so
# the worker gets an answer ("still loading") and tries again at once.
HOLD = 2.0
# The phase of the "still loading" answer: the one a joining worker takes for "ask again".
LOADING = "loading"


def _loading(exc: E.CollectiveError) -> bool:
    """Whether ``exc`` is the "still loading, ask again" answer (what a joining worker retries)."""
    return isinstance(exc, E.ChiefUnreachableError) and exc.phase == LOADING


class PendingChief:
    """A ``ChiefHandler`` standing in for the round's ``ChiefService`` until ``serve(service)``
    (then every call goes to it) or ``refuse(error)`` (then every call raises ``error``)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers  # how many joins may be held while the model loads
        self._cond = parking.Condition()  # a join held while the model loads is parked, not a thread
        self._service = None
        self._error: E.CollectiveError | None = None
        self._told: set[str] = set()
        self._since = time.monotonic()
        self._final: pb.StatusReply | None = None  # the outcome, once retired
        self._held = 0  # joins waiting for the model to load
        self.stopped: E.CollectiveError | None = None  # a stop signal that came while it loaded (_waits)

    @property
    def service(self):
        return self._service

    def serve(self, service) -> None:
        with self._cond:
            self._service = service
            self._cond.notify_all()

    def refuse(self, error: E.CollectiveError) -> None:
        with self._cond:
            if self._service is None and self._error is None:
                self._error = error
            self._cond.notify_all()

    def retire(self) -> None:
        """The round is over and its caller goes on (the API): answer Status from a snapshot of
        the outcome, any other call with the round's end, and drop the service, so its arena and
        the model's values are freed with the caller's own references, not after the status
        grace the server still serves in the background."""
        with self._cond:
            service = self._service
            if service is None:
                return
            self._final = service.status()
            self._error = service.error or E.AbortedError(
                f"chief {service.incarnation}: the round is over (start was released)")
            self._service = None
            self._cond.notify_all()

    def linger(self, timeout: float) -> bool:
        """After ``refuse``: keep answering until every worker was told, at most ``timeout`` s.
        True if every one was."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._told) >= self.num_workers, timeout)

    def _target(self, hold: float = 0.0):
        """The round's service, waiting up to ``hold`` s for it; else raise why there is none."""
        with self._cond:
            parking.wait_for(self._cond, lambda: self._service is not None or self._error is not None, hold, "service")
            if self._service is not None:
                return self._service
            if self._error is not None:
                # A copy per call: one exception object raised in several threads at once would
                # share (and tangle) its traceback.
                err = self._error
                raise E.rebuild(E.describe(err), err.code, str(err))
            raise E.ChiefUnreachableError(
                f"the chief is still loading the model ({time.monotonic() - self._since:.0f} s so far)", phase=LOADING)

    def join(self, req: pb.JoinRequest, peer: str) -> pb.JoinReply:
        # At most one held join per worker slot (and a few retries): more joins than the round
        # has workers cannot all be honest, and each held one is a parked call (collective.parking).
        with self._cond:
            hold = HOLD if self._held < self.num_workers + 2 else 0.0
            self._held += 1
        try:
            target = self._target(hold)
        except E.CollectiveError as exc:
            # Told only if the refusal itself is this answer: a "still loading" answer that
            # raced the refusal tells the worker nothing, and the chief must not stop serving
            # on its account (the worker's next try would find the port closed).
            if not _loading(exc) and req.worker_id:
                with self._cond:
                    self._told.add(req.worker_id)
                    self._cond.notify_all()
            raise
        finally:
            with self._cond:
                self._held -= 1
        return target.join(req, peer)

    def status(self, brief: bool = False) -> pb.StatusReply:
        service = self._service
        if service is not None:
            return service.status(brief)
        with self._cond:
            if self._final is not None:
                return self._final
            error = self._error
        return pb.StatusReply(phase="failed" if error else "loading", expected=self.num_workers,
                              error=str(error or ""), waiting_for="" if error else "the model to load",
                              seconds_in_phase=time.monotonic() - self._since)

    def await_outcome(self, ref: pb.WorkerRef, timeout: float) -> pb.HeartbeatReply:
        return self._outcome("await_outcome", ref, timeout)

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        return self._outcome("heartbeat", req)

    def _outcome(self, name: str, *args) -> pb.HeartbeatReply:
        """Once retired after start: the outcome a presence call or a heartbeat asks about, not
        the end-of-round error every other call gets. A worker hears an AbortedError there as
        the round's failure (``WorkerAgent._heed``), and a presence call parked before start
        may be answered after the retire, even before the worker's AwaitStart is."""
        final = self._final  # set once, by retire
        if final is not None and final.phase == "started":
            return pb.HeartbeatReply(chief_incarnation=final.chief_incarnation, phase="started")
        return self.__getattr__(name)(*args)

    def lost(self, ref: pb.WorkerRef, reason: str) -> None:
        service = self._service
        if service is not None:
            service.lost(ref, reason)

    # Calls that come only after a join: the round exists by then (or the chief failed). Any
    # handler method, present or added later, goes to the service.
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):  # looked up when called, inside the server's error boundary
            with self._cond:
                loading = self._service is None and self._error is None
            if loading:
                # Only a join reaches a chief whose round does not exist yet (joins are held):
                # any other call comes from a worker that joined an earlier chief on this
                # port. "Still loading" would read as "ask again" and not say why it ended.
                who = printable(getattr(args[0], "worker_id", "") if args else "")
                raise E.PreconditionError(
                    f"chief restarted: worker {who!r} joined an earlier chief on this address; this one is "
                    f"still loading the model ({time.monotonic() - self._since:.0f} s so far) and knows no round "
                    "yet: start the worker again to join it")
            return getattr(self._target(), name)(*args, **kwargs)

        return call
