"""chief/pending.py: what a gRPC chief answers between binding its port and its round existing."""

from __future__ import annotations

import threading
import time

import pytest

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.chief import pending
from collective.chief.pending import PendingChief


class Service:
    num_workers = 2

    def __init__(self) -> None:
        self.joined: list[str] = []

    def join(self, req, peer):
        self.joined.append(req.worker_id)
        return pb.JoinReply(rank=len(self.joined) - 1)

    def status(self, brief=False):
        return pb.StatusReply(phase="joining", expected=2)

    error = None
    incarnation = "abc"


def join_in_thread(chief: PendingChief, worker_id: str) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(chief.join(pb.JoinRequest(worker_id=worker_id), "peer"))
        except E.CollectiveError as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_join_while_the_model_loads_is_held_and_joins_once_the_round_exists():
    chief, service = PendingChief(2), Service()
    t, out = join_in_thread(chief, "w0")
    time.sleep(0.1)
    assert not out and chief.status().phase == "loading"
    chief.serve(service)
    t.join(5)
    assert isinstance(out[0], pb.JoinReply) and service.joined == ["w0"]


def test_an_error_before_serving_is_every_joins_answer_in_its_own_class():
    chief = PendingChief(2)
    t, out = join_in_thread(chief, "w0")
    chief.refuse(E.UsageError("shards: 1 name(s) are not variables of the model: 'nope'"))
    t.join(5)
    assert type(out[0]) is E.UsageError and "'nope'" in str(out[0])
    with pytest.raises(E.UsageError, match="'nope'"):
        chief.join(pb.JoinRequest(worker_id="w1"), "peer")
    started = time.monotonic()
    chief.linger(10)  # both workers heard it: no waiting
    assert time.monotonic() - started < 5
    assert chief.status().phase == "failed" and "'nope'" in chief.status().error


def test_joins_beyond_the_worker_slots_are_answered_at_once_while_loading(monkeypatch):
    monkeypatch.setattr(pending, "HOLD", 3.0)
    chief = PendingChief(1)
    held = [join_in_thread(chief, f"w{i}") for i in range(3)]  # 1 slot + 2: all held
    time.sleep(0.2)
    started = time.monotonic()
    with pytest.raises(E.ChiefUnreachableError, match="still loading") as info:
        chief.join(pb.JoinRequest(worker_id="extra"), "peer")
    assert time.monotonic() - started < 1.0 and info.value.phase == pending.LOADING
    chief.serve(Service())
    for t, out in held:
        t.join(5)
        assert isinstance(out[0], pb.JoinReply)


def test_a_retired_chief_answers_status_from_its_outcome_and_holds_no_service():
    chief, service = PendingChief(2), Service()
    chief.serve(service)
    chief.retire()
    assert chief.service is None and chief.status().phase == "joining"
    with pytest.raises(E.AbortedError, match="the round is over"):
        chief.join(pb.JoinRequest(worker_id="late"), "peer")


def test_a_call_other_than_join_while_loading_names_a_restarted_chief_and_the_worker():
    """Only a join reaches a chief before its round exists: a heartbeat or a plan request then
    comes from a worker of an earlier chief on the same port (killed, restarted)."""
    chief = PendingChief(2)
    for call, req in ((chief.heartbeat, pb.HeartbeatRequest(worker_id="loyal")), (chief.get_plan, pb.WorkerRef(worker_id="loyal"))):
        with pytest.raises(E.PreconditionError, match="chief restarted: worker 'loyal' joined an earlier chief"):
            call(req)
    chief.serve(Service())
    assert chief.status().phase == "joining"


def test_a_retired_chief_answers_presence_and_heartbeat_after_start_with_the_outcome_not_an_error():
    """A worker's presence call parked before start may be answered after the API's chief
    retired, before the worker's AwaitStart is; an AbortedError there ("the round is over")
    read as the round's failure and cancelled the worker's AwaitStart (CI: a rank of
    test_shards_over_grpc failed so). A failed round's calls still raise its error."""
    started = Service()
    started.status = lambda brief=False: pb.StatusReply(phase="started", expected=2, chief_incarnation="abc")
    chief = PendingChief(2)
    chief.serve(started)
    chief.retire()
    ref = pb.WorkerRef(worker_id="w1", incarnation="i1")
    for reply in (chief.await_outcome(ref, 5.0), chief.heartbeat(pb.HeartbeatRequest(worker_id="w1"))):
        assert (reply.phase, reply.chief_incarnation) == ("started", "abc")
    with pytest.raises(E.AbortedError, match="the round is over"):
        chief.get_plan(ref, 5.0)

    failed = Service()
    failed.status = lambda brief=False: pb.StatusReply(phase="failed", expected=2, error="worker w2 lost")
    failed.error = E.AbortedError("worker w2 lost")
    chief = PendingChief(2)
    chief.serve(failed)
    chief.retire()
    for call in (lambda: chief.await_outcome(ref, 5.0), lambda: chief.heartbeat(pb.HeartbeatRequest(worker_id="w1"))):
        with pytest.raises(E.AbortedError, match="worker w2 lost"):
            call()


def test_a_still_loading_answer_that_races_the_refusal_does_not_count_the_worker_as_told(monkeypatch):
    """A held join's hold runs out ("still loading") just as the chief fails before serving.
    That worker heard nothing: the chief must keep answering (``linger``) until its next try
    gets the refusal. Before, it was counted as told, the SPMD chief stopped its server at once,
    and the worker's next try found the port closed: it retried until its join timeout."""
    chief = PendingChief(1)
    error = E.UsageError("shards: 1 name(s) are not variables of the model: 'nope'")
    held = chief._target

    def hold_runs_out_as_the_chief_fails(hold: float = 0.0):
        chief.refuse(error)  # between the hold's end and the join's look at the error
        raise E.ChiefUnreachableError("the chief is still loading the model (2 s so far)", phase=pending.LOADING)

    monkeypatch.setattr(chief, "_target", hold_runs_out_as_the_chief_fails)
    with pytest.raises(E.ChiefUnreachableError):
        chief.join(pb.JoinRequest(worker_id="w0"), "peer")
    assert chief.linger(0.0) is False  # nobody was told yet: it keeps answering
    monkeypatch.setattr(chief, "_target", held)
    with pytest.raises(E.UsageError, match="nope"):  # the next try gets the refusal: now it was told
        chief.join(pb.JoinRequest(worker_id="w0"), "peer")
    assert chief.linger(0.0) is True
