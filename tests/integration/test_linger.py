"""The chief's linger (issue 31): after start is released it keeps serving until every worker has
heard it, or cannot (its process gone, or silent for a lease), at most ``--linger`` seconds.

Before, it served at most 5 s after the outcome: at 1,024 workers on one loaded host, the workers
whose processes had not asked for start by then failed ("waiting for start was cancelled", or
the chief's port gone) although the round had started. Real processes over gRPC on loopback.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from tests.procs import wait_for

pytestmark = pytest.mark.integration

HB = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5"]
# Longer than the old linger (5 s) plus the status grace (0.5 s) and the server's stop grace (1 s).
LATE = 8.0


def late_asker(delay: float) -> str:
    """A worker process (``python -c`` this, then the worker's arguments) that asks for start
    ``delay`` s after it reported ready, as a starved process does; it heartbeats meanwhile."""
    return (
        "import sys, time\n"
        "from collective.transport.grpc.client import GrpcChiefLink\n"
        "real = GrpcChiefLink.await_start\n"
        "def late(self, ref, timeout):\n"
        "    print('asking for start late', flush=True)\n"
        f"    time.sleep({delay})\n"
        "    return real(self, ref, timeout)\n"
        "GrpcChiefLink.await_start = late\n"
        "from collective.worker.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )


def test_a_worker_that_asks_for_start_after_the_old_linger_still_hears_it(cluster):
    """Before: the chief stopped 5 s after start, and the late worker failed (exit 1, its
    AwaitStart refused: the port was gone) though every worker was ready."""
    chief = cluster.chief("--workers", "2", "--no-shm", *HB)
    prompt = cluster.worker("prompt", "--no-shm", *HB)
    late = cluster.worker("late", "--no-shm", *HB, code=late_asker(LATE))
    assert prompt.wait(60) == 0, prompt.output()
    wait_for(chief, "start released")
    assert late.wait(60) == 0, late.output()
    assert "training started" in late.output(), late.output()
    assert chief.wait(30) == 0, chief.output()
    assert "not told the outcome" not in chief.output(), chief.output()


def test_the_linger_does_not_wait_for_a_worker_that_died_before_it_asked(cluster):
    """A worker killed after it was ready, before it asked for start, cannot hear it: the chief
    stops once its lease passed (1.5 s), not after the whole --linger (60 s), and says whom."""
    chief = cluster.chief("--workers", "2", "--no-shm", "--linger", "60", *HB)
    prompt = cluster.worker("prompt", "--no-shm", *HB)
    doomed = cluster.worker("doomed", "--no-shm", *HB, code=late_asker(60))
    wait_for(doomed, "asking for start late")
    doomed.signal(signal.SIGKILL)
    assert prompt.wait(60) == 0, prompt.output()
    t0 = time.monotonic()
    assert chief.wait(40) == 0, chief.output()
    assert time.monotonic() - t0 < 30, "the chief waited out its --linger for a dead worker"
    assert "doomed" in chief.output().split("did not hear the outcome")[-1], chief.output()


def test_the_linger_is_bounded_by_the_chiefs_option(cluster):
    """A worker alive (it heartbeats) but not asking is waited for at most --linger s; the chief
    then names it."""
    chief = cluster.chief("--workers", "2", "--no-shm", "--linger", "2", *HB)
    prompt = cluster.worker("prompt", "--no-shm", *HB)
    late = cluster.worker("late", "--no-shm", *HB, code=late_asker(LATE))
    assert prompt.wait(60) == 0, prompt.output()
    assert chief.wait(30) == 0, chief.output()
    assert "after the 2 s linger (--linger) with 1 worker(s) not told the outcome: worker late" in chief.output(), chief.output()
    assert late.wait(60) != 0, late.output()  # it asks after the chief has gone


def on_host_b(*, stalls: bool = False) -> str:
    """A worker process (``python -c`` this, then the worker's arguments) that says it runs on
    host "host-b", not the chief's: two of them make a host whose leader receives from the
    network and serves its arena to the other. ``stalls``: the leader sleeps once every worker
    is prepared, before its first byte, so the other waits on its arena, not on the chief."""
    stall = (  # before mapping the chief's arena: the chief shares this machine, as "host-b" does not
        "from collective.transport import shm\n"
        "def stalled(*args, **kwargs):\n"
        "    print('stalling before its first byte', flush=True)\n"
        "    time.sleep(120)\n"
        "shm.attach = stalled\n"
    ) if stalls else ""
    return (
        "import socket, sys, time\n"
        "socket.gethostname = lambda: 'host-b'\n"
        f"{stall}"
        "from collective.worker.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )


def test_a_worker_waiting_on_its_host_leaders_arena_heeds_the_failure_its_presence_call_brings(cluster):
    """The chief counts a worker told once it has answered the worker's presence call with the
    failure, and stops serving when every worker is told. Before, the worker ignored that answer
    and learned of the failure only from its next heartbeat (every 20 s here, 5 s by default),
    which found the chief gone: it failed a heartbeat timeout later (60 s) blaming an
    unreachable chief. Seen in CI: a host leader killed, its peer waiting on its arena."""
    slow_beats = ["--heartbeat-interval", "20", "--heartbeat-timeout", "60"]
    chief = cluster.chief("--workers", "2", "--topology", "chain", "--linger", "5", *slow_beats)
    leader = cluster.worker("leader", "--rank", "0", *slow_beats, code=on_host_b(stalls=True))
    waiter = cluster.worker("waiter", "--rank", "1", *slow_beats, code=on_host_b())
    wait_for(leader, "stalling before its first byte")
    wait_for(waiter, "prepared to receive")
    chief.signal(signal.SIGTERM)
    assert chief.wait(30) != 0, chief.output()
    try:
        code = waiter.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail("the waiter did not hear the failure the chief told it:\n" + waiter.output())
    out = waiter.output()
    assert code == 1, out
    assert re.search(r"ERROR worker .*round aborted by the chief at .*chief shutting down \(SIGTERM\)", out), out
    assert "unreachable" not in out, out
