"""The chief's admission of its members: who may join, and who a later call's worker is.

``Admission`` is ``ChiefService``'s part that admits a Join (``join``) and identifies every later
call that names a worker (``_member``): each field of a Join bounded before the lock
(``collective/limits.py``), the devices parsed and the declared variables compared outside it,
and each member's secret (``Member.secret``: in its JoinReply only) required, in constant time,
of every call naming it. A mixin: its methods run on the service's state, under its lock where
they say so.
"""

from __future__ import annotations

import hmac
import logging
import time

from collective import logs, parking
from collective._proto import collective_pb2 as pb
from collective.chief.members import Member, Phase
from collective.errors import (
    AbortedError,
    AlreadyExistsError,
    CollectiveError,
    InvalidVariableError,
    PermissionDeniedError,
    PreconditionError,
    ProtocolError,
    ResourceExhaustedError,
    UsageError,
)
from collective.keys import parse_devices
from collective.limits import DECLARED_EXTRA, check_join, check_ref
from collective.plan import check_declared, declaration_differences

log = logging.getLogger("collective.chief.service")  # the chief's one log, as before the split


# A chunk digest in a ready report: 32 hex characters and its field's tag and length (40: slack).
READY_BYTES_PER_DIGEST = 40


def not_its_secret(worker_id: str) -> PermissionDeniedError:
    """Someone who read the plan (every incarnation is in it) is not the member: refused, and
    nothing changes. The secret is never quoted."""
    return PermissionDeniedError(f"worker {worker_id!r} refused: the call does not carry the secret that worker "
                                 f"got at join; only the process that joined may act as it")


class Admission:
    """Joins and identities (see the module's doc); mixed into ``ChiefService``."""

    def _holds(self, ref: pb.WorkerRef | pb.HeartbeatRequest) -> Member | None:
        """The member ``ref`` names when ``ref`` carries its incarnation and its secret (compared
        in constant time), else None: only the process that joined may act as that member."""
        m = self.state.members.get(ref.worker_id)
        if m is None or m.incarnation != ref.incarnation or not hmac.compare_digest(m.secret, ref.secret):
            return None
        return m

    def _member(self, ref: pb.WorkerRef) -> Member:
        check_ref(ref)
        if self.state.phase is Phase.FAILED and self.state.error is not None:
            m = self._holds(ref)
            if m is not None:
                m.told = True
                self.state.cond.notify_all()  # supervise() lingers until every worker has heard
            raise self.state.error.same_round()
        m = self.state.members.get(ref.worker_id)
        if m is None:
            raise PreconditionError(
                f"chief {self.incarnation} does not know worker {ref.worker_id!r}: it never joined this "
                f"chief (was the chief restarted?)"
            )
        if m.incarnation != ref.incarnation:
            raise PreconditionError(
                f"worker {ref.worker_id!r} joined as another incarnation; a restarted worker must join again"
            )
        if not hmac.compare_digest(m.secret, ref.secret):
            raise not_its_secret(ref.worker_id)
        if m.phase == "lost":
            raise AbortedError(f"{m.name()} was declared lost ({m.lost_reason}); a restarted process may rejoin",
                               culprit=m.worker_id)
        if not parking.retrying():  # a parked call asked again is no sign of life (collective.parking)
            m.last_seen = time.monotonic()
        return m

    def join(self, req: pb.JoinRequest, peer: str) -> pb.JoinReply:
        # Every field bounded before the lock, in time linear in the request (limits.py); then, if
        # the id could join at all (an O(1) look under the lock), its devices parsed and its
        # declaration compared, outside the lock: an oversize join never holds up the chief, and
        # one that cannot join costs nothing more.
        try:
            check_join(req, len(self.specs))
            with self.state.cond:
                if self.state.phase is Phase.FAILED:
                    raise self.state.error.same_round()
                closed = self._closed(req, peer)
                if closed is not None:
                    raise closed
            with self._declaring:
                checked: tuple | CollectiveError = self._check_join(req, peer)
        except CollectiveError as exc:
            checked = exc
        with self.state.cond:
            try:
                if isinstance(checked, CollectiveError):
                    if self.state.phase is Phase.FAILED:
                        raise self.state.error.same_round()
                    raise checked
                return self._admit(req, peer, *checked)
            except CollectiveError:
                # A refusal once the round has failed (joined late, or this join failed it) tells
                # a process that never became a member: supervise() lingers until every rank heard.
                if self.state.phase is Phase.FAILED and req.worker_id and req.worker_id not in self.state.members:
                    self.state.told_outside.add(req.worker_id)
                    self.state.cond.notify_all()
                raise

    def _closed(self, req: pb.JoinRequest, peer: str) -> CollectiveError | None:
        """Why a join under an id no member holds cannot be admitted, whatever it carries (joins
        closed, every slot taken), or None. O(1): called under the lock before the join's checks."""
        if req.worker_id in self.state.members:
            return None  # a retry or a restart: ``_admit`` decides
        if self.state.phase is not Phase.JOINING:
            err = PreconditionError(
                f"worker {req.worker_id!r} from {req.host or peer} cannot join: the cluster is "
                f"{self.state.phase.value} with all {self.num_workers} worker(s); joins are closed"
            )
            log.warning("refused a join: %s", err)  # the operator sees extra workers too
            return err
        if len(self.state.members) >= self.num_workers:
            return ResourceExhaustedError(
                f"worker {req.worker_id!r} cannot join: all {self.num_workers} worker slots are taken"
            )
        return None

    def _check_join(self, req: pb.JoinRequest, peer: str) -> tuple[list[str], CollectiveError | None]:
        """What ``join`` checks without the lock: every field within its limit, the devices, and
        the declared variables against the model (``self.specs`` never changes). Returns the
        devices and the declaration's problem (raised by ``_admit`` where the order of checks
        puts it: after the membership checks); raises for a request that is malformed."""
        if not req.worker_id:
            raise ProtocolError(f"join from {peer} has no worker id")
        try:
            devices = parse_devices(list(req.devices))
        except UsageError as exc:
            raise ProtocolError(f"worker {req.worker_id!r}: {exc}") from exc
        if not req.declared:
            return devices, None
        if len(req.declared) > len(self.specs) + DECLARED_EXTRA:
            # Far more than the model has: it cannot match, and comparing it name by name would
            # cost the chief time and memory in proportion to whatever a peer chose to send.
            log.warning("refused worker %r: it declares %d variables; the model has %d", req.worker_id,
                        len(req.declared), len(self.specs))
            return devices, PreconditionError(
                f"worker {req.worker_id!r} declares {len(req.declared)} variables; the chief's model "
                f"{self.source.description} has {len(self.specs)} (more than {DECLARED_EXTRA} extra: not "
                f"compared one by one); does the worker build the same model?", culprit=req.worker_id, phase="join")
        try:
            check_declared(req.declared)
        except InvalidVariableError as exc:
            log.warning("refused worker %r: it declares an invalid variable list: %s", req.worker_id, exc)
            return devices, ProtocolError(f"worker {req.worker_id!r} declares an invalid variable list: {exc}")
        diffs = declaration_differences(self.specs, req.declared)
        if not diffs:
            return devices, None
        shown = logs.first_of(diffs, 20)
        log.warning("refused worker %r: its variable list differs: %s", req.worker_id, shown)
        return devices, PreconditionError(
            f"worker {req.worker_id!r} declares variables that differ from the chief's model "
            f"{self.source.description} ({len(diffs)} difference(s)): {shown}",
            culprit=req.worker_id, phase="join",
        )

    def _admit(self, req: pb.JoinRequest, peer: str, devices: list[str],
               declared: CollectiveError | None) -> pb.JoinReply:
        """The body of ``join`` (the lock held): admit the worker or raise why not."""
        if self.state.phase is Phase.FAILED:
            raise self.state.error.same_round()
        existing = self.state.members.get(req.worker_id)
        if existing is not None:
            if existing.incarnation == req.incarnation:
                if not existing.join_key or not hmac.compare_digest(existing.join_key, req.join_key):
                    # The incarnation is public (the plan lists it): only the join key proves
                    # the retry comes from the process that joined.
                    raise AlreadyExistsError(
                        f"worker id {req.worker_id!r} is held by a process on host {existing.host} (pid "
                        f"{existing.pid}); a join from {req.host or peer} (pid {req.pid}) under its incarnation "
                        f"without its join key is refused"
                    )
                existing.last_seen = time.monotonic()
                return self._join_reply(existing)  # a retried join: same rank, same secret
            if self.state.phase is Phase.JOINING:
                raise AlreadyExistsError(
                    f"worker id {req.worker_id!r} is held by another process (host {existing.host}, pid "
                    f"{existing.pid}); the one from {req.host or peer} (pid {req.pid}) is refused"
                )
        elif (closed := self._closed(req, peer)) is not None:
            raise closed
        if declared is not None:
            if self.spmd and isinstance(declared, PreconditionError):
                declared.every_rank = True  # every rank runs the same code: each hears PreconditionError
                self.fail(declared)
            raise declared
        if existing is not None:  # a restart after the plan is out: rejoin, or the round fails
            return self._join_reply(self.rejoins.readmit(existing, req, peer, devices))
        taken = {m.rank for m in self.state.members.values()}
        free = [r for r in range(self.num_workers) if r not in taken]
        if self.spmd and req.preferred_rank not in free:
            holder = next((m for m in self.state.members.values() if m.rank == req.preferred_rank), None)
            why = (f"is held by {holder.name()}" if holder is not None
                   else f"is out of range: {self.num_workers} workers have ranks 0..{self.num_workers - 1}")
            err = PreconditionError(
                f"worker {req.worker_id!r} (host {req.host or peer}) claims worker rank {req.preferred_rank}, "
                f"which {why}; every process needs its own rank"
            )
            err.every_rank = True
            self.fail(err)
            raise err
        rank = req.preferred_rank if req.preferred_rank in free else free[0]
        m = Member.joining(req, rank, devices, peer)
        self.state.members[m.worker_id] = m
        log.info(
            "%s joined with devices %s (%d/%d)",
            m.name(), ",".join(devices), len(self.state.members), self.num_workers,
        )
        if len(self.state.members) == self.num_workers and (self.digests is not None or self._follow):
            self._release_plan()  # else once the files are hashed
        return self._join_reply(m)

    def _join_reply(self, m: Member) -> pb.JoinReply:
        return pb.JoinReply(rank=m.rank, num_workers=self.num_workers, chief_incarnation=self.incarnation,
                            secret=m.secret)

    def ready_bytes(self, ref: pb.WorkerRef) -> int:
        """The most bytes ``ref``'s ReadyRequest can serialize to: one device's chunk digests per
        device it joined with, and a little for the rest. A transport that receives the report in
        pieces refuses a call past it, and one not from a member (``_member``), at its first piece,
        before it holds any more of it."""
        with self.state.cond:
            m = self._member(ref)
            if self.state.plan is None:
                raise PreconditionError(f"{m.name()} reported ready before the plan was released; "
                                        f"ReportReady comes after GetPlan and the data stream")
            plan = self.plan_of(m)
            chunks = max(len(plan.chunk_digests), -(-plan.total_bytes // max(plan.chunk_bytes, 1)))
            return len(m.devices) * (chunks * READY_BYTES_PER_DIGEST + 256) + 8192
