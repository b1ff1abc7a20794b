"""A safetensors model served straight from its file(s): mapped read-only, hashed in one read."""

from __future__ import annotations

import json
import os
import struct
import threading

import numpy as np
import pytest

from collective._proto import collective_pb2 as pb
from collective.chief.arena import FileArena
from collective.chief.service import ChiefService, Phase
from collective.digest import bytes_digest, chunk_digests
from collective.errors import (
    AbortedError,
    DeadlineError,
    IntegrityError,
    ModelError,
    PreconditionError,
)
from collective.plan import check_completes, validate_plan
from collective.sources import load_source
from collective.sources.mapped import PAGE, DataFile, MappedFiles
from collective.worker.agent import WorkerAgent
from tests.clusters import FAST, inmemory_endpoint, run_threads
from tests.procs import wait_until
from tests.unit.test_sharded import values, write_sharded


def run_round(source, devices_per_worker, **options):
    service = ChiefService(source, len(devices_per_worker), timeouts=FAST, **{"from_file": True, **options})
    endpoint = inmemory_endpoint(service)
    agents = [WorkerAgent(endpoint.link(), worker_id=f"w{i}", devices=devs, preferred_rank=i, timeouts=FAST)
              for i, devs in enumerate(devices_per_worker)]
    *results, sup = run_threads([a.run for a in agents] + [service.supervise])
    return service, results, sup


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [None, 100, 4096])
def test_a_sharded_checkpoint_is_served_from_its_files(tmp_path, shards, chunk_bytes):
    arrays = values()
    path, _ = write_sharded(tmp_path, arrays, shards)
    service, results, sup = run_round(load_source(path), [["cpu:0"], ["cpu:0", "cpu:1"]], chunk_bytes=chunk_bytes)
    assert sup is None, sup
    assert service.phase is Phase.STARTED
    assert service._arena.file is not None and not service.arena.flags.writeable  # the mapping, not a copy
    plan = service.state.plan
    assert plan.chunk_digests == chunk_digests(service.arena, plan.chunk_bytes)
    for v in plan.variables:
        assert bytes_digest(arrays[v.name].tobytes()) == v.digest
        assert v.offset % arrays[v.name].dtype.itemsize == 0
    for r in results:
        assert not isinstance(r, BaseException), r
        for name, value in arrays.items():
            for replica in r.variables.get(name).replicas:
                assert replica.dtype == value.dtype and replica.tobytes() == value.tobytes()


def test_the_copy_path_gives_the_same_values(tmp_path):
    arrays = values()
    path, _ = write_sharded(tmp_path, arrays, 2)
    service, results, sup = run_round(load_source(path), [["cpu:0"]], from_file=False)
    assert sup is None, sup
    assert service._arena.file is None and service.arena.flags.writeable
    for name, value in arrays.items():
        assert results[0].variables.get(name).replicas[0].tobytes() == value.tobytes()


def test_the_file_order_and_offsets_are_the_plans(tmp_path):
    arrays = values()
    path, _ = write_sharded(tmp_path, arrays, 1)
    source = load_source(path)
    service = ChiefService(source, 1, timeouts=FAST, from_file=True)
    files, tensors = source.data_files()
    assert [s.name for s, _, _ in tensors] == [s.name for s in service.specs]
    (start,) = MappedFiles(files).starts
    assert start == files[0].data_start  # one file: the arena is the file from its first page
    assert [start + offset - files[0].data_start for _, _, offset in tensors] == service._arena.file.offsets


def write_by_hand(path, tensors: list[tuple[str, str, list[int], bytes]]) -> None:
    """A safetensors file with tensors in this order, back to back, after an unpadded header."""
    header, pos = {}, 0
    for name, code, shape, data in tensors:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(t[3] for t in tensors))


def test_a_tensor_not_aligned_in_its_file_is_copied_into_memory(tmp_path, caplog):
    path = tmp_path / "odd.safetensors"
    write_by_hand(path, [("b", "U8", [3], b"abc"), ("w", "F32", [2], np.arange(2, dtype="<f4").tobytes())])
    caplog.set_level("INFO")
    service, results, sup = run_round(load_source(path), [["cpu:0"]])
    assert sup is None, sup
    assert service._arena.file is None
    assert "is at byte" in caplog.text and "copied into memory" in caplog.text
    assert results[0].variables.get("w").replicas[0].tolist() == [0.0, 1.0]


def test_mapped_files_lie_end_to_end_each_from_its_page(tmp_path):
    contents = [os.urandom(n) for n in (10, PAGE * 2 + 5, 0, 7)]
    files = []
    for i, data in enumerate(contents):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"h" * (100 + i) + data)
        files.append(DataFile(p, f"f{i}", 100 + i))
    mapped = MappedFiles(files)
    for data, start in zip(contents, mapped.starts, strict=True):
        assert mapped.array[start : start + len(data)].tobytes() == data
    assert mapped.nbytes == mapped.starts[-1] + len(contents[-1])
    assert starts_increase(mapped.starts)
    mapped.drop(0, mapped.nbytes)  # the pages come back from the file on the next read
    assert mapped.array[mapped.starts[1] : mapped.starts[1] + len(contents[1])].tobytes() == contents[1]
    with pytest.raises(ValueError):
        mapped.array[0] = 1


def starts_increase(starts):
    return all(a < b for a, b in zip(starts, starts[1:], strict=False))


def test_a_file_changed_after_it_was_hashed_fails_the_round_naming_it(tmp_path):
    arrays = values()
    path, _ = write_sharded(tmp_path, arrays, 2)
    source = load_source(path)
    service = ChiefService(source, 1, timeouts=FAST, from_file=True)
    wait_until(lambda: service.digests is not None, "the files hashed")
    shard = tmp_path / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # whatever the clock's grain
    endpoint = inmemory_endpoint(service)
    agent = WorkerAgent(endpoint.link(), worker_id="w0", devices=["cpu:0"], timeouts=FAST)
    result, sup = run_threads([agent.run, service.supervise])
    assert isinstance(sup, ModelError), sup
    assert "model-00002-of-00002.safetensors: changed while being served" in str(sup)
    assert isinstance(result, AbortedError) and "changed while being served" in str(result)


def test_a_file_cut_short_is_named_not_read(tmp_path):
    arrays = values()
    path, _ = write_sharded(tmp_path, arrays, 1)
    service = ChiefService(load_source(path), 1, timeouts=FAST, from_file=True)
    wait_until(lambda: service.digests is not None, "the files hashed")  # no read races the cut
    shard = tmp_path / "model-00001-of-00001.safetensors"
    os.truncate(shard, shard.stat().st_size - 8)
    with pytest.raises(ModelError, match=r"model-00001-of-00001\.safetensors: changed while being served \(cut from"):
        service._arena.file.files.check()


@pytest.mark.parametrize("count", [1, 3])
def test_same_host_members_map_the_files_themselves_copy_on_write(tmp_path, count):
    from collective.transport.shm import ShmServer, attach

    files = []
    for i in range(count):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(PAGE + 50 * i + 9))
        files.append(DataFile(p, f"f{i}", 40 + i))
    before = [f.path.read_bytes() for f in files]
    mapped = MappedFiles(files)
    server = ShmServer(mapped, lambda worker_id, incarnation: None)
    try:
        arena = attach(server.name, server.secret, "w0", "inc", mapped.nbytes, files=True)  # as from the chief
        assert arena is not None and arena.tobytes() == mapped.array.tobytes()
        arena[mapped.starts[-1]] ^= 0xFF  # the member's writes stay its own
        assert arena[mapped.starts[-1]] != mapped.array[mapped.starts[-1]]
        assert [f.path.read_bytes() for f in files] == before
        assert attach(server.name, server.secret, "w0", "inc", mapped.nbytes + PAGE, files=True) is None  # not the plan's arena
    finally:
        server.close()


def test_a_round_from_files_through_shared_memory(tmp_path):
    arrays = values()
    path, _ = write_sharded(tmp_path, arrays, 3)
    service, results, sup = run_round(load_source(path), [["cpu:0"], ["cpu:0", "cpu:1"]], shm=True)
    assert sup is None, sup
    assert service._arena.server is not None and service._arena.shared is None  # the files are offered, no memfd
    for r in results:
        assert not isinstance(r, BaseException), r
        for name, value in arrays.items():
            for replica in r.variables.get(name).replicas:
                assert replica.tobytes() == value.tobytes()


def test_the_plan_goes_out_while_the_files_are_read_and_its_digests_follow(tmp_path, monkeypatch):
    path, _ = write_sharded(tmp_path, values(), 2)
    release, real = threading.Event(), FileArena.hash
    monkeypatch.setattr(FileArena, "hash", lambda self: (release.wait(30), real(self)))
    service = ChiefService(load_source(path), 1, timeouts=FAST, from_file=True)
    ref = pb.WorkerRef(worker_id="w0", incarnation="i0")
    ref.secret = service.join(pb.JoinRequest(worker_id="w0", incarnation="i0", devices=["cpu:0"]), "test").secret
    # Released at once, without digests: the stream need not wait for the files to be read.
    assert service.phase is Phase.BROADCASTING
    provisional = service.get_plan(ref, 30)
    validate_plan(provisional)
    assert provisional.digests_follow and not provisional.chunk_digests and not provisional.manifest_digest
    assert not any(v.digest for v in provisional.variables if v.nbytes)
    assert service.supervisor.waiting_for().startswith("the model's files to be read and hashed (the chief)")
    # Each chunk's trailer is the digest of its bytes, so a receiver checks every one as it lands.
    chunks = list(service.fetch(ref))
    assert all(c.digest == bytes_digest(c.data) for c in chunks if c.data)
    with pytest.raises(DeadlineError, match="had not read the model's files within 0.2 s"):
        service.get_plan(pb.WorkerRef(worker_id="w0", incarnation="i0", secret=ref.secret, want_digests=True), 0.2)
    with pytest.raises(PreconditionError, match="before the plan was complete"):
        service.report_ready(pb.ReadyRequest(worker=ref))
    release.set()
    plan = service.get_plan(pb.WorkerRef(worker_id="w0", incarnation="i0", secret=ref.secret, want_digests=True), 30)
    check_completes(provisional, plan)
    assert not plan.digests_follow
    assert plan.chunk_digests == chunk_digests(service.arena, plan.chunk_bytes)
    assert [v.digest for v in plan.variables] == service.digests
    assert [c.digest for c in chunks if c.data] == list(plan.chunk_digests)


def test_a_check_of_a_range_looks_at_the_files_with_bytes_in_it(tmp_path):
    files = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(3 * PAGE + 7))
        files.append(DataFile(p, f"f{i}", 10))
    mapped = MappedFiles(files)
    os.utime(files[1].path, ns=(1, 1))
    second = mapped.places[1][0]
    mapped.check(0, second)  # the first file and the padding after it
    mapped.check(mapped.places[2][0], mapped.nbytes)
    for start, end in [(0, None), (second, second + 1), (second - 5, second + 1)]:
        with pytest.raises(ModelError, match="f1: changed while being served"):
            mapped.check(start, end)


def test_max_model_bytes_holds_and_the_files_need_no_memory_of_the_chief(tmp_path, monkeypatch):
    path, _ = write_sharded(tmp_path, values(), 2)
    with pytest.raises(ModelError, match="more than --max-model-bytes"):
        ChiefService(load_source(path), 1, timeouts=FAST, from_file=True, max_model_bytes=100)
    monkeypatch.setattr("collective.model.available_memory", lambda: 100)
    with pytest.raises(ModelError, match="memory available"):
        ChiefService(load_source(path), 1, timeouts=FAST, from_file=False)
    service = ChiefService(load_source(path), 1, timeouts=FAST, from_file=True)
    assert service._arena.file is not None
    service._hasher.join(30)  # its log line lands inside this test, not after it
    service.close()


def test_a_file_changed_once_hashed_before_the_digests_go_out_fails_the_round_naming_it(tmp_path, monkeypatch):
    path, _ = write_sharded(tmp_path, values(), 2)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    release, real = threading.Event(), FileArena.hash

    def hash_then_touch(self):
        release.wait(30)
        real(self)
        os.utime(shard, ns=(1, 1))  # after its digests were taken, before the complete plan

    monkeypatch.setattr(FileArena, "hash", hash_then_touch)
    service = ChiefService(load_source(path), 1, timeouts=FAST, from_file=True)
    secret = service.join(pb.JoinRequest(worker_id="w0", incarnation="i0", devices=["cpu:0"]), "test").secret
    release.set()
    with pytest.raises(AbortedError, match="model-00001-of-00002.safetensors: changed while being served"):
        service.get_plan(pb.WorkerRef(worker_id="w0", incarnation="i0", secret=secret, want_digests=True), 30)
    assert service.phase is Phase.FAILED and isinstance(service.error, ModelError)


def test_the_chiefs_peak_rss_is_its_own_not_that_of_the_process_that_started_it():
    """getrusage's ru_maxrss starts a child at its parent's peak (Linux keeps it across fork
    and exec): a chief started by a big process would report the parent's memory."""
    import subprocess
    import sys

    ballast = np.ones(400 << 20, np.uint8)  # this process: 400 MiB resident
    code = ("import resource; from collective.chief.reports import peak_rss_bytes; "
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    own, inherited = map(int, out.stdout.split())
    del ballast
    assert inherited >= 400 << 20  # what the summary used to report
    assert own < 200 << 20, own    # a Python with numpy and gRPC: well under the ballast


@pytest.mark.parametrize("chunk_bytes", [None, 64])
def test_shards_are_served_from_the_files_without_a_copy(tmp_path, chunk_bytes):
    from collective.shards import rows

    arrays = values()
    path, _ = write_sharded(tmp_path, arrays, 2)
    service, results, sup = run_round(load_source(path), [["cpu:0"], ["cpu:0", "cpu:1"], ["cpu:0"]],
                                      shards="dim0", chunk_bytes=chunk_bytes)
    assert sup is None, sup
    assert service._arena.file is not None
    for view in service._arena.shards.views:  # each rank's pieces are the mapped files' own bytes
        for lo, _, n in view.segments:
            assert np.shares_memory(np.frombuffer(view.slice(lo, lo + n), np.uint8), service.arena)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert r.plan.shard.index == rank and r.plan.shard.world == 3
        for name, whole in arrays.items():
            start, stop = rows(whole.shape[0], 3, rank)
            for replica in r.variables.get(name).replicas:
                assert replica.tobytes() == whole[start:stop].tobytes()


def test_bytes_the_chief_sent_that_differ_from_what_it_read_blame_the_chief(tmp_path, monkeypatch):
    """The digests follow the stream: the worker checked every chunk against its trailer, then
    the chief's digests differ (it read other bytes than it sent). The culprit is the chief."""
    path, _ = write_sharded(tmp_path, values(), 2)
    asked, real_hash, real_get = threading.Event(), FileArena.hash, ChiefService.get_plan

    def hash_after_the_stream(self):
        asked.wait(30)  # the worker holds every byte and asks for the digests
        real_hash(self)
        for digests in self.chunk_digests.values():
            digests[0] = "0" * 32  # what it "read" differs from what it sent

    def get_plan(self, ref, timeout):
        if ref.want_digests:
            asked.set()
        return real_get(self, ref, timeout)

    monkeypatch.setattr(FileArena, "hash", hash_after_the_stream)
    monkeypatch.setattr(ChiefService, "get_plan", get_plan)
    service, results, sup = run_round(load_source(path), [["cpu:0"]])
    assert isinstance(results[0], IntegrityError), results
    assert "the chief's own stream carried these bytes" in str(results[0]) and results[0].culprit == "chief"
    assert service.phase is Phase.FAILED and service.error.culprit == "chief"
