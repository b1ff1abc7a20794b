"""A worker's replicas: one arena per device, variables made on first use, verified by chunk."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from collective.chief.service import Phase
from collective.errors import (
    AbortedError,
    DeadlineError,
    FrozenError,
    IntegrityError,
    InvalidVariableError,
)
from collective.replicas import make_replicas, verify_replicas
from collective.variables import (
    MirroredVariable,
    SyncOnReadVariable,
    VariableStore,
    create_variable,
    variable_over,
)
from collective.worker import agent as agent_mod
from collective.worker.agent import WorkerAgent
from tests.clusters import (
    FAST,
    chief_service,
    inmemory_cluster,
    inmemory_endpoint,
    run_threads,
)


def many_small(n: int, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i:05d}/w": rng.standard_normal(256).astype(np.float32) for i in range(n)}


def run_cluster(arrays, devices_per_worker, chunk_bytes=64 << 10):
    service, _, agents = inmemory_cluster(arrays, devices_per_worker, chunk_bytes=chunk_bytes)
    *results, sup = run_threads([a.run for a in agents] + [service.supervise], timeout=60)
    return service, results, sup


def test_five_thousand_small_variables_arrive_bit_exact_on_every_device_in_model_order():
    arrays = many_small(5000)
    service, results, sup = run_cluster(arrays, [["cpu:0", "cpu:1", "cpu:2"], ["cpu:0"]])
    assert sup is None and service.phase is Phase.STARTED
    # 5000 x 1 KiB in 64 KiB chunks: 79 digests per replica arena, not 5000.
    assert len(results[0].plan.chunk_digests) == 79
    for r in results:
        store = r.variables
        assert len(store) == 5000
        assert [v.name for v in store.global_variables] == list(arrays)
        for name, a in arrays.items():
            v = store.get(name)
            assert len(v.replicas) == len(r.devices)
            for replica in v.replicas:
                assert replica.tobytes() == a.tobytes()
    assert len({r.worker_digest for r in results if len(r.devices) == 3}) == 1
    assert results[0].worker_digest != results[1].worker_digest  # 3 replica arenas vs 1


def test_replicas_on_different_devices_do_not_share_memory():
    arrays = many_small(10)
    service, (r,), sup = run_cluster(arrays, [["cpu:0", "cpu:1"]])
    v = r.variables.get("layer00003/w")
    v.replicas[1][0] = 42.0
    assert v.replicas[0][0] == arrays["layer00003/w"][0]
    assert not np.shares_memory(v.replicas[0], v.replicas[1])
    neighbour = r.variables.get("layer00004/w")
    assert neighbour.replicas[1].tobytes() == arrays["layer00004/w"].tobytes()


def test_a_replica_that_differs_on_a_second_device_is_named_with_its_variable_and_device(monkeypatch):
    arrays = many_small(200)
    real = agent_mod.make_replicas

    def corrupt_second_device(plan, arena, devices):
        store, arenas = real(plan, arena, devices)
        v = next(v for v in plan.variables if v.name == "layer00123/w")
        arenas[1][v.offset + 5] ^= 0x10
        return store, arenas

    monkeypatch.setattr(agent_mod, "make_replicas", corrupt_second_device)
    service, (r,), sup = run_cluster(arrays, [["cpu:0", "cpu:1"]])
    assert isinstance(r, IntegrityError)
    assert "variable 'layer00123/w': replica 'layer00123/w/replica_1' on cpu:1 has digest" in str(r)
    assert isinstance(sup, AbortedError) and "layer00123/w" in str(sup)
    assert service.phase is Phase.FAILED


def test_verify_replicas_returns_one_chunk_digest_list_per_device():
    arrays = many_small(20)
    service, (r,), sup = run_cluster(arrays, [["cpu:0"]], chunk_bytes=4096)
    plan = r.plan
    arena = np.zeros(plan.total_bytes, np.uint8)
    for v in plan.variables:
        arena[v.offset : v.offset + v.nbytes] = np.frombuffer(arrays[v.name].tobytes(), np.uint8)
    store, arenas = make_replicas(plan, arena, ["cpu:0", "cpu:1"])
    out = verify_replicas(plan, arenas, ["cpu:0", "cpu:1"])
    assert [(d.device, d.replica) for d in out] == [("cpu:0", 0), ("cpu:1", 1)]
    expected = [xxhash.xxh3_128_hexdigest(arena[i : i + 4096].tobytes()) for i in range(0, plan.total_bytes, 4096)]
    assert [list(d.chunk_digests) for d in out] == [expected, expected] == [list(plan.chunk_digests)] * 2


# --- the barrier before the first byte ----------------------------------------------------------


def test_no_worker_takes_bytes_until_every_worker_is_prepared():
    arrays = many_small(30)
    service = chief_service(arrays, 2)
    endpoint = inmemory_endpoint(service)
    from collective._proto import collective_pb2 as pb

    slow = endpoint.link()
    slow_ref = pb.WorkerRef(worker_id="slow", incarnation="s1")
    slow_ref.secret = slow.join(pb.JoinRequest(worker_id="slow", incarnation="s1", devices=["cpu:0"]), 1).secret
    fast = WorkerAgent(endpoint.link(), worker_id="fast", devices=["cpu:0"], timeouts=FAST)
    done, outcome = threading.Event(), []

    def run_fast():
        try:
            outcome.append(fast.run())
        except AbortedError as exc:
            outcome.append(exc)
        done.set()

    t = threading.Thread(target=run_fast, daemon=True)
    t.start()
    slow.get_plan(slow_ref, 5)
    assert not done.wait(0.5)
    status = service.status()
    phases = {w.worker_id: w.phase for w in status.workers}
    assert phases["fast"] == "prepared" and phases["slow"] == "joined"
    assert all(w.bytes_received == 0 for w in status.workers)  # no byte left the chief yet
    assert "slow" in status.waiting_for
    brief = endpoint.link().status(5, brief=True)  # a waiting worker's question: no worker lines
    assert (brief.phase, brief.joined, brief.waiting_for, len(brief.workers)) == (status.phase, 2, status.waiting_for, 0)
    assert slow.await_prepared(slow_ref, 5).prepared == 2
    for _ in slow.fetch(slow_ref, 5):
        pass
    service.fail(AbortedError("test over"))  # the slow worker never reports ready
    assert done.wait(10) and isinstance(outcome[0], AbortedError)


def test_a_worker_that_never_prepares_is_named_when_the_barrier_times_out():
    from collective._proto import collective_pb2 as pb

    service = chief_service(many_small(3), 2)
    endpoint = inmemory_endpoint(service)
    refs = []
    for name in ("a", "b"):
        link = endpoint.link()
        ref = pb.WorkerRef(worker_id=name, incarnation="i")
        ref.secret = link.join(pb.JoinRequest(worker_id=name, incarnation="i", devices=["cpu:0"]), 1).secret
        refs.append((link, ref))
    refs[0][0].get_plan(refs[0][1], 5)
    with pytest.raises(DeadlineError, match=r"not every worker prepared within 0.3 s; waiting for: worker b \(rank 1"):
        refs[0][0].await_prepared(refs[0][1], 0.3)


def test_the_barrier_ends_with_the_rounds_failure():
    from collective._proto import collective_pb2 as pb

    service = chief_service(many_small(3), 2)
    endpoint = inmemory_endpoint(service)
    link = endpoint.link()
    ref = pb.WorkerRef(worker_id="a", incarnation="i")
    ref.secret = link.join(pb.JoinRequest(worker_id="a", incarnation="i", devices=["cpu:0"]), 1).secret
    other = endpoint.link()
    other.join(pb.JoinRequest(worker_id="b", incarnation="i", devices=["cpu:0"]), 1)
    link.get_plan(ref, 5)
    timer = threading.Timer(0.2, lambda: service.fail(AbortedError("worker b was lost: no heartbeat")))
    timer.start()
    with pytest.raises(AbortedError, match="worker b was lost"):
        link.await_prepared(ref, 5)


# --- the store's deferred variables ---------------------------------------------------------------


def deferred_store(n=4, made=None):
    arrays = [np.full(3, i, np.float32) for i in range(n)]
    made = [] if made is None else made

    def make(i):
        made.append(i)
        sync = "ON_READ" if i == 2 else "AUTO"
        return variable_over(f"v{i}", [arrays[i], arrays[i].copy()], ["cpu:0", "cpu:1"], synchronization=sync,
                             aggregation="SUM" if i == 2 else "NONE")

    store = VariableStore()
    store.defer(lambda: [f"v{i}" for i in range(n)], make)
    return store, made, arrays


def test_deferred_variables_are_made_on_first_use_and_kept():
    store, made, arrays = deferred_store()
    assert "v3" in store and len(store) == 4 and made == []
    v = store.get("v3")
    assert made == [3] and v is store.get("v3") and made == [3]
    assert v.replicas[0] is arrays[3]  # the given array itself, no copy
    assert store["v3"] is v
    assert made == [3]  # a failed lookup below makes no variable either
    with pytest.raises(KeyError, match=r"no variable named 'v9' among the 4 in this store; did you mean 'v[0-3]'"):
        store.get("v9")
    with pytest.raises(KeyError) as info:
        store["dense_1/kernel"]
    assert info.value.args[0] == "no variable named 'dense_1/kernel' among the 4 in this store"
    assert made == [3]


def test_deferred_variables_keep_their_order_and_types_in_the_collections():
    store, made, _ = deferred_store()
    store.get("v2")
    assert [v.name for v in store.global_variables] == ["v0", "v1", "v2", "v3"]
    assert isinstance(store.get("v2"), SyncOnReadVariable) and isinstance(store.get("v0"), MirroredVariable)
    assert [v.name for v in store.trainable_variables] == ["v0", "v1", "v3"]
    assert sorted(made) == [0, 1, 2, 3]


def test_a_deferred_store_refuses_a_clashing_name_and_freezes_at_start():
    store, _, _ = deferred_store()
    with pytest.raises(InvalidVariableError, match="already exists"):
        create_variable("v1", [1.0], ["cpu:0"], store=store)
    create_variable("extra", [1.0], ["cpu:0"], store=store)
    assert [v.name for v in store][-1] == "extra"
    store.start()
    with pytest.raises(FrozenError):
        create_variable("late", [1.0], ["cpu:0"], store=store)
    with pytest.raises(FrozenError):
        store.defer(list, lambda i: None)


def test_variable_over_refuses_replicas_that_do_not_match():
    a = np.zeros(3, np.float32)
    with pytest.raises(InvalidVariableError, match="2 replicas for 1 devices"):
        variable_over("x", [a, a.copy()], ["cpu:0"])
    with pytest.raises(InvalidVariableError, match="one shape and dtype"):
        variable_over("x", [a, np.zeros(4, np.float32)], ["cpu:0", "cpu:1"])
    ro = a.copy()
    ro.flags.writeable = False
    with pytest.raises(InvalidVariableError, match="writeable"):
        variable_over("x", [ro], ["cpu:0"])


def test_an_unexpected_error_in_a_worker_reaches_the_chief_at_once(monkeypatch):
    def broken(plan, arena, devices):
        raise MemoryError("cannot allocate the replica arena for cpu:1")

    monkeypatch.setattr(agent_mod, "make_replicas", broken)
    service, (r,), sup = run_cluster(many_small(5), [["cpu:0", "cpu:1"]])  # ready timeout 10 s
    assert isinstance(r, MemoryError)
    assert isinstance(sup, AbortedError)
    assert "internal error in the worker: MemoryError: cannot allocate the replica arena for cpu:1" in str(sup)
    assert "w0" in str(sup) and service.phase is Phase.FAILED
