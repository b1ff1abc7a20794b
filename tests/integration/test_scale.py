"""Many workers on one chief (issue 31, item 1): real processes over gRPC on loopback.

256 workers of the project's own worker code, 64 per process (``collective.bench.manyworkers``),
join one chief at once and complete a verified round: every worker started, every digest
equal. The chief's threads do not grow with the workers: before, its server had a pool thread
per open call (each worker holds three or four for the whole round: 770 threads at 256
workers); now calls are coroutines and waits are parked, so 16 workers and 256 take the same
few dozen. ``collective bench scale`` measures the same round at 1,024 (BENCHMARKS.md).
"""

from __future__ import annotations

import threading
import time

import pytest

from collective._proto import collective_pb2 as pb
from collective.bench.scale import scale_round
from tests.clusters import TOKEN, grpc_chief

pytestmark = pytest.mark.integration

# The chief's threads once start is released, whatever the number of workers: the gRPC loop and
# its pool (16), the parking thread, the supervisor, the raw data port's accept loops, gRPC's
# own. (While a star streams, the raw data port has a thread per stream: the data plane's.)
THREADS_ANY_N = 48


def test_256_workers_in_4_processes_complete_a_verified_round_with_the_threads_of_16(tmp_path):
    small = scale_round(16, 16, tmp_path / "n16", timeout=120, relay=False)
    assert small["ok"], small
    large = scale_round(256, 64, tmp_path / "n256", timeout=180, relay=False)
    assert large["ok"], large
    assert len(large["digests"]) == 1 and large["digests"] == small["digests"], (small, large)
    print(f"chief threads at the end: {small['chief_threads_end']} for 16 workers, {large['chief_threads_end']} "
          f"for 256 (peak {small['chief_threads']}, {large['chief_threads']}); round {large['round_s']:.1f} s, "
          f"admitted in {large['admitted_s']:.1f} s, status at most {large['status_max_s']:.2f} s, "
          f"peak RSS {large['chief_rss_mib']:.0f} MiB")
    assert 0 < small["chief_threads_end"] <= THREADS_ANY_N, small
    assert 0 < large["chief_threads_end"] <= THREADS_ANY_N, large


class _SlowJoins:
    """A chief stand-in whose joins each take ``seconds`` on the server's pool (as 1,024 joins
    do, queued for their turn to compare declarations)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.release, self.asked = seconds, threading.Event(), []

    def join(self, req, peer):
        self.release.wait(self.seconds)
        return pb.JoinReply(rank=0, num_workers=1)

    def status(self, brief=False):
        self.asked.append(brief)
        return pb.StatusReply(phase="joining", expected=3, waiting_for="w2",
                              workers=[] if brief else [pb.WorkerStatus(rank=r) for r in range(3)])

    def lost(self, ref, reason):
        pass


def test_status_answers_while_a_join_storm_holds_every_pool_thread():
    """Before: Status ran on the pool (16 threads), so behind 48 joins of 2 s each it waited
    5.5 s here (6 s at 1,024 workers in the bench); now it has threads of its own."""
    from collective.transport.grpc import GrpcChiefLink

    handler = _SlowJoins(2.0)
    with grpc_chief(handler) as address:
        link = GrpcChiefLink(address, token=TOKEN)
        storm = [threading.Thread(target=lambda i=i: _quietly(link.join, pb.JoinRequest(
            worker_id=f"w{i}", incarnation="0" * 12), timeout=30), daemon=True) for i in range(48)]
        try:
            for t in storm:
                t.start()
            time.sleep(0.5)  # every pool thread holds a join, the rest are queued
            t0 = time.monotonic()
            reply = link.status(timeout=20)
            took = time.monotonic() - t0
        finally:
            handler.release.set()
            for t in storm:
                t.join(30)
            link.close()
    assert reply.phase == "joining"
    assert took < 1.5, f"Status took {took:.1f} s behind the joins"  # generous: a loaded machine


def test_a_waiting_worker_asks_a_brief_status_without_every_workers_line():
    """A ``collective.join`` worker that waits asks whom the round waits for (``_waits``): 1,024
    full answers at once were 100 MB of the chief's serializing. It asks a brief one over gRPC,
    which the chief builds apart from the full one a person's ``collective status`` gets."""
    from collective._waits import worker_awaits
    from collective.transport.grpc import GrpcChiefLink

    handler = _SlowJoins(0.0)
    with grpc_chief(handler) as address:
        link = GrpcChiefLink(address, token=TOKEN)
        try:
            said = worker_awaits(link, "chief", 10)()
            full = link.status(timeout=10)
        finally:
            link.close()
    assert said == "w2 (chief waits for them)"
    assert handler.asked == [True, False] and len(full.workers) == 3


def _quietly(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the storm's answers are not what is tested
        pass
