"""What a process says when it is stopped (scancel sends SIGTERM to every task) and while a
collective.sync call waits for a missing rank: one line each, naming the phase and whom.

Real processes on loopback; heartbeats shrunk as in test_liveness so every case ends in seconds.
"""

from __future__ import annotations

import json
import signal
import socket

import pytest

from collective._proto import collective_pb2 as pb
from collective.chief.members import Phase
from tests.clusters import FAST, SLOW_RECEIVER, chief_service, grpc_link
from tests.integration.test_sync import SCRIPT, collective_env, free_port
from tests.procs import ROOT, Proc, error_line, run_all, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

HB = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5"]
BIG = ["--model", "transformer-100m", "--chunk-bytes", "65536", "--no-shm"]  # a stream still under way


def test_sigterm_to_a_worker_mid_receive_says_so_in_one_line(cluster):
    chief = cluster.chief("--workers", "2", *BIG, *HB)
    victim = cluster.worker("victim", *HB, code=SLOW_RECEIVER)
    cluster.worker("other", *HB)
    wait_for(victim, "phase=receive")
    victim.signal(signal.SIGTERM)
    assert victim.wait(30) == 128 + signal.SIGTERM, victim.output()
    line = error_line(victim.output())
    assert "worker victim stopped by SIGTERM while receiving" in line, victim.output()
    assert "Traceback" not in victim.output()
    assert chief.wait(30) != 0 and "victim" in error_line(chief.output(), "round aborted:")


def test_a_worker_stopped_while_waiting_for_start_tells_the_chief_why_in_the_same_words(cluster):
    """The stopped worker said "stopped by SIGTERM while waiting for start", but the chief, never
    told, named it "lost during the broadcast: its presence call was cut off": the worker now
    reports its stop (and the signal) before it goes, and the chief names the phase as the worker
    does."""
    chief = cluster.chief("--workers", "2", *BIG, *HB, "--topology", "star")
    victim = cluster.worker("victim", "--rank", "0", *HB)
    cluster.worker("slow", "--rank", "1", *HB, code=SLOW_RECEIVER)
    wait_for(chief, "worker victim (rank 0", timeout=60)
    wait_for(chief, "is ready with digest", timeout=90)  # only the victim: the slow one still receives
    victim.signal(signal.SIGTERM)
    assert victim.wait(30) == 128 + signal.SIGTERM, victim.output()
    said = "worker victim stopped by SIGTERM while waiting for start"
    assert said in error_line(victim.output()), victim.output()
    assert chief.wait(60) != 0
    line = error_line(chief.output(), "round aborted:")
    assert "worker victim (rank 0, " in line and ") stopped by SIGTERM while waiting for start" in line, line
    assert "lost" not in line and "cut off" not in line, line
    result = json.loads((cluster.tmp / "result.json").read_text())
    assert (result["culprit"], result["error_phase"]) == ("victim", "ready"), result


def test_sigterm_to_the_chief_mid_broadcast_names_who_was_still_receiving(cluster):
    chief = cluster.chief("--workers", "2", *BIG, *HB)
    slow = cluster.worker("slow", "--rank", "0", *HB, code=SLOW_RECEIVER)
    cluster.worker("other", "--rank", "1", *HB)
    wait_for(slow, "phase=receive")
    chief.signal(signal.SIGTERM)
    assert chief.wait(30) != 0
    line = error_line(chief.output(), "round aborted:")
    assert "chief shutting down (SIGTERM) while broadcasting; still waiting for worker slow (rank 0" in line, line
    assert slow.wait(30) != 0 and "chief shutting down (SIGTERM)" in slow.output()
    assert "Traceback" not in chief.output() + slow.output()


@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_as_sync_starts_ends_it_in_one_line(tmp_path, rank):
    """A scancel in the first half second of collective.sync, before the chief's or the worker's
    own handler is installed, killed the rank without a line (exit -15, nothing from the
    library): the call's handler is installed as it starts."""
    codes, outputs = run_all([str(ROOT / "tests" / "sync_stop_probe.py")], [tmp_path / f"rank{rank}.log"],
                             [collective_env(rank, free_port())], 60)
    assert codes == [128 + signal.SIGTERM], outputs
    result = json.loads(outputs[0].strip().splitlines()[-1])
    assert (result["error"], result["message"]) == ("AbortedError", "collective.sync stopped by SIGTERM while starting")
    assert "Traceback" not in outputs[0], outputs[0]


def test_sync_ranks_waiting_for_a_missing_rank_warn_naming_it(tmp_path):
    """Ranks 0 and 1 of 3 call sync; rank 2 never comes. Without any logging set-up each says,
    as a WARNING on stderr, whom it still waits for, by training rank; the join timeout then
    names training rank 2 (not worker rank 1). Rank 0 listens on the loopback chief address
    it was given, so it gives no warning about listening without a token."""
    port = free_port()
    extra = {"SYNC_STRAGGLER_LOG": "1", "SYNC_JOIN_TIMEOUT": "6"}
    codes, outputs = run_all([SCRIPT], [tmp_path / f"rank{r}.log" for r in (0, 1)],
                             [{**collective_env(r, port), **extra} for r in (0, 1)], 60)
    assert codes[0] != 0 and codes[1] != 0, outputs
    assert "collective.sync rank 0 (the chief): still waiting after 1 s for 1 more worker(s) to join " \
           "(free training ranks 2)" in outputs[0], outputs[0]
    assert "collective.sync rank 1: still waiting after 1 s for 1 more worker(s) to join (free training ranks 2)" \
           in outputs[1], outputs[1]
    assert "missing: 1 worker(s) for training rank(s) 2" in outputs[0], outputs[0]
    assert "missing: 1 worker(s) for training rank(s) 2" in outputs[1], outputs[1]
    # The chief's address is a loopback one: rank 0 binds it, and nobody else can reach it.
    assert "WITHOUT a cluster token" not in outputs[0], outputs[0]


def test_the_chief_reports_a_port_in_use_before_it_loads_the_model(tmp_path):
    """The chief binds first: with its port taken and a model that would take long to load (or,
    here, cannot be loaded at all), the port is what it reports, at once, exit 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        chief = Proc(["-m", "collective.chief", "--workers", "1", "--bind", f"127.0.0.1:{port}",
                      "--model", str(tmp_path / "not-there.safetensors")], tmp_path / "chief.log")
        try:
            assert chief.wait(60) == 2, chief.output()
            output = chief.output()
        finally:
            chief.kill()
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in output, output
    assert "not-there" not in output, output


def _report_over_grpc(rejoin: float, report: pb.FailureReport):
    """A chief service (2 workers, rejoin window ``rejoin`` s) served over real gRPC; both join,
    then w0 sends ``report``: the service and w0's member."""
    import dataclasses

    service = chief_service(workers=2, timeouts=dataclasses.replace(FAST, rejoin=rejoin, lease=30.0))
    with grpc_link(service) as link:
        refs = []
        for i in range(2):
            joined = link.join(pb.JoinRequest(worker_id=f"w{i}", incarnation=f"i{i}", devices=["cpu:0"], host="h",
                                              preferred_rank=i), 5)
            refs.append(pb.WorkerRef(worker_id=f"w{i}", incarnation=f"i{i}", secret=joined.secret))
        assert service.phase is Phase.BROADCASTING
        report.worker.CopyFrom(refs[0])
        link.report_failure(report, 5)
    return service, service.state.members["w0"]


@pytest.mark.parametrize("rejoin", [0.0, 60.0], ids=["no-rejoin-window", "rejoin-window"])
def test_a_report_carrying_its_stop_signal_is_a_stop_whatever_its_message_says(rejoin):
    # The chief read a stop in the message's words (" stopped by SIG... while "): a worker
    # whose message said otherwise was "failed", and its rank not kept for a restart.
    service, m = _report_over_grpc(rejoin, pb.FailureReport(phase="receive", message="preempted by the scheduler",
                                                            stop_signal=signal.SIGTERM))
    if rejoin:  # kept for a restart, named stopped in the chief's words
        assert service.error is None and m.phase == "lost", (service.error, m.phase)
        assert m.lost_reason == "it was stopped by SIGTERM while receiving", m.lost_reason
    else:
        assert "worker w0 (rank 0" in str(service.error), service.error
        assert str(service.error).endswith(") stopped by SIGTERM while receiving"), service.error


def test_a_message_in_a_stops_words_without_the_signal_is_a_failure_not_a_stop():
    said = "worker w0 stopped by SIGTERM while receiving"  # a worker's words, not its signal
    service, m = _report_over_grpc(60.0, pb.FailureReport(phase="receive", message=said))
    assert m.phase == "failed" and service.error is not None, m.phase
    assert f"failed while receiving: {said}" in str(service.error), service.error


def test_an_unknown_stop_signal_number_is_named_as_a_number():
    service, _ = _report_over_grpc(0.0, pb.FailureReport(phase="ready", message="x", stop_signal=9999))
    assert str(service.error).endswith(") stopped by signal 9999 while waiting for start"), service.error
