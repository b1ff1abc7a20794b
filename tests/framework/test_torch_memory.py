"""What rank 0 keeps after ``collective.torch.sync_module``: its module's tensors, nothing of the
round. Two ranks in threads of one process over real loopback gRPC.

The figures (RSS before, at the peak, held, dropped) are in BENCHMARKS.md ("Memory after the
hand-off"), measured by ``python -m collective.bench.spmd_memory``; this test holds the cause: the
chief's service, its arena and the values it served are gone when the call returns, without any
collection by the caller.
"""

from __future__ import annotations

import gc
import socket
import weakref

import pytest

from tests.framework.conftest import require

torch = require("torch")

import collective  # noqa: E402
from collective.chief.service import ChiefService  # noqa: E402
from collective.torch import sync_module, to_numpy  # noqa: E402
from tests.clusters import run_threads  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_0_keeps_nothing_of_the_round_once_sync_module_returns(monkeypatch):
    services: list[weakref.ref] = []
    made = ChiefService.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        services.append(weakref.ref(self))

    monkeypatch.setattr(ChiefService, "__init__", init)
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)) for _ in range(2)]
    rank_0s = {k: to_numpy(v).tobytes() for k, v in models[0].state_dict().items()}
    t = collective.Timeouts(join=30, rpc=10, stall=10, ready=30, start=30, linger=2, heartbeat=1, lease=10)
    chief = f"127.0.0.1:{free_port()}"
    # The service's objects hold each other: with automatic collection off, only the call's own
    # release (a collection of the young generations, then malloc_trim) can free them.
    gc.disable()
    try:
        results = run_threads([
            (lambda r=r: sync_module(models[r], rank=r, world_size=2, chief=chief, timeouts=t, shm=False))
            for r in range(2)
        ], timeout=60)
        for r in results:
            assert not isinstance(r, BaseException), r
        assert len(services) == 1
        assert services[0]() is None, "the chief's service (its arena, the values it served) outlived the call"
    finally:
        gc.enable()
    assert {k: to_numpy(v).tobytes() for k, v in models[1].state_dict().items()} == rank_0s
