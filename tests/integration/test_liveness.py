"""Liveness with real processes: killed, frozen and restarted workers and chiefs are named fast.

Heartbeats are shrunk (every 0.3 s, dead after 1.5 s) so every case ends in seconds.
"""

from __future__ import annotations

import datetime
import json
import signal
import time

import pytest

from tests.clusters import SLOW_RECEIVER, tampering_relay
from tests.procs import error_line, wait_for, wait_until

pytestmark = pytest.mark.integration

HB = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5"]





def test_a_worker_killed_during_the_broadcast_aborts_the_round_naming_it(cluster):
    chief = cluster.chief("--workers", "2", "--model", "transformer-100m", "--chunk-bytes", "65536",
                          "--no-shm", *HB)  # the network stream, cut off mid-way
    victim = cluster.worker("victim", *HB, code=SLOW_RECEIVER)
    other = cluster.worker("other", *HB)
    wait_for(victim, "phase=receive")
    victim.signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert chief.wait(30) != 0
    detected = time.monotonic() - t0
    aborted = error_line(chief.output(), "round aborted:")  # the join line names every worker too
    assert "worker victim (rank" in aborted and "lost during the broadcast" in aborted, aborted
    result = json.loads((cluster.tmp / "result.json").read_text())
    assert (result["culprit"], result["error_phase"]) == ("victim", "broadcast"), result
    assert other.wait(30) != 0
    assert "victim" in error_line(other.output())
    assert "training started" not in chief.output() + other.output()
    assert detected < 10, f"the chief took {detected:.1f} s to notice"


def test_a_frozen_worker_is_caught_by_the_lease_and_learns_of_the_abort_after_sigcont(cluster):
    chief = cluster.chief("--workers", "2", *HB)
    frozen = cluster.worker("frozen", *HB)
    wait_for(frozen, "waiting for the plan")
    frozen.signal(signal.SIGSTOP)
    try:
        other = cluster.worker("other", *HB)
        assert chief.wait(30) != 0
        aborted = error_line(chief.output(), "round aborted:")
        assert "worker frozen (rank" in aborted and "no heartbeat" in aborted, aborted
        assert other.wait(30) != 0 and "frozen" in error_line(other.output())
    finally:
        frozen.signal(signal.SIGCONT)
    assert frozen.wait(30) != 0
    assert "training started" not in frozen.output()


def test_a_failed_chief_writes_its_result_before_it_lingers_for_a_worker_that_never_hears(cluster):
    """A launcher may stop a chief soon after the outcome: the result must not wait for the
    linger (here a lease, 8 s, since the frozen worker never hears). The frozen worker is frozen
    before the other joins; the chief's lease outlasts that join (a fresh process: beside three
    CPU-bound processes it took over HB's 1.5 s, and the chief freed the frozen worker's slot
    before the broadcast, so the round waited for a second worker instead of failing)."""
    chief = cluster.chief("--workers", "2", "--heartbeat-interval", "0.3", "--heartbeat-timeout", "8")
    frozen = cluster.worker("frozen", *HB)
    wait_for(frozen, "waiting for the plan")
    frozen.signal(signal.SIGSTOP)
    try:
        cluster.worker("other", *HB)
        wait_for(chief, "round aborted:", timeout=60)  # within the other's join deadline and a lease
        result_file = cluster.tmp / "result.json"
        wait_until(lambda: result_file.exists() or chief.proc.poll() is not None, "the result file or the chief's exit")
        assert chief.proc.poll() is None, "the chief wrote its result only as it exited"
        # Written at the outcome, not at the end of the 5 s linger (the clocks: the log's and the file's).
        stamp = error_line(chief.output(), "round aborted:").split()[0].rstrip("Z")
        aborted_at = datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.UTC).timestamp()
        assert result_file.stat().st_mtime - aborted_at < 2.5, "the result was written only after the linger"
        result = json.loads(result_file.read_text())
        assert (result["ok"], result["culprit"]) == (False, "frozen"), result
        assert "no heartbeat" in result["error"], result
    finally:
        frozen.signal(signal.SIGCONT)
    assert chief.wait(30) != 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_worker_killed_before_the_broadcast_frees_its_slot_for_its_restart(cluster, sig):
    """Also one stopped by SIGTERM: it tells the chief why it goes once the broadcast is under
    way, but a departure before it is no failure of the round."""
    chief = cluster.chief("--workers", "2", *HB)
    first = cluster.worker("w0", *HB)
    wait_for(first, "waiting for the plan")
    first.signal(sig)
    wait_for(chief, "its slot is free again")
    restarted = cluster.worker("w0", *HB)
    other = cluster.worker("w1", *HB)
    assert restarted.wait(60) == 0, restarted.output()
    assert other.wait(60) == 0, other.output()
    assert chief.wait(30) == 0, chief.output()


def test_a_frozen_chief_is_named_by_its_workers_within_the_lease(cluster):
    chief = cluster.chief("--workers", "2", *HB)
    worker = cluster.worker("patient", *HB)
    wait_for(worker, "waiting for the plan")
    chief.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert worker.wait(30) != 0
        detected = time.monotonic() - t0
    finally:
        chief.signal(signal.SIGCONT)
    assert f"chief at {cluster.address} unresponsive" in worker.output()
    assert detected < 10, f"the worker took {detected:.1f} s to notice"
    # Woken, the chief names itself, not the worker whose presence call it finds cut off (it
    # used to free that slot and wait out its join timeout).
    assert chief.wait(20) != 0
    aborted = error_line(chief.output(), "round aborted:")
    assert "the chief was stopped for" in aborted and "(frozen); the workers gave up on it" in aborted, aborted
    assert "patient" not in aborted, aborted
    result = json.loads((cluster.tmp / "result.json").read_text())
    assert (result["culprit"], result["error_phase"]) == ("chief", "joining"), result


def test_sigterm_to_the_chief_tells_every_worker_it_is_shutting_down(cluster):
    chief = cluster.chief("--workers", "2", *HB)
    worker = cluster.worker("w0", *HB)
    wait_for(worker, "waiting for the plan")
    chief.signal(signal.SIGTERM)
    assert chief.wait(30) != 0
    assert worker.wait(30) != 0
    assert "chief shutting down" in worker.output()
    assert "Traceback" not in chief.output() + worker.output()


def test_a_chief_killed_mid_broadcast_fails_every_worker_fast(cluster):
    chief = cluster.chief("--workers", "2", "--model", "transformer-100m", "--chunk-bytes", "65536",
                          "--no-shm", *HB)
    workers = [cluster.worker(f"w{i}", *HB, code=SLOW_RECEIVER if i == 0 else None) for i in range(2)]
    wait_for(workers[0], "phase=receive")
    chief.signal(signal.SIGKILL)
    t0 = time.monotonic()
    for w in workers:
        assert w.wait(30) != 0
        assert f"chief at {cluster.address}" in w.output()
        assert "training started" not in w.output()
    assert time.monotonic() - t0 < 10


# The new chief binds, then loads its model: a worker of the old one may reach it either while
# it loads (a model of 100M parameters takes seconds: several heartbeats) or after. The worker's
# lease (RESTART_LEASE) outlasts the restart, which is a new Python process binding the port:
# beside three CPU-bound processes that took over HB's 1.5 s, and the worker gave up on the chief
# as unreachable before the new one could answer. The worker ends by its lease at the latest.
RESTART_LEASE = 60

@pytest.mark.parametrize("model", [[], ["--model", "transformer-100m"]], ids=["small", "loading"])
def test_a_restarted_chief_makes_connected_workers_abort_naming_the_restart(cluster, tmp_path, model):
    first = cluster.chief("--workers", "2", *HB)
    port = cluster.address.rsplit(":", 1)[1]
    worker = cluster.worker("loyal", "--heartbeat-interval", "0.5", "--heartbeat-timeout", str(RESTART_LEASE))
    wait_for(worker, "waiting for the plan")
    first.signal(signal.SIGKILL)
    first.wait(30)
    (tmp_path / "chief.port").unlink()
    cluster.chief("--workers", "2", "--bind", f"127.0.0.1:{port}", *model, *HB)
    assert worker.wait(RESTART_LEASE + 30) != 0
    out = worker.output()
    assert "restarted" in out, out
    assert "training started" not in out


# A chief whose model takes for ever to load: its port answers joins "still loading".
SLOW_LOADING_CHIEF = (
    "import sys, time\n"
    "from collective.chief import round as chief_round\n"
    "def loading(*args, **kwargs):\n"
    "    time.sleep(600)\n"
    "chief_round.load_source_reporting = loading\n"
    "from collective.chief.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.timeout(120)
def test_a_worker_that_heard_still_loading_gives_up_a_lease_after_the_chief_is_killed_not_at_its_join_timeout(cluster):
    # Before, a worker that heard "still loading" and then found the chief gone took every
    # refused connection for a start-up race and retried for its whole join timeout (600 s here);
    # now the chief that answered and then fell silent for a lease (5 s) is gone.
    chief = cluster.chief("--workers", "2", code=SLOW_LOADING_CHIEF)
    worker = cluster.worker("patient", "--join-timeout", "600", "--heartbeat-interval", "0.5",
                            "--heartbeat-timeout", "5")
    wait_for(worker, "still loading the model", timeout=60)
    chief.signal(signal.SIGKILL)
    chief.wait(30)
    assert worker.wait(90) != 0, worker.output()
    line = error_line(worker.output())
    assert f"chief at {cluster.address} said it was still loading the model, then did not answer" in line, line
    assert "lease 5 s" in line and "training started" not in worker.output(), line


def test_a_late_joiner_inside_the_join_window_still_makes_the_round(cluster):
    chief = cluster.chief("--workers", "2", *HB)
    early = cluster.worker("early", *HB)
    wait_for(early, "waiting for the plan")
    time.sleep(1.0)  # the scenario (lateness: several heartbeats pass), not a synchronisation
    late = cluster.worker("late", *HB)
    assert late.wait(60) == 0 and early.wait(60) == 0
    assert chief.wait(30) == 0


def test_two_live_processes_claiming_one_id_the_second_is_refused_and_the_first_keeps_its_rank(cluster):
    chief = cluster.chief("--workers", "2", *HB)
    first = cluster.worker("twin", "--rank", "1", *HB)
    wait_for(first, "as rank 1 of 2")
    second = cluster.worker("twin", *HB)
    assert second.wait(30) != 0
    assert "worker id 'twin' is held by another process" in second.output()
    other = cluster.worker("other", *HB)
    assert first.wait(60) == 0 and other.wait(60) == 0
    assert chief.wait(30) == 0
    assert "as rank 1 of 2" in first.output()


def test_a_restart_while_the_frozen_holder_looks_alive_is_refused_and_the_round_fails_naming_the_frozen_one(cluster):
    """Without ``--rejoin-timeout`` (its default 0), as under torchrun's --max-restarts 0. A join
    under a live member's id proves no identity (anyone with the token can send one): it is
    refused, and the frozen holder is named when its lease runs out."""
    chief = cluster.chief("--workers", "2", "--model", "transformer-100m", "--chunk-bytes", "65536", "--no-shm",
                          "--heartbeat-interval", "0.3", "--heartbeat-timeout", "8")
    old = cluster.worker("phoenix", "--heartbeat-interval", "0.3", "--heartbeat-timeout", "8", code=SLOW_RECEIVER)
    other = cluster.worker("other", *HB)
    wait_for(old, "phase=receive")
    old.signal(signal.SIGSTOP)  # frozen, its connection still open
    try:
        reborn = cluster.worker("phoenix", *HB)
        assert reborn.wait(30) != 0
        assert "held by a live process" in error_line(reborn.output()), reborn.output()[-2000:]
        assert chief.wait(60) != 0
        aborted = error_line(chief.output(), "round aborted:")
        assert "worker phoenix (rank" in aborted and "no heartbeat" in aborted, aborted
        assert other.wait(30) != 0
        assert "phoenix" in error_line(other.output())
    finally:
        old.signal(signal.SIGCONT)


# A round that must complete on a loaded machine: the chief ends it by itself within its join and
# ready deadlines and lingers until its workers heard the outcome, so the test waits for that end
# (an event) within one deadline built from them, never on a budget of its own. Heartbeats keep
# their defaults (a 15 s lease): HB's 1.5 s lease, with heartbeat calls cut at 0.3 s, declared a
# restarted worker lost while it received 394 MB beside three CPU-bound processes, and a kill is
# seen through the presence call anyway, at once.
ROUND_JOIN, ROUND_READY, ROUND_LINGER = 60, 240, 30
ROUND_DEADLINES = ("--join-timeout", str(ROUND_JOIN), "--ready-timeout", str(ROUND_READY),
                   "--linger", str(ROUND_LINGER))
ROUND = ROUND_JOIN + ROUND_READY + ROUND_LINGER + 60  # + starting the processes on a loaded machine


def wait_for_round(procs, started: float) -> None:
    """Each of ``procs`` ends with exit 0 within the round's deadline, counted from ``started``."""
    for p in procs:
        assert p.wait(max(1.0, started + ROUND - time.monotonic())) == 0, p.output()[-3000:]


@pytest.mark.timeout(ROUND + 60)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_with_a_rejoin_window_a_killed_worker_restarted_mid_broadcast_takes_its_rank_and_the_round_completes(
        cluster, sig):
    """``--rejoin-timeout``: a worker SIGKILLed mid-stream and started again with its id is
    admitted in its rank; the other worker is not restarted and the round completes. So is one
    preempted (SIGTERM): it tells the chief it was stopped, which keeps its rank for a restart."""
    started = time.monotonic()
    chief = cluster.chief("--workers", "2", "--model", "transformer-100m", "--chunk-bytes", "65536", "--no-shm",
                          "--topology", "star", "--rejoin-timeout", "60", *ROUND_DEADLINES)
    victim = cluster.worker("phoenix", "--rank", "0", code=SLOW_RECEIVER)
    other = cluster.worker("other", "--rank", "1")
    wait_for(victim, "phase=receive", timeout=ROUND_JOIN)  # the worker's own join deadline
    victim.signal(sig)
    assert victim.wait(30) == (-sig if sig == signal.SIGKILL else 128 + sig), victim.output()
    wait_for(chief, "waiting up to 60 s for it to rejoin", timeout=60)
    if sig == signal.SIGTERM:  # named in the worker's own words
        assert "it was stopped by SIGTERM while receiving" in chief.output()
    reborn = cluster.worker("phoenix", "--rank", "0")
    wait_for_round([chief, reborn, other], started)
    assert "worker phoenix (rank 0" in chief.output() and "rejoined as incarnation" in chief.output()
    result = json.loads((cluster.tmp / "result.json").read_text())
    assert result["ok"] is True and result["rejoined"] == ["phoenix"], result
    digests = {w["id"]: (w["digest"], w["expected_digest"]) for w in result["workers"]}
    assert all(d == e and d for d, e in digests.values()), digests
    assert other.output().count("joined chief at") == 1  # the other worker was not restarted


def test_with_a_rejoin_window_a_restart_waits_for_the_frozen_holder_to_be_lost_which_is_refused_after_sigcont(cluster):
    chief = cluster.chief("--workers", "2", "--model", "transformer-100m", "--chunk-bytes", "65536", "--no-shm",
                          "--topology", "star", "--rejoin-timeout", "60",
                          "--heartbeat-interval", "0.3", "--heartbeat-timeout", "8")
    old = cluster.worker("phoenix", "--heartbeat-interval", "0.3", "--heartbeat-timeout", "8", code=SLOW_RECEIVER)
    other = cluster.worker("other", *HB)
    wait_for(old, "phase=receive")
    old.signal(signal.SIGSTOP)  # frozen, its connection still open: it holds its slot until its lease runs out
    try:
        # A join under its id proves no identity: while the holder looks alive it keeps its slot.
        early = cluster.worker("phoenix", *HB)
        assert early.wait(60) != 0, early.output()
        assert "ALREADY_EXISTS" in early.output() or "held by a live process" in early.output(), early.output()[-2000:]
        wait_for(chief, "was lost during the broadcast", timeout=60)
        reborn = cluster.worker("phoenix", *HB)
        assert reborn.wait(60) == 0, reborn.output()
        assert other.wait(60) == 0, other.output()
    finally:
        old.signal(signal.SIGCONT)
    assert old.wait(60) != 0
    assert "training started" not in old.output()
    assert "phoenix" in error_line(old.output()), old.output()[-2000:]
    assert chief.wait(30) == 0, chief.output()
    assert "rejoined as incarnation" in chief.output()


def test_sigterm_mid_broadcast_tells_everyone_and_releases_the_port(cluster):
    import socket

    chief = cluster.chief("--workers", "1", "--model", "transformer-100m", "--chunk-bytes", "65536",
                          "--no-shm", *HB)
    worker = cluster.worker("w0", *HB)
    wait_for(worker, "phase=receive")
    chief.signal(signal.SIGTERM)
    assert chief.wait(30) != 0
    assert worker.wait(30) != 0
    assert "chief shutting down" in worker.output()
    host, port = cluster.address.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))  # the chief released its port


@pytest.mark.parametrize("topology", ["chain", "tree", "dtree"])
def test_relay_topologies_deliver_bit_exact_replicas(cluster, topology):
    chief = cluster.chief("--workers", "3", "--topology", topology, "--no-shm", "--chunk-bytes", "65536",
                          *HB)
    workers = [cluster.worker(f"w{i}", "--rank", str(i), *HB) for i in range(3)]
    for w in workers:
        assert w.wait(60) == 0, w.output()
    assert chief.wait(30) == 0, chief.output()
    assert f"topology {topology}" in chief.output()
    # chain: rank 1 receives from rank 0; tree (binomial): rank 1 from the chief, rank 2 from rank 0;
    # dtree (topology.dtree_parents(3)): tree A 1 <- chief, 0 and 2 <- 1; tree B 2 <- chief, 0 <- 2, 1 <- 0
    child = {"chain": "w1", "tree": "w2", "dtree": "w1 chunks 1 mod 2"}[topology]
    assert f"relaying to worker {child}" in workers[0].output()
    if topology == "dtree":
        assert "relaying to worker w0 chunks 0 mod 2" in workers[1].output()
        assert "relaying to worker w0 chunks 1 mod 2" in workers[2].output()
    assert len({w.output().rsplit("worker digest ", 1)[1].strip() for w in workers}) == 1


@pytest.mark.parametrize(("topology", "relay_rank"), [("chain", 0), ("dtree", 1)])
def test_a_relay_worker_killed_mid_broadcast_is_named_as_the_culprit(cluster, topology, relay_rank):
    # chain: rank 0 relays to 1, 1 to 2; dtree of 3: rank 1 relays tree A to 0 and 2
    chief = cluster.chief("--workers", "3", "--topology", topology, "--no-shm", "--model", "transformer-100m",
                          "--chunk-bytes", "65536", *HB)
    relay = cluster.worker("relay", "--rank", str(relay_rank), *HB, code=SLOW_RECEIVER)
    others = [r for r in range(3) if r != relay_rank]
    downstream = [cluster.worker(f"d{i}", "--rank", str(i), *HB) for i in others]
    wait_for(relay, f"relaying to worker d{others[0]}")
    relay.signal(signal.SIGKILL)
    assert chief.wait(30) != 0
    error = error_line(chief.output(), "round aborted:")
    assert "worker relay (rank" in error, error
    for d in downstream:
        assert d.wait(30) != 0
        assert "training started" not in d.output()


# A worker whose relay lies: it flips one bit of the first chunk it forwards (its own copy intact).
_LYING_RELAY = tampering_relay(forge_trailer=False)


@pytest.mark.parametrize(("topology", "liar", "via", "victim"),
                         [("chain", 1, "", 2), ("tree", 0, "", 2), ("dtree", 0, ", tree B", 1)])
def test_a_relay_that_forwards_corrupted_bytes_is_named_and_start_is_never_released(cluster, topology, liar, via,
                                                                                    victim):
    # chain: rank 2 receives from rank 1; tree (binomial): rank 2 from rank 0; dtree: rank 1
    # receives tree B's chunks from rank 0, its only child (and tree A's from the chief). Before,
    # the chief blamed the receiver alone ("worker w2 failed during receive: ... differ").

    chief = cluster.chief("--workers", "3", "--topology", topology, "--no-shm", "--chunk-bytes", "65536",
                          *HB)
    workers = []
    for i in range(3):
        workers.append(cluster.worker(f"w{i}", "--rank", str(i), *HB, code=_LYING_RELAY if i == liar else None))
    assert chief.wait(60) != 0
    aborted = error_line(chief.output(), "round aborted:")
    assert f"worker w{victim} (rank {victim}" in aborted and "differ from the chief's" in aborted, aborted
    assert f"the bytes came from relay worker w{liar} (rank {liar}{via}): its relay or the link from it changed them" in aborted
    # The culprit is the relay, not the worker that found the bad bytes.
    result = json.loads((cluster.tmp / "result.json").read_text())
    assert (result["culprit"], result["error_phase"]) == (f"w{liar}", "receive"), result
    for w in workers:
        assert w.wait(30) != 0
        assert "training started" not in w.output()


# A worker whose verification takes long (here: a 60 s sleep), so it is killed between two calls.
_SLOW_VERIFY = """
import sys, time
from collective.worker import agent
real = agent.make_replicas
def slow(*args):
    print('VERIFYING', flush=True)
    time.sleep(60)
    return real(*args)
agent.make_replicas = slow
from collective.worker.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_worker_killed_between_two_calls_is_named_through_its_presence_call(cluster):
    """No call of the victim is open when it dies (its stream ended, its ready report has not
    started) and the lease is 60 s: only the presence call can tell the chief in time."""
    lease = ["--heartbeat-interval", "1", "--heartbeat-timeout", "60"]
    chief = cluster.chief("--workers", "2", *lease)
    victim = cluster.worker("victim", *lease, code=_SLOW_VERIFY)
    other = cluster.worker("other", *lease)
    wait_for(victim, "VERIFYING")
    victim.signal(signal.SIGKILL)
    assert chief.wait(30) != 0
    aborted = error_line(chief.output(), "round aborted:")
    assert "worker victim (rank" in aborted, aborted
    assert "was lost during the broadcast: its presence call was cut off" in aborted
    assert other.wait(30) != 0 and "victim" in error_line(other.output())


def test_ctrl_c_on_the_chief_tells_every_worker_at_once_and_blames_no_worker(cluster):
    # Default heartbeats (lease 15 s): a worker that exits within 10 s heard it from the chief.
    chief = cluster.chief("--workers", "2")
    worker = cluster.worker("w0")
    wait_for(worker, "waiting for the plan")
    wait_for(chief, "worker w0 (rank 0")
    chief.signal(signal.SIGINT)
    assert chief.wait(10) != 0
    assert worker.wait(10) != 0
    assert "chief interrupted (SIGINT)" in worker.output()
    chief_out = chief.output()
    assert "round aborted: chief interrupted (SIGINT)" in chief_out
    assert "left before the broadcast" not in chief_out and "was lost" not in chief_out
    assert "Traceback" not in chief_out + worker.output()


@pytest.mark.parametrize("started", ["in the foreground", "as a background job (SIGINT inherited ignored)"])
def test_ctrl_c_on_a_worker_ends_it_with_one_line_and_exit_130(cluster, started):
    # A script's `worker &` (and CI's own runner) hands SIGINT down as SIG_IGN; the worker
    # must still hear the SIGINT a user or a launcher sends it.
    cluster.chief("--workers", "2")
    worker = cluster.worker("w0", sigint_ignored=started != "in the foreground")
    wait_for(worker, "waiting for the plan")
    worker.signal(signal.SIGINT)
    assert worker.wait(10) == 130
    out = worker.output()
    assert out.rstrip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in out


def test_a_worker_beyond_workers_is_refused_and_the_chief_logs_it(cluster):
    chief = cluster.chief("--workers", "1", "--model", "transformer-100m", "--chunk-bytes", "65536",
                          "--no-shm", *HB)
    member = cluster.worker("member", *HB)
    wait_for(member, "phase=receive")
    extra = cluster.worker("extra", *HB)
    assert extra.wait(30) != 0
    assert "worker 'extra'" in extra.output() and "joins are closed" in extra.output()
    assert member.wait(60) == 0, member.output()
    assert chief.wait(30) == 0
    [line] = [ln for ln in chief.output().splitlines() if "refused a join" in ln]
    assert "WARNING" in line and "worker 'extra' from" in line and "with all 1 worker(s); joins are closed" in line


def test_a_frozen_chief_mid_broadcast_is_named_by_every_worker_of_a_chain_within_the_lease(cluster):
    """Each worker watches the chief through its own heartbeats, whoever feeds it data: a
    relay-fed worker must not wait for its parent to notice first (one lease per hop)."""
    chief = cluster.chief("--workers", "4", "--topology", "chain", "--no-shm", "--model", "transformer-100m",
                          "--chunk-bytes", "65536", *HB)
    workers = [cluster.worker(f"w{i}", "--rank", str(i), "--no-shm", *HB, code=SLOW_RECEIVER if i == 0 else None)
               for i in range(4)]
    wait_for(workers[2], "relaying to worker w3")  # bytes are moving down the whole chain
    chief.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    took = {}
    try:
        for w in workers:
            assert w.wait(60) != 0, w.output()
            took[w] = time.monotonic() - t0
    finally:
        chief.signal(signal.SIGCONT)
    lease = 1.5
    for w in workers:
        line = error_line(w.output())
        assert f"chief at {cluster.address} unresponsive" in line, line
        assert "round aborted by the chief" not in line, line
        # the lease, the heartbeat that finds it out (interval + its timeout), and slack
        assert took[w] < lease + 2 * 0.3 + 3.0, f"{line}: {took[w]:.1f} s after the chief froze"
    # Woken mid-broadcast, the chief blames itself, not w0 ("its presence call was cut off").
    assert chief.wait(20) != 0
    aborted = error_line(chief.output(), "round aborted:")
    assert "the chief was stopped for" in aborted and "(frozen)" in aborted and "broadcasting" in aborted, aborted
    assert "worker w" not in aborted, aborted


def test_a_frozen_relay_parent_is_named_by_its_children_not_the_chief(cluster):
    """A relay worker frozen mid-broadcast: the chief's lease names it, and the workers below
    it hear that at once (their stream from the frozen relay is cut), naming the parent."""
    chief = cluster.chief("--workers", "3", "--topology", "chain", "--no-shm", "--model", "transformer-100m",
                          "--chunk-bytes", "65536", *HB)
    workers = [cluster.worker(f"w{i}", "--rank", str(i), "--no-shm", *HB, code=SLOW_RECEIVER if i == 0 else None)
               for i in range(3)]
    wait_for(workers[1], "relaying to worker w2")
    workers[0].signal(signal.SIGSTOP)
    t0 = time.monotonic()
    took = {}
    try:
        for w in workers[1:]:
            assert w.wait(60) != 0, w.output()
            took[w] = time.monotonic() - t0
        assert chief.wait(30) != 0
    finally:
        workers[0].signal(signal.SIGCONT)
    assert "worker w0 (rank 0, host" in error_line(chief.output()) and "no heartbeat" in error_line(chief.output())
    for w in workers[1:]:
        line = error_line(w.output())
        assert "worker w0 (rank 0" in line and "unresponsive" not in line, line
        assert took[w] < 1.5 + 2 * 0.3 + 3.0, f"{line}: {took[w]:.1f} s after w0 froze"
