"""A plan larger than one gRPC message (long names, many variables) still reaches every worker."""

from __future__ import annotations

import json
import re

import pytest

from collective.transport.grpc import MAX_MESSAGE

VARIABLES = 20_000
NAME_CHARS = 1_000  # 20,000 names of 1,000 characters: a plan of about 20.5 MiB


def _long_names_spec(path, count: int, chars: int):
    variables = [
        {"name": f"layer_{i:05d}/" + "w" * (chars - 12), "shape": [2], "dtype": "float32", "initializer": "ones"}
        for i in range(count)
    ]
    path.write_text(json.dumps({"seed": 0, "variables": variables}))
    return path


@pytest.mark.timeout(300)
def test_a_plan_larger_than_the_grpc_message_limit_reaches_two_workers(tmp_path, cluster):
    model = _long_names_spec(tmp_path / "long-names.json", VARIABLES, NAME_CHARS)
    chief = cluster.chief("--workers", "2", "--model", str(model), "--join-timeout", "120", "--no-shm")
    workers = [cluster.worker(f"w{i}", "--join-timeout", "120") for i in range(2)]
    for w in workers:
        assert w.wait(240) == 0, w.output()[-3000:]
    assert chief.wait(60) == 0, chief.output()[-3000:]
    released = re.search(r"plan released \(.*?plan of (\d+) bytes", chief.output())
    assert released, chief.output()[-3000:]
    assert int(released.group(1)) > MAX_MESSAGE  # the case under test: more than one message holds
    for w in workers:
        assert f"{VARIABLES} variables" in w.output()


@pytest.mark.timeout(300)
def test_a_ready_report_larger_than_the_grpc_message_limit_reaches_the_chief(tmp_path, cluster):
    """Six devices' chunk digests of a model cut into 131,072 chunks: a 27 MB ready report (the
    same count as a 64 GiB model in a chain's 512 KiB chunks)."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"variables": [
        {"name": "w", "shape": [2 << 20], "dtype": "float32", "initializer": "uniform"}]}))
    chief = cluster.chief("--workers", "1", "--model", str(model), "--chunk-bytes", "64", "--join-timeout", "120")
    devices = ",".join(f"cpu:{i}" for i in range(6))
    worker = cluster.worker("w0", "--devices", devices, "--join-timeout", "120")
    assert worker.wait(240) == 0, worker.output()[-3000:]
    assert chief.wait(60) == 0, chief.output()[-3000:]
    assert "131072 chunk(s) per worker" in chief.output()  # 2^23 bytes in 64-byte chunks (the end message is no chunk)
    report = re.search(r"worker w0 .* is ready with digest .*; report of (\d+) bytes\)", chief.output())
    assert report, chief.output()[-3000:]
    assert int(report.group(1)) > MAX_MESSAGE  # the case under test: more than one message holds


def test_a_declaration_too_large_for_one_message_is_refused_by_the_worker_in_its_own_words():
    """A join request has no pieces: past the limit the worker says so instead of gRPC's 'Sent
    message larger than max', which names the chief's address as if the chief were at fault."""
    from collective._proto import collective_pb2 as pb
    from collective.errors import UsageError
    from collective.transport.grpc import GrpcChiefLink

    declared = [pb.VariableInfo(name=f"layer_{i:05d}/" + "w" * 988, shape=[2], dtype="<f4") for i in range(VARIABLES)]
    link = GrpcChiefLink("127.0.0.1:9")  # nothing is dialled: the request is refused before
    try:
        with pytest.raises(UsageError, match=r"join request is \d+ bytes \(20000 declared variables\), more than the "
                                             r"17825792-byte message limit; join without --expect-model"):
            link.join(pb.JoinRequest(worker_id="w", incarnation="i", devices=["cpu:0"], declared=declared), 5)
    finally:
        link.close()
