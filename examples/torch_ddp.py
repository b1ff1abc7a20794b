"""PyTorch DDP whose initial values come from collective, verified, instead of DDP's broadcast.

    torchrun --nproc-per-node 3 examples/torch_ddp.py
    mpiexec -n 3 python examples/torch_ddp.py

Every rank builds the model with its own seed (as independently started processes do) on its
own device (``collective.torch.local_device()``: ``cuda:<local rank>`` on GPUs, else the CPU),
then ``collective.torch.sync_module`` makes every parameter and buffer rank 0's, in place and
verified. The script checks it itself (an all-gather of a digest of every rank's state over
gloo, or NCCL on GPUs), trains a few DDP steps with ``init_sync=False`` (DDP's own initial
broadcast skipped: the values are already rank 0's) and prints one line per rank.

``TORCH_DDP_DTYPE=bfloat16`` trains in bfloat16; ``TORCH_DDP_MISMATCH_RANK=r`` makes rank r
build a different model (every rank then fails, naming each difference).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn  # noqa: E402,F401  (before init_process_group: see the end of main)
import xxhash  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import collective  # noqa: E402
import collective.torch  # noqa: E402

STEPS = 5


def build_model(seed: int, wide: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    hidden = 24 if wide else 16
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.LayerNorm(hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    )


def state_digest(model: torch.nn.Module) -> str:
    """xxh3-128 over every state_dict tensor's name and bytes, in order."""
    h = xxhash.xxh3_128()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(collective.torch.to_numpy(t).tobytes())
    return h.hexdigest()


def init_process_group(rank: int, world_size: int, device: torch.device) -> None:
    """NCCL on GPUs, else gloo; over torchrun's store (env://), or under mpiexec a TCP rendezvous
    at rank 0's host on a port rank 0 picks and MPI broadcasts."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=60)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        return
    from mpi4py import MPI

    address = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            address = f"tcp://{socket.gethostname()}:{s.getsockname()[1]}"
    address = MPI.COMM_WORLD.bcast(address, root=0)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout)


def main() -> int:
    dtype = getattr(torch, os.environ.get("TORCH_DDP_DTYPE", "float32"))
    # This process's rank only to pick a different seed per rank; sync_module finds its role itself.
    rank_hint = int(os.environ.get("COLLECTIVE_RANK") or os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    device = collective.torch.local_device()  # cuda:<local rank> on GPUs, else mps or cpu
    model = build_model(1000 + rank_hint, wide=str(rank_hint) == os.environ.get("TORCH_DDP_MISMATCH_RANK")).to(device, dtype)
    before = state_digest(model)
    try:
        result = collective.torch.sync_module(model)
    except collective.CollectiveError as exc:
        print(f"rank {rank_hint}: error: {type(exc).__name__}: {exc}", flush=True)
        return exc.exit_code
    rank, world_size = result.rank, result.world_size

    init_process_group(rank, world_size, device)
    after = state_digest(model)
    digests: list[str | None] = [None] * world_size
    dist.all_gather_object(digests, after)
    if len(set(digests)) != 1:
        print(f"rank {rank}: error: initial values differ between ranks: {digests}", flush=True)
        return 1

    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None, init_sync=False)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    for _ in range(STEPS):
        x = torch.randn(32, 8, generator=data).to(device, dtype)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    final: list[str | None] = [None] * world_size
    dist.all_gather_object(final, state_digest(model))
    print(
        f"rank {rank}/{world_size}: own init {before[:12]} -> rank 0's {after[:12]} "
        f"(same on all {world_size} ranks: {len(set(digests)) == 1}); {STEPS} DDP steps (init_sync=False), "
        f"loss {loss.item():.4f}, final {final[rank][:12]} (same on all ranks: {len(set(final)) == 1})",
        flush=True,
    )
    # Tear down in this order, while the interpreter runs, so gloo joins its threads here. Left to
    # the exit, a gloo thread may still be releasing a tensor while the interpreter finalizes, and
    # a successful run aborts ("terminate called without an active exception", SIGABRT). DDP
    # goes first (it holds the group in a reference cycle, hence the collect): if DDP's reducer
    # dropped the group's last reference, it would join gloo's threads holding the GIL that one
    # of them waits for. torch.distributed.nn is imported at the top because, first imported
    # after init_process_group, it keeps the group in its functions' default arguments.
    del ddp, optimizer
    gc.collect()
    dist.destroy_process_group()
    return 0 if len(set(final)) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
