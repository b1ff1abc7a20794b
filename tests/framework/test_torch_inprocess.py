"""collective.torch in one process: conversions, in-place loading, sync_module alone."""

from __future__ import annotations

import numpy as np
import pytest

from tests.framework.conftest import require

torch = require("torch")

from collective.digest import array_digest  # noqa: E402
from collective.errors import IntegrityError, UsageError  # noqa: E402
from collective.torch import (  # noqa: E402
    from_numpy,
    load_arrays,
    local_device,
    module_device,
    state_arrays,
    sync_module,
    to_numpy,
)


def net(seed: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    return m.to(dtype)


def bits(t: torch.Tensor) -> bytes:
    return to_numpy(t).tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_to_numpy_and_back_keep_bits(dtype):
    t = torch.randn(5, 3).to(dtype)
    a = to_numpy(t)
    assert a.tobytes() == t.view(torch.uint8).numpy().tobytes()
    back = from_numpy(a)
    assert back.dtype == dtype and back.data_ptr() == a.ctypes.data  # shares memory


def test_state_arrays_names_params_and_buffers_in_state_dict_order():
    m = net(0)
    arrays = state_arrays(m)
    assert list(arrays) == list(m.state_dict())
    assert "1.running_mean" in arrays and "1.num_batches_tracked" in arrays


def test_load_arrays_zero_copy_keeps_the_parameter_objects():
    a, b = net(1, torch.bfloat16), net(2, torch.bfloat16)
    params = list(a.parameters())
    optimizer = torch.optim.SGD(a.parameters(), lr=0.1)
    source = {k: v.copy() for k, v in state_arrays(b).items()}
    shared = load_arrays(a, source)
    assert shared == len(source)
    assert list(a.parameters()) == params and optimizer.param_groups[0]["params"][0] is params[0]
    for name, t in a.state_dict().items():
        assert bits(t) == source[name].tobytes()
        assert t.data_ptr() == source[name].ctypes.data  # the tensor lives in the replica
    assert params[0].requires_grad


def test_the_copy_path_reads_back_and_checks_what_it_wrote(monkeypatch):
    a, b = net(1), net(2)
    source = state_arrays(b)
    assert load_arrays(a, source, zero_copy=False) == 0
    assert all(bits(t) == source[n].tobytes() for n, t in a.state_dict().items())
    # A device that garbles the copy is caught by the read-back.
    import collective.torch as ct

    real = ct.to_numpy
    monkeypatch.setattr(ct, "to_numpy", lambda t: real(t) + 1 if t.dtype == torch.float32 else real(t))
    with pytest.raises(IntegrityError, match=r"0.weight: the copy on cpu differs"):
        load_arrays(a, state_arrays(net(3)), zero_copy=False)


def test_load_arrays_refuses_other_shapes_and_missing_names():
    a = net(0)
    arrays = state_arrays(a)
    with pytest.raises(UsageError, match="no value for 1 tensor"):
        load_arrays(a, {k: v for k, v in arrays.items() if k != "2.bias"})
    arrays["2.bias"] = np.zeros(3, np.float32)
    with pytest.raises(UsageError, match=r"2.bias: the value is \(3,\)"):
        load_arrays(a, arrays)


def test_sync_module_alone_is_verified_and_in_place(monkeypatch):
    for var in ("COLLECTIVE_WORLD_SIZE", "COLLECTIVE_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    m = net(5, torch.bfloat16)
    before = {k: bits(v) for k, v in m.state_dict().items()}
    result = sync_module(m, rank=0, world_size=1)
    assert result.devices == ["cpu:0"] and module_device(m) == "cpu:0"
    assert {k: bits(v) for k, v in m.state_dict().items()} == before
    assert {k: array_digest(a) for k, a in result.arrays(0).items()} == {k: array_digest(to_numpy(v)) for k, v in m.state_dict().items()}


def test_local_device_is_the_local_ranks_gpu_else_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device({"LOCAL_RANK": "1"}) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_device({"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert local_device({}) == torch.device("cuda", 0)
    with pytest.raises(UsageError, match="local rank 2 has no CUDA device: this host shows 2"):
        local_device({"OMPI_COMM_WORLD_LOCAL_RANK": "2"})


# --- sharded modules (DTensors), alone: a gloo group of one process -------------------------------


@pytest.fixture
def mesh():
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded(seed: int, mesh, placement) -> torch.nn.Module:
    from torch.distributed.tensor import Replicate, distribute_tensor

    m = net(seed)
    for layer in (m[0], m[2]):
        for name, p in list(layer.named_parameters()):
            place = placement if p.dim() > placement.dim else Replicate()  # Shard(1) of a bias: none
            setattr(layer, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [place])))
    return m


def test_sync_module_alone_writes_whole_values_into_a_sharded_modules_local_tensors(mesh):
    from torch.distributed.tensor import Shard

    m, values = sharded(1, mesh, Shard(0)), state_arrays(net(2))
    result = sync_module(m, mesh=mesh, values=values, rank=0, world_size=1)
    assert result.world_size == 1
    for name, t in m.state_dict().items():
        local = t.to_local() if hasattr(t, "to_local") else t
        assert bits(local) == values[name].tobytes(), name


def test_sync_module_refuses_what_a_shard_plan_cannot_carry(mesh):
    from torch.distributed.tensor import Shard

    with pytest.raises(UsageError, match=r"0.weight: placements \(Shard\(dim=1\),\) cannot be synced; use Shard\(0\)"):
        sync_module(sharded(1, mesh, Shard(1)), mesh=mesh, values=state_arrays(net(2)), rank=0, world_size=1)
    wrong = dict(state_arrays(net(2)), **{"0.bias": np.zeros(5, np.float32)})
    with pytest.raises(UsageError, match=r"values= differ from the module's state .*0.bias"):
        sync_module(sharded(1, mesh, Shard(0)), mesh=mesh, values=wrong, rank=0, world_size=1)
    with pytest.raises(UsageError, match="a declared state has no values: rank 0 passes values="):
        sync_module(sharded(1, mesh, Shard(0)), mesh=mesh, rank=0, world_size=1)
    with pytest.raises(UsageError, match="values= is for sharded modules"):
        sync_module(net(1), values=state_arrays(net(2)), rank=0, world_size=1)
