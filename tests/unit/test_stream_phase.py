"""The chief's view of a worker's phase when the data stream's sender resumes late."""

from __future__ import annotations

import numpy as np

from collective._proto import collective_pb2 as pb
from collective.digest import worker_digest
from tests.clusters import inmemory_cluster


def _ready(ref: pb.WorkerRef, plan: pb.Plan) -> pb.ReadyRequest:
    digests = list(plan.chunk_digests)
    return pb.ReadyRequest(
        worker=ref, devices=[pb.DeviceDigests(device="cpu:0", replica=0, chunk_digests=digests)],
        worker_digest=worker_digest(plan.manifest_digest, [digests]),
    )


def test_a_ready_report_that_beats_the_senders_last_resume_still_counts_and_start_is_released():
    # A raw socket sender resumes its stream generator only after the kernel took the last
    # frame; by then the worker may have verified and reported ready. That late resume must not
    # turn the worker back into "verifying", or the chief waits for it until the ready deadline.
    arrays = {"a": np.arange(4096, dtype=np.float32), "b": np.ones(100, np.float32)}
    service, endpoint, _ = inmemory_cluster(arrays, [["cpu:0"], ["cpu:0"]])
    links = [endpoint.link(), endpoint.link()]
    refs = [pb.WorkerRef(worker_id=f"w{i}", incarnation="i1") for i in range(2)]
    for link, ref in zip(links, refs, strict=True):
        ref.secret = link.join(pb.JoinRequest(worker_id=ref.worker_id, incarnation="i1", devices=["cpu:0"],
                                              preferred_rank=-1), 1).secret
    plan = links[0].get_plan(refs[0], 5)
    links[1].get_plan(refs[1], 5)

    slow = service.stream_views([refs[0]])
    frames = -(-plan.total_bytes // plan.chunk_bytes) + 1
    for _ in range(frames):  # every message out, the generator suspended after the last one
        next(slow)
    links[0].report_ready(_ready(refs[0], plan), 5)
    assert list(slow) == []  # the sender resumes only now

    list(links[1].fetch(refs[1], 5))
    links[1].report_ready(_ready(refs[1], plan), 5)
    assert links[0].await_start(refs[0], 2).ListFields() is not None  # released, not a deadline
    assert {w.phase for w in service.status().workers} <= {"ready", "started"}
