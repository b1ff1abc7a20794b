"""Shared test helpers: small model sources and a whole in-memory cluster."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from collective._api import ArraysSource
from collective.config import Timeouts

# The chief-side fill path over given arrays, without files: the Python API's own source.
ArraySource = ArraysSource


FAST = Timeouts(join=5.0, straggler_log=1.0, rpc=5.0, stall=5.0, ready=10.0, start=10.0, linger=2.0)


def small_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((33, 17)).astype(np.float32),
        "dense/bias": np.zeros(17, np.float32),
        "embedding": rng.standard_normal((1000, 64)).astype(np.float16),
        "big_endian": np.arange(10, dtype=">i8"),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 3), np.float32),
        "global_step": np.array(0, np.int64),
    }


def inmemory_cluster(arrays, devices_per_worker, timeouts=FAST, chunk_bytes=4096):
    """A chief over ``arrays``, its in-memory endpoint, and one agent per device list."""
    from collective.chief.service import ChiefService
    from collective.transport.inmemory import InMemoryEndpoint
    from collective.worker.agent import WorkerAgent

    service = ChiefService(ArraySource(arrays), len(devices_per_worker), timeouts=timeouts, chunk_bytes=chunk_bytes)
    endpoint = InMemoryEndpoint()
    endpoint.start(service)
    agents = [
        WorkerAgent(endpoint.link(), worker_id=f"w{i}", devices=devs, preferred_rank=i, timeouts=timeouts)
        for i, devs in enumerate(devices_per_worker)
    ]
    return service, endpoint, agents


def run_threads(targets: Sequence, timeout: float = 30.0) -> list:
    """Run callables in threads; return their results or exceptions, in order."""
    results: list = [None] * len(targets)

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError(f"thread did not finish within {timeout} s")
    return results


@pytest.fixture
def fast_timeouts() -> Timeouts:
    return FAST


@pytest.fixture
def cluster(tmp_path):
    """Chief and worker processes started by hand; whatever still runs is killed by pid."""
    from tests.procs import Cluster

    c = Cluster(tmp_path)
    yield c
    c.close()
