"""Shards (collective/shards.py): each rank receives only its part of the model, verified.

The in-memory cluster: a chief that does not train serves ``W = workers`` shards, worker rank k
holding shard k.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from collective.chief.service import Phase
from collective.errors import AbortedError, IntegrityError, ProtocolError, UsageError
from collective.plan import validate_plan
from collective.shards import assign, normalize, rows
from tests.clusters import (
    FAST,
    chief_service,
    flip_last_bit,
    inmemory_cluster,
    inmemory_endpoint,
    run_threads,
    small_arrays,
)


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "kernel": rng.standard_normal((33, 17)).astype(np.float32),  # 33 rows: uneven over 4
        "bias": rng.standard_normal(5).astype(np.float64),  # 5 rows over 4: 2, 2, 1, 0
        "embedding": rng.standard_normal((1000, 64)).astype(np.float16),
        "big_endian": np.arange(12, dtype=">i8").reshape(4, 3),
        "step": np.array(42, np.int64),  # 0-d: every rank holds it whole
        "empty": np.zeros((0, 3), np.float32),
    }


def model_bytes(arrays) -> int:
    return sum(a.nbytes for a in arrays.values())


def run(arrays, workers: int, shards, chunk_bytes: int = 4096):
    service, endpoint, agents = inmemory_cluster(arrays, [["cpu:0", "cpu:1"]] * workers, chunk_bytes=chunk_bytes,
                                                 shards=shards)
    *results, sup = run_threads([a.run for a in agents] + [service.supervise])
    return service, results, sup


def test_rows_follow_torch_chunk():
    assert [rows(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [rows(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [rows(33, 4, r) for r in range(4)] == [(0, 9), (9, 18), (18, 27), (27, 33)]
    assert [rows(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert [rows(0, 3, r) for r in range(3)] == [(0, 0)] * 3


def test_every_worker_holds_only_its_rows_of_dim_0_verified():
    arrays = model()
    service, results, sup = run(arrays, 4, "dim0")
    assert sup is None, sup
    assert service.phase is Phase.STARTED
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert r.plan.shard.index == rank and r.plan.shard.world == 4
        for name, whole in arrays.items():
            start, stop = rows(whole.shape[0], 4, rank) if whole.ndim else (0, 0)
            want = whole[start:stop] if whole.ndim else whole
            var = r.variables.get(name)
            for replica in var.replicas:  # every device of the worker holds the piece
                assert replica.dtype == whole.dtype and replica.shape == want.shape
                assert replica.tobytes() == want.tobytes()
        # Only its bytes: about a quarter of the model (its pieces, each 64-byte aligned).
        assert r.bytes_received == r.plan.total_bytes
        assert r.bytes_received <= model_bytes(arrays) / 4 + 64 * len(arrays) + arrays["step"].nbytes
    assert results[3].variables.get("bias").replicas[0].shape == (0,)  # 5 rows over 4: rank 3 holds none
    summary = service.result()
    assert [w["shard"] for w in summary["workers"]] == [0, 1, 2, 3]
    assert [w["bytes"] for w in summary["workers"]] == [r.plan.total_bytes for r in results]
    assert len({w["digest"] for w in summary["workers"]}) == 4  # each rank's own shard digests


def test_a_partition_gives_the_named_variables_to_the_named_ranks():
    arrays = small_arrays()
    request = {"embedding": [1, 2], "dense/kernel": 0, "dense/bias": "dim0", "*": "all"}
    service, results, sup = run(arrays, 3, request)
    assert sup is None, sup
    held = [sorted(v.name for v in r.variables) for r in results]
    everywhere = ["big_endian", "dense/bias", "empty", "global_step", "scalar"]
    assert held[0] == sorted(everywhere + ["dense/kernel"])
    assert held[1] == held[2] == sorted(everywhere + ["embedding"])
    for rank, r in enumerate(results):
        for v in r.variables:
            whole = arrays[v.name]
            if v.name == "dense/bias":
                start, stop = rows(17, 3, rank)
                whole = whole[start:stop]
            assert v.replicas[0].tobytes() == whole.tobytes() and v.replicas[0].shape == whole.shape
    assert results[0].bytes_received < arrays["embedding"].nbytes  # rank 0 never got the embedding
    # A count of what each holds on its devices (the summary's shape everywhere: launch, collective.mpi).
    replicas = [w["replicas"] for w in service.result()["workers"]]
    assert replicas == [len(h) * len(r.devices) for h, r in zip(held, results, strict=True)]


def test_the_chief_that_trains_holds_shard_0_and_workers_the_next():
    from collective.replicas import hold_chief_replicas
    from collective.worker.agent import WorkerAgent

    arrays = model()
    service = chief_service(arrays, 2, shards="dim0", local_devices=["cpu:0"])
    endpoint = inmemory_endpoint(service)
    agents = [WorkerAgent(endpoint.link(), worker_id=f"w{i}", devices=["cpu:0"], preferred_rank=i, timeouts=FAST)
              for i in range(2)]
    held, *results, sup = run_threads([lambda: hold_chief_replicas(service, ["cpu:0"], 5.0)]
                                      + [a.run for a in agents] + [service.supervise])
    assert sup is None, sup
    store, _ = held
    assert store.get("kernel").replicas[0].tobytes() == arrays["kernel"][:11].tobytes()  # rows(33, 3, 0)
    assert [r.plan.shard.index for r in results] == [1, 2]
    assert results[1].variables.get("kernel").replicas[0].tobytes() == arrays["kernel"][22:].tobytes()


def test_a_corrupted_shard_chunk_is_named_and_start_is_never_released():
    arrays = {"a": np.zeros((8, 4), np.float32), "b": np.ones((8, 4), np.float32)}
    service, endpoint, agents = inmemory_cluster(arrays, [["cpu:0"]] * 2, shards="dim0")
    flip_last_bit(agents[1].link)
    r0, r1, sup = run_threads([agents[0].run, agents[1].run, service.supervise])
    assert isinstance(r1, IntegrityError) and "'b'" in str(r1), r1
    assert isinstance(sup, AbortedError) and "w1" in str(sup) and "'b'" in str(sup)
    assert isinstance(r0, AbortedError)
    assert service.phase is Phase.FAILED


def test_a_ready_report_is_checked_against_its_own_shard():
    """A worker that claims another rank's digests (or the whole model's) is refused."""
    from collective._proto import collective_pb2 as pb
    from collective.digest import worker_digest

    service, endpoint, _ = inmemory_cluster(model(), [["cpu:0"]] * 2, shards="dim0")
    links = [endpoint.link(), endpoint.link()]
    refs = [pb.WorkerRef(worker_id=f"x{i}", incarnation="i") for i in range(2)]
    for i, (link, ref) in enumerate(zip(links, refs, strict=True)):
        ref.secret = link.join(pb.JoinRequest(worker_id=ref.worker_id, incarnation="i", devices=["cpu:0"],
                                              preferred_rank=i), 1).secret
    plans = [link.get_plan(ref, 1) for link, ref in zip(links, refs, strict=True)]
    assert plans[0].chunk_digests != plans[1].chunk_digests
    other = list(plans[1].chunk_digests)
    forged = pb.ReadyRequest(worker=refs[0], devices=[pb.DeviceDigests(device="cpu:0", replica=0, chunk_digests=other)],
                             worker_digest=worker_digest(plans[1].manifest_digest, [other]))
    with pytest.raises(AbortedError, match=r"worker x0 \(rank 0.*bytes 0\.\.4096 have digest .*the chief's are"):
        links[0].report_ready(forged, 1)
    assert service.phase is Phase.FAILED


def test_plans_hold_only_their_pieces_and_validate():
    arrays = model()
    service, results, sup = run(arrays, 3, "dim0", chunk_bytes=1000)
    assert sup is None, sup
    for r in results:
        validate_plan(r.plan)
        assert [p.placement for p in r.plan.shard.pieces] == ["dim0"] * 4 + ["all", "dim0"]
        assert len(r.plan.chunk_digests) == math.ceil(r.plan.total_bytes / 1000)
    bad = results[0].plan
    bad.shard.pieces[0].row_stop += 1  # rows that are not its local shape
    with pytest.raises(ProtocolError, match="'kernel'.*not its piece"):
        validate_plan(bad)


@pytest.mark.parametrize("request_, match", [
    ("rows", "unknown request 'rows'"),
    ({"nope": 0, "*": "all"}, "not variables of the model: 'nope'"),
    ({"a": 0}, "have no placement.*'b'"),
    ({"a": 3, "b": "all"}, "rank 3 is out of range: 3 training rank"),
    ({"a": "dim1", "b": "all"}, "unknown placement 'dim1'"),
    ({"a": [], "b": "all"}, "out of range"),
    (7, "int is not 'dim0' or a mapping"),
])
def test_impossible_requests_are_usage_errors(request_, match):
    with pytest.raises(UsageError, match=match):
        normalize(request_, ["a", "b"], 3)


def test_a_bad_request_fails_the_chief_before_any_worker_joins():
    with pytest.raises(UsageError, match="not variables of the model"):
        chief_service(model(), 2, shards={"kernal": 0, "*": "all"})


def test_zero_d_variables_are_whole_on_every_rank():
    from collective.model import VariableSpec

    pieces = assign([VariableSpec("s", (), "<f4"), VariableSpec("v", (3,), "<f4")], "dim0", 4)
    assert [[(p.placement, p.start, p.stop) for p in rank] for rank in pieces] == [
        [("all", 0, 0), ("dim0", 0, 1)], [("all", 0, 0), ("dim0", 1, 2)],
        [("all", 0, 0), ("dim0", 2, 3)], [("all", 0, 0), ("dim0", 3, 3)],
    ]


def test_a_sharded_worker_killed_mid_stream_rejoins_and_receives_its_own_shard():
    """The rejoin revises the round's plan; the new incarnation gets its shard's plan rebuilt
    from it and the same rows."""
    import threading

    from tests.unit.test_rejoin import ARRAYS, Cluster, Killed, join_all, run_in_threads, wait_until

    c = Cluster(3, "chain", shards="dim0")  # asked for a chain: a sharded round is a star anyway
    died = threading.Event()
    agents = [c.agent(f"w{r}", r, **({"dies_after": 2, "died": died} if r == 1 else {})) for r in range(3)]
    results, threads = run_in_threads([a.run for a in agents] + [c.service.supervise])
    assert died.wait(60), "the victim never reached its third chunk"
    died.clear()
    wait_until(lambda: not threads[1].is_alive())
    c.kill(agents[1])
    reborn = c.agent("w1", 1)
    late, late_threads = run_in_threads([reborn.run])
    join_all(threads + late_threads)
    assert isinstance(results[1], Killed) and results[-1] is None, results
    done = [results[0], late[0], results[2]]
    for rank, r in enumerate(done):
        assert not isinstance(r, BaseException), r
        assert r.plan.topology == "star" and r.plan.shard.index == rank
        for name, whole in ARRAYS.items():
            start, stop = rows(len(whole), 3, rank)
            assert r.variables.get(name).replicas[0].tobytes() == whole[start:stop].tobytes()
    assert c.service.result()["rejoined"] == ["w1"]
    assert [w.incarnation for w in late[0].plan.workers if w.rank == 1] == [reborn.incarnation]


def test_status_counts_each_workers_own_bytes():
    arrays = model()
    service, results, sup = run(arrays, 2, "dim0")
    assert sup is None, sup
    status = service.status()
    assert [w.bytes_total for w in status.workers] == [r.plan.total_bytes for r in results]
    assert [w.variables_total for w in status.workers] == [len(arrays)] * 2
    assert all(w.bytes_received == w.bytes_total for w in status.workers)


def test_a_rank_given_nothing_receives_an_empty_stream_and_is_ready():
    arrays = small_arrays()
    service, results, sup = run(arrays, 2, {"*": 0})
    assert sup is None, sup
    assert sorted(v.name for v in results[0].variables) == sorted(arrays)
    assert len(results[1].variables) == 0 and results[1].bytes_received == results[1].plan.total_bytes == 0


# --- the chief serves each shard from where it lies in the model: no copy ------------------------


def _shard_copy(specs, flat, pieces):
    """A rank's arena as the chief used to build it: each piece copied to its local offset."""
    from collective.plan import layout
    from collective.shards import local_spec

    offsets, _ = layout(specs)
    local = [local_spec(specs[p.index], p) for p in pieces]
    local_offsets, total = layout(local)
    out = np.zeros(total, np.uint8)
    for p, spec, off in zip(pieces, local, local_offsets, strict=True):
        whole = specs[p.index]
        row = whole.nbytes // whole.shape[0] if whole.shape and whole.shape[0] else 0
        src = offsets[p.index] + (p.start * row if p.placement == "dim0" else 0)
        out[off : off + spec.nbytes] = flat[src : src + spec.nbytes]
    return out


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4096, 1 << 20])
def test_a_shard_view_reads_the_models_arena_and_equals_the_copied_shard(chunk_bytes):
    from collective.chief.arena import materialize
    from collective.digest import bytes_digest, chunk_digests
    from collective.shards import ShardedArenas
    from tests.clusters import ArraySource

    specs, arena, _ = materialize(ArraySource(model()))
    sharded = ShardedArenas(specs, arena, "dim0", 4, chunk_bytes)
    for rank, view in enumerate(sharded.views):
        want = _shard_copy(specs, arena, sharded.pieces[rank])
        assert view.nbytes == want.nbytes
        assert bytes(view.slice(0, view.nbytes)) == want.tobytes()
        assert np.array_equal(view.copy(), want)
        assert sharded.chunk_digests[rank] == chunk_digests(want, chunk_bytes)
        assert [d for _, _, d in sharded.local[rank]] == [
            bytes_digest(memoryview(want[off : off + s.nbytes])) for s, off, _ in sharded.local[rank]]
        # A range inside one piece is the model's own memory, not a copy of it.
        lo, src, n = view.segments[0]
        inside = view.slice(lo + 1, lo + n)
        assert np.shares_memory(np.frombuffer(inside, np.uint8), arena)
        assert view.sources(lo + 1, lo + n) == [(src + 1, src + n)]


def test_the_chief_holds_the_model_once_with_shards():
    """Before, ShardedArenas copied every rank's part out: the chief held the model twice."""
    from collective.chief.arena import materialize
    from collective.shards import ShardedArenas
    from tests.clusters import ArraySource

    specs, arena, _ = materialize(ArraySource({"w": np.ones((4096, 256), np.float32)}))
    sharded = ShardedArenas(specs, arena, "dim0", 4, 1 << 20)
    for view in sharded.views:
        for lo, _, n in view.segments:
            assert np.shares_memory(np.frombuffer(view.slice(lo, lo + n), np.uint8), arena)


# --- groups: the ranks of one shard hold the same pieces (HSDP) ----------------------------------


def test_groups_give_the_ranks_of_one_shard_the_same_rows_over_the_shards():
    from collective.shards import Groups

    arrays = model()
    service, results, sup = run(arrays, 4, Groups("dim0", (0, 1, 0, 1)))
    assert sup is None, sup
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        shard = rank % 2
        assert (r.plan.shard.index, r.plan.shard.world) == (shard, 2)
        for name, whole in arrays.items():
            start, stop = rows(whole.shape[0], 2, shard) if whole.ndim else (0, 0)
            want = whole[start:stop] if whole.ndim else whole
            assert r.variables.get(name).replicas[0].tobytes() == want.tobytes()
        assert r.bytes_received <= model_bytes(arrays) / 2 + 64 * len(arrays) + arrays["step"].nbytes
    assert results[0].worker_digest == results[2].worker_digest != results[1].worker_digest
    # Each shard was laid out and hashed once: ranks 0 and 2 share one view of the model.
    assert service._arena.shards.views[0] is service._arena.shards.views[2]


@pytest.mark.parametrize(("shard_of", "says"), [
    ((0, 1, 0), "3 shard indices for 4 training rank"),
    ((0, 2, 0, 2), r"the shard indices \[0, 2\] are not 0..S-1"),
])
def test_groups_that_do_not_fit_the_world_are_a_usage_error(shard_of, says):
    from collective.shards import Groups

    with pytest.raises(UsageError, match=says):
        normalize(Groups("dim0", shard_of), ["a"], 4)
