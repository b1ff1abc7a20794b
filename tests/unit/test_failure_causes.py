"""A worker that fails reports why and exits; its report (ReportFailure) and the cut of its calls
travel on different connections. Whichever reaches the chief first, the round names the cause."""

from __future__ import annotations

import threading

import pytest

from collective._proto import collective_pb2 as pb
from collective.chief.members import Phase
from collective.chief.supervise import CAUSE_GRACE
from collective.errors import AbortedError
from tests.clusters import chief_service

PEER = "ipv4:127.0.0.1:40000"
CUT = "its presence call was cut off (process gone or connection lost)"


def _broadcasting(workers: int = 2):
    service = chief_service(workers=workers)
    secrets = [service.join(pb.JoinRequest(worker_id=f"w{i}", incarnation=f"inc{i}", devices=["cpu:0"], host="h",
                                           preferred_rank=i), PEER).secret for i in range(workers)]
    assert service.phase is Phase.BROADCASTING
    return service, pb.WorkerRef(worker_id="w0", incarnation="inc0", secret=secrets[0])


def _report(service, ref) -> None:
    service.report_failure(pb.FailureReport(worker=ref, phase="receive", message="stream ended without its end message"))


@pytest.mark.parametrize("first", ["the report", "the cut"])
def test_the_round_names_the_workers_own_cause_whichever_comes_first(first):
    service, ref = _broadcasting()
    if first == "the cut":
        service.lost(ref, CUT)
        assert service.phase is Phase.BROADCASTING  # not decided yet: the report may follow
        _report(service, ref)
    else:
        _report(service, ref)
        service.lost(ref, CUT)
    assert service.phase is Phase.FAILED
    assert "worker w0 (rank 0" in str(service.error) and "without its end message" in str(service.error)
    assert "cut off" not in str(service.error)


def test_a_cut_with_no_report_fails_the_round_naming_the_cut_after_the_grace():
    service, ref = _broadcasting()
    service.lost(ref, CUT)
    with service.state.cond:
        service.state.cond.wait_for(lambda: service.phase is Phase.FAILED, timeout=CAUSE_GRACE + 10)
    assert service.phase is Phase.FAILED
    assert isinstance(service.error, AbortedError) and service.error.culprit == "w0"
    assert "worker w0 (rank 0" in str(service.error) and "was lost during the broadcast: " + CUT in str(service.error)


def test_many_cut_calls_of_one_member_wait_for_its_cause_on_one_thread():
    """Whoever can cut a member's calls (its incarnation known) cannot make the chief start a
    thread per cut: one wait per member."""
    service, ref = _broadcasting()
    for _ in range(200):
        service.lost(ref, CUT)
    waiting = [t for t in threading.enumerate() if t.name == "await-cause"]
    assert len(waiting) == 1, len(waiting)
    _report(service, ref)
    assert "without its end message" in str(service.error)
