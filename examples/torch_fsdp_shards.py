"""FSDP2 (``fully_shard``) whose local shards come from rank 0's values, each rank receiving only its rows.

    torchrun --nproc-per-node 4 examples/torch_fsdp_shards.py

Every rank builds the model with its own seed (as independently started processes do) and
shards it with ``fully_shard`` over a 1-D CPU mesh of every rank (gloo): each parameter is a
DTensor ``Shard(0)`` whose local rows are this rank's own init. Rank 0 keeps its whole state
from before sharding; ``collective.torch.sync_module(model, mesh=mesh, values=...)`` then gives
every rank's local shards rank 0's rows, verified by digest, each rank receiving only its
part of the model (``collective.shards``). The script checks it itself: the whole state
assembled with ``DTensor.full_tensor()`` (gloo all-gathers) must equal rank 0's initial state,
and the bytes each rank received must stay within 1.05 x model / world + its plan. It trains
one step and prints one line per rank.

``TORCH_SHARDS_HIDDEN=n`` sets the width of the hidden layers (default 512).
``TORCH_SHARDS_MESH=RxS`` shards over a 2-D mesh instead (HSDP: ``R`` replica groups of ``S``
ranks, placements ``(Replicate(), Shard(0))``): each rank then receives its shard of ``S``, so
about model / S bytes, and the ranks of one replica group hold the model between them.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import collective  # noqa: E402
import collective.torch  # noqa: E402


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    hidden = int(os.environ.get("TORCH_SHARDS_HIDDEN", "512"))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),  # 10 rows over 4 ranks: 3, 3, 3, 1 (torch.chunk's uneven shards)
    )
    model.register_buffer("steps", torch.tensor(seed, dtype=torch.int64))  # 0-d: every rank holds it whole
    return model


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """xxh3-128 over every tensor's name and bytes, in order."""
    h = xxhash.xxh3_128()
    for name, t in state.items():
        h.update(name.encode())
        h.update(collective.torch.to_numpy(t).tobytes())
    return h.hexdigest()


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    shape = tuple(int(n) for n in os.environ.get("TORCH_SHARDS_MESH", str(world)).split("x"))
    mesh = (init_device_mesh("cpu", shape) if len(shape) == 1
            else init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))
    shards = shape[-1]
    model = build_model(seed=rank)
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    own = state_digest(local)
    t = collective.Timeouts(join=60, rpc=20, stall=20, ready=60, start=60, linger=2, heartbeat=1, lease=15)
    try:
        result = collective.torch.sync_module(model, mesh=mesh, values=whole, timeouts=t)
    except collective.CollectiveError as exc:
        print(f"rank {rank}: error: {exc}", flush=True)
        return 1
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    assembled = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    after, got = state_digest(local), state_digest(assembled)  # before the step below changes the shards
    want = state_digest(build_model(seed=0).state_dict())  # rank 0's initial state, rebuilt from its seed
    plan = result.plan_bytes
    bound = 1.05 * model_bytes / shards + plan
    loss = model(torch.ones(8, 64)).square().mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
    print(f"rank {rank}/{world}: own shards {own[:12]} -> {after[:12]}; whole state "
          f"{got} (rank 0's initial: {got == want}); "
          f"received {result.bytes_received} bytes (model {model_bytes}, {shards} shards, model/shards "
          f"{model_bytes / shards:.0f}, plan {plan}, within 1.05 x model/shards + plan: {result.bytes_received <= bound}); "
          f"one FSDP step (loss {loss.item():.4f})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
