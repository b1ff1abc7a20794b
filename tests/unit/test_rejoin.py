"""A worker lost mid-broadcast rejoins and the others go on (collective/chief/rejoin.py), over the
in-memory transport, with in-memory relays so a chain really relays. "Killing" a worker here
ends its agent's thread with an exception no handler catches (nothing is reported to the chief,
its relay stops as a dead process's would) and tells the chief its calls were cut off."""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import pytest

from collective._proto import collective_pb2 as pb
from collective.chief.rejoin import nearest_live
from collective.chief.service import Phase
from collective.chief.supervise import CAUSE_GRACE
from collective.errors import AbortedError, AlreadyExistsError, PreconditionError
from collective.plan import parent_in, trees_of
from collective.transport.inmemory import InMemoryEndpoint, InMemoryLink
from collective.worker.agent import WorkerAgent
from collective.worker.relay import RelayHandler
from tests.clusters import FAST, chief_service, inmemory_endpoint

T = dataclasses.replace(FAST, heartbeat=0.1, lease=5.0, rejoin=20.0, stall=20.0, ready=60.0, start=60.0)
ARRAYS = {"w": np.arange(64 * 1024, dtype=np.uint8), "b": np.arange(100, dtype=np.float32)}  # 17 chunks of 4 KiB
PEER = "ipv4:127.0.0.1:40000"


class Killed(BaseException):
    """Ends an agent's thread like SIGKILL ends a process: no handler of the agent runs."""


class MemoryRelay:
    """A worker's relay over the in-memory transport (``collective.worker.relay.Relay``'s shape)."""

    def __init__(self, port: int) -> None:
        self.port, self.cert_pem = port, b""
        self.handler = RelayHandler(stall_timeout=T.stall)
        self.endpoint = InMemoryEndpoint(f"relay-{port}")
        self.endpoint.start(self.handler)

    def feed(self, plan, arena, known=None, landed=None) -> None:
        self.handler.feed(plan, arena, known, landed)

    def progress(self) -> None:
        self.handler.progress()

    def stop(self, reason: str = "the round is over") -> None:
        self.handler.fail(reason)


class Death:
    """One agent's death, shared by its links: the first link to reach its chunk dies (once the
    test has seen ``died`` and cleared it), the agent's others (a double tree's second stream)
    with it."""

    def __init__(self, died: threading.Event) -> None:
        self.died, self.killed, self._lock, self._claimed = died, threading.Event(), threading.Lock(), False

    def now(self) -> None:
        with self._lock:
            first, self._claimed = not self._claimed, True
        if first:
            self.died.set()
            wait_until(lambda: not self.died.is_set())
            self.killed.set()
        wait_until(self.killed.is_set)
        raise Killed


class Dying(InMemoryLink):
    """A link (to the chief or a relay) that delivers ``after`` chunks, then kills its agent
    (``Death``) once the test saw its children take some of them."""

    def __init__(self, endpoint: InMemoryEndpoint, after: int, death: Death) -> None:
        super().__init__(endpoint, peer=PEER)
        self._after, self._death = after, death

    def receive_into(self, ref, receiver, stall_timeout: float) -> None:
        for i, chunk in enumerate(self.fetch(ref, stall_timeout)):
            if i == self._after or self._death.killed.is_set():
                self._death.now()
            receiver.accept(chunk)


class Cluster:
    """A chief and in-memory agents with relays; ``agent(...)`` makes one more."""

    def __init__(self, workers: int, topology: str, timeouts=T, **options) -> None:
        self.service = chief_service(ARRAYS, workers, timeouts=timeouts, topology=topology, **options)
        self.endpoint = inmemory_endpoint(self.service)
        self.relays: dict[str, MemoryRelay] = {}
        self.timeouts = timeouts

    def agent(self, worker_id: str, rank: int, *, dies_after: int | None = None,
              died: threading.Event | None = None) -> WorkerAgent:
        relay = MemoryRelay(41000 + len(self.relays))
        self.relays[f"127.0.0.1:{relay.port}"] = relay

        death = Death(died) if died is not None else None

        def link(endpoint):
            return InMemoryLink(endpoint, peer=PEER) if death is None else Dying(endpoint, dies_after, death)

        def connect(parent, name):
            return link(self.relays[parent.relay_address].endpoint)

        return WorkerAgent(link(self.endpoint), worker_id=worker_id, preferred_rank=rank,
                           timeouts=self.timeouts, relay=relay, connect=connect)

    def kill(self, agent: WorkerAgent) -> None:
        """What the transport does when a process dies: its calls end unanswered."""
        self.service.lost(agent.ref, "its fetch call was cut off (process gone or connection lost)")


def wait_until(condition, timeout: float = 60.0) -> None:
    done = threading.Event()
    while not condition():
        assert not done.wait(0.01) and (timeout := timeout - 0.01) > 0, "condition never held"


def run_in_threads(fns):
    out: list = [None] * len(fns)
    threads = []
    for i, fn in enumerate(fns):
        def wrap(i=i, fn=fn):
            try:
                out[i] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                out[i] = exc
        threads.append(threading.Thread(target=wrap, daemon=True))
        threads[-1].start()
    return out, threads


def join_all(threads, timeout: float = 120.0) -> None:
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread did not finish"


@pytest.mark.parametrize(("topology", "workers", "victim", "orphans"), [
    ("chain", 3, 1, [2]),  # 0 <- chief, 1 <- 0, 2 <- 1
    ("tree", 6, 0, [2, 4]),  # binomial: 2 and 4 receive from 0, 5 from 1
    # double tree A: 0 <- chief, 4 <- 0, 2 <- 4, 5 <- 4, 1 <- 2, 3 <- 2; B: 5 <- chief, 1 <- 5,
    # 3 <- 1, 0 <- 1, 2 <- 3, 4 <- 3 (topology.dtree_parents(6))
    ("dtree", 6, 2, [1, 3]),  # 2 is interior in tree A only
    ("dtree", 6, 1, [0, 3]),  # 1 is interior in tree B only
])
def test_a_worker_killed_mid_stream_rejoins_its_children_resume_and_the_round_completes(
        topology, workers, victim, orphans, caplog):
    caplog.set_level(logging.INFO)
    c = Cluster(workers, topology)
    died = threading.Event()
    # Half of the stream; a double tree's victim has two streams of half each: half of one.
    after = 4 if topology == "dtree" else 8
    agents = [c.agent(f"w{r}", r, **({"dies_after": after, "died": died} if r == victim else {})) for r in range(workers)]
    results, threads = run_in_threads([a.run for a in agents] + [c.service.supervise])
    assert died.wait(60), "the victim never reached half of the stream"
    wait_until(lambda: all(agents[r].bytes_received > 0 for r in orphans))  # they hold part of the stream
    died.clear()
    wait_until(lambda: not threads[victim].is_alive())
    old = agents[victim]
    c.kill(old)
    assert c.service.phase is Phase.BROADCASTING  # waiting for a comeback, not failed
    reborn = c.agent(f"w{victim}", victim)
    assert reborn.incarnation != old.incarnation
    late, late_threads = run_in_threads([reborn.run])
    join_all(threads + late_threads)

    assert isinstance(results[victim], Killed)
    assert results[-1] is None, results[-1]  # supervise: start released
    done = [r for i, r in enumerate(results[:-1]) if i != victim] + late
    for r in done:
        assert not isinstance(r, BaseException), r
        assert r.variables.get("w").replicas[0].tobytes() == ARRAYS["w"].tobytes()
    assert late[0].rank == victim
    assert len({r.worker_digest for r in done}) == 1
    summary = c.service.result()
    assert summary["ok"] is True and summary["rejoined"] == [f"w{victim}"]
    by_rank = {w["rank"]: w for w in summary["workers"]}
    assert by_rank[victim]["incarnation"] == reborn.incarnation
    assert all(by_rank[r]["incarnation"] == agents[r].incarnation for r in range(workers) if r != victim)
    # The orphans moved to the victim's nearest live ancestor and resumed where they stood.
    # In a double tree, in the tree where the victim was their parent.
    first, plan = done[0].plan, c.service.state.plan
    for tree in range(trees_of(first)):
        ancestors = {w.rank: parent_in(w, tree) for w in first.workers}
        parent = nearest_live(ancestors, {victim}, victim)
        for r in orphans:
            if ancestors[r] == victim:
                assert parent_in(next(w for w in plan.workers if w.rank == r), tree) == parent
    assert {r for r in range(workers) for t in range(trees_of(first))
            if parent_in(next(w for w in first.workers if w.rank == r), t) == victim} == set(orphans)
    resumed = [rec.getMessage() for rec in caplog.records if "resuming the stream at byte" in rec.getMessage()]
    assert len(resumed) == len(orphans) and all(" at byte 0 " not in m for m in resumed), resumed
    assert "rejoined as incarnation" in caplog.text


def test_a_worker_lost_that_never_comes_back_fails_the_round_naming_it_after_the_window():
    t = dataclasses.replace(T, rejoin=1.0)
    c = Cluster(3, "chain", t)
    died = threading.Event()
    agents = [c.agent(f"w{r}", r, **({"dies_after": 4, "died": died} if r == 1 else {})) for r in range(3)]
    results, threads = run_in_threads([a.run for a in agents] + [c.service.supervise])
    assert died.wait(60)
    died.clear()
    c.kill(agents[1])
    join_all(threads)
    assert isinstance(results[-1], AbortedError)
    msg = str(results[-1])
    assert "worker w1 (rank 1" in msg and "was lost during the broadcast" in msg, msg
    assert "did not rejoin within 1 s" in msg, msg
    assert results[-1].culprit == "w1"
    for r in (results[0], results[2]):
        assert isinstance(r, AbortedError) and "w1" in str(r), r
    assert c.service.result()["culprit"] == "w1"


def _joined(service, n: int) -> list[pb.WorkerRef]:
    refs = []
    for i in range(n):
        req = pb.JoinRequest(worker_id=f"w{i}", incarnation=f"inc{i}", devices=["cpu:0"], host="h", preferred_rank=i)
        secret = service.join(req, PEER).secret
        refs.append(pb.WorkerRef(worker_id=f"w{i}", incarnation=f"inc{i}", secret=secret))
    assert service.phase is Phase.BROADCASTING
    return refs


@pytest.mark.parametrize("options", [{}, {"timeouts": dataclasses.replace(T, rejoin=0.0)}, {"heartbeats": False}],
                         ids=["rejoin-window", "rejoin-timeout-0", "mpi-no-heartbeats"])
def test_a_join_under_a_live_members_id_after_the_plan_is_refused_and_the_round_goes_on(options):
    # Anyone with the token can name a member's id; a live member keeps its slot (no secret, no takeover).
    service = chief_service(ARRAYS, 2, **{"timeouts": T, **options})
    refs = _joined(service, 2)
    with pytest.raises(AlreadyExistsError, match=r"worker id 'w0' is held by a live process \(worker w0 \(rank 0"):
        service.join(pb.JoinRequest(worker_id="w0", incarnation="new", devices=["cpu:0"], host="h"), PEER)
    assert service.phase is Phase.BROADCASTING
    beat = service.heartbeat(pb.HeartbeatRequest(worker_id="w0", incarnation="inc0", secret=refs[0].secret))
    assert beat.phase == "broadcasting"  # w0 still holds its slot and acts as itself


def test_without_a_rejoin_window_a_lost_worker_fails_the_round_and_its_restart_hears_it():
    service = chief_service(ARRAYS, 2, timeouts=dataclasses.replace(T, rejoin=0.0))
    refs = _joined(service, 2)
    service.lost(refs[0], "its presence call was cut off")
    with service.state.cond:  # after the grace in which its own report of a cause could still come
        service.state.cond.wait_for(lambda: service.phase is Phase.FAILED, timeout=CAUSE_GRACE + 10)
    assert service.phase is Phase.FAILED
    with pytest.raises(AbortedError, match=r"worker w0 \(rank 0.*was lost during the broadcast"):
        service.join(pb.JoinRequest(worker_id="w0", incarnation="new", devices=["cpu:0"], host="h"), PEER)


def test_a_restart_takes_the_rank_and_the_replaced_incarnation_is_refused_from_then_on():
    service = chief_service(ARRAYS, 2, timeouts=T)
    refs = _joined(service, 2)
    service.lost(refs[1], "its presence call was cut off")  # its slot is free: a restart may take it
    reply = service.join(pb.JoinRequest(worker_id="w1", incarnation="new", devices=["cpu:0"], host="h"), PEER)
    assert reply.rank == 1 and service.phase is Phase.BROADCASTING and reply.secret != refs[1].secret
    plan = service.get_plan(pb.WorkerRef(worker_id="w1", incarnation="new", secret=reply.secret), 1.0)
    assert next(w for w in plan.workers if w.rank == 1).incarnation == "new"
    # The old process, back (SIGCONT, a healed link), is told it was replaced, on every call.
    with pytest.raises(PreconditionError, match="joined as another incarnation"):
        service.heartbeat(pb.HeartbeatRequest(worker_id="w1", incarnation=refs[1].incarnation, secret=refs[1].secret))
    with pytest.raises(PreconditionError):
        service.get_plan(refs[1], 1.0)
    assert service.phase is Phase.BROADCASTING


def test_a_restart_with_other_devices_is_refused_and_the_round_still_waits():
    service = chief_service(ARRAYS, 2, timeouts=T)
    refs = _joined(service, 2)
    service.lost(refs[1], "its presence call was cut off")
    with pytest.raises(PreconditionError, match="keeps its devices"):
        service.join(pb.JoinRequest(worker_id="w1", incarnation="new", devices=["cpu:0", "cpu:1"], host="h"), PEER)
    assert service.phase is Phase.BROADCASTING


def test_a_lost_incarnation_that_comes_back_is_refused_not_resurrected():
    service = chief_service(ARRAYS, 2, timeouts=T)
    refs = _joined(service, 2)
    service.lost(refs[0], "no heartbeat for 5.1 s (lease 5 s)")
    assert service.phase is Phase.BROADCASTING
    with pytest.raises(AbortedError, match="was declared lost"):
        service.heartbeat(pb.HeartbeatRequest(worker_id="w0", incarnation=refs[0].incarnation, secret=refs[0].secret))
    with pytest.raises(AbortedError, match="was declared lost"):
        service.await_prepared(refs[0], 1.0)
    assert "w0 (rank 0" in service.supervisor.waiting_for() and "[lost]" in service.supervisor.waiting_for()


@pytest.mark.parametrize(("parents", "lost", "rank", "want"), [
    ({0: -1, 1: 0, 2: 1, 3: 2}, {1}, 2, 0),
    ({0: -1, 1: 0, 2: 1, 3: 2}, {1, 2}, 3, 0),
    ({0: -1, 1: 0, 2: 1, 3: 2}, {0, 1, 2}, 3, -1),
    ({0: -1, 1: 0, 2: 1, 3: 2}, {3}, 2, 1),
    ({0: -1, 1: -1, 2: 0, 3: -1, 4: 0, 5: 1}, {0}, 4, -1),
])
def test_nearest_live_ancestor(parents, lost, rank, want):
    assert nearest_live(parents, lost, rank) == want
