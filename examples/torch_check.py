"""Train with DDP and check every N steps that all ranks still hold the same parameters.

    torchrun --nproc-per-node 4 examples/torch_check.py --steps 20 --check-every 5
    mpiexec -n 4 python examples/torch_check.py --check-over mpi

Every rank starts from rank 0's values (``collective.torch.sync_module``), trains ``--steps`` DDP
steps over gloo (NCCL on GPUs) and, every ``--check-every`` steps, calls
``collective.torch.check_module(model, step=step)``: one 16-byte digest per rank is
all-gathered (over torch.distributed; with ``--check-over mpi`` over mpi4py's COMM_WORLD) and
each rank prints ``rank R/W: step S: check passed, digest D``. ``--perturb-rank r`` makes rank r
add one ulp to one element of ``--perturb-tensor`` just before the check at ``--perturb-step``:
every rank then raises ``DivergenceError`` naming rank r and that tensor, prints
``rank R: error: ...`` and exits 1.

``--model-bytes 1GiB --steps 0 --repeat 5`` is the benchmark of BENCHMARKS.md ("Checks after
start"): a model of float32 tensors of 16 MiB (identical on every rank, no training) checked
``--repeat`` times; rank 0 prints the median and the range of the seconds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn  # noqa: E402,F401  (before init_process_group: see torch_ddp.py's end)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

# This script's folder is on sys.path: torch_ddp.py's process group (gloo, or NCCL on GPUs; its
# 60 s timeout bounds every check over torch.distributed too).
from torch_ddp import init_process_group  # noqa: E402

import collective  # noqa: E402
import collective.torch  # noqa: E402
from collective.errors import UsageError  # noqa: E402
from collective.sizes import parse_size  # noqa: E402

TENSOR_BYTES = 16 << 20  # the benchmark's tensors: 16 MiB of float32 each


def model_bytes(text: str) -> int:
    try:
        return parse_size(text, option="--model-bytes")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="DDP steps to train (default 20)")
    p.add_argument("--check-every", type=int, default=5, help="check after every N steps (default 5)")
    p.add_argument("--check-over", choices=("default", "mpi"), default="default",
                   help="the exchange: torch.distributed (default) or mpi4py's COMM_WORLD")
    p.add_argument("--perturb-rank", type=int, default=None, help="this rank adds one ulp to one value")
    p.add_argument("--perturb-step", type=int, default=None, help="... just before this step's check "
                   "(default: the first check)")
    p.add_argument("--perturb-tensor", default="0.weight", help="... of this state_dict tensor (default 0.weight)")
    p.add_argument("--model-bytes", type=model_bytes, default=None,
                   help="benchmark: a model of this many bytes in 16 MiB float32 tensors (e.g. 1GiB)")
    p.add_argument("--repeat", type=int, default=5, help="benchmark: checks to time (default 5)")
    args = p.parse_args(argv)
    if args.check_every < 1 or args.steps < 0 or args.repeat < 1:
        p.error("--check-every and --repeat must be at least 1, --steps at least 0")
    if args.perturb_step is None:
        args.perturb_step = args.check_every
    if args.perturb_rank is not None and args.perturb_step % args.check_every:
        p.error(f"--perturb-step {args.perturb_step} is not a step with a check (every {args.check_every})")
    return args


def build_model(seed: int, model_bytes: int | None) -> torch.nn.Module:
    torch.manual_seed(seed)
    if model_bytes is None:
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 1))
    side = int((TENSOR_BYTES // 4) ** 0.5)  # 2048 x 2048 float32
    layers = [torch.nn.Linear(side, side, bias=False, device="meta") for _ in range(-(-model_bytes // TENSOR_BYTES))]
    model = torch.nn.Sequential(*layers).to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):  # cheap distinct values, the same on every rank
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p)).mul_(1e-6).add_(i)
    return model


def one_ulp(model: torch.nn.Module, name: str) -> None:
    """Add one ulp to the first element of the state_dict tensor ``name``, in place."""
    tensors = model.state_dict()
    if name not in tensors:
        raise SystemExit(f"--perturb-tensor {name!r} is not a tensor of the model: {', '.join(tensors)}")
    with torch.no_grad():
        flat = tensors[name].view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))


def train_and_check(args: argparse.Namespace, model: torch.nn.Module, rank: int, world: int, group) -> None:
    device = next(model.parameters()).device
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None, init_sync=False)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    try:
        for step in range(1, args.steps + 1):
            x = torch.randn(32, 8, generator=data).to(device)
            loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.check_every:
                continue
            if rank == args.perturb_rank and step == args.perturb_step:
                one_ulp(model, args.perturb_tensor)
            digest = collective.torch.check_module(model, step=step, group=group)
            print(f"rank {rank}/{world}: step {step}: check passed, digest {digest}, loss {loss.item():.4f}",
                  flush=True)
    finally:
        del ddp, optimizer
        gc.collect()


def bench(args: argparse.Namespace, model: torch.nn.Module, rank: int, world: int, group) -> None:
    collective.torch.check_module(model, group=group)  # warm-up: pages touched, connections made
    seconds = []
    for step in range(args.repeat):
        if group is None:
            dist.barrier()
        else:
            group.Barrier()
        start = time.perf_counter()
        collective.torch.check_module(model, step=step, group=group)
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        print(f"rank 0/{world}: checked {size / 2**30:.2f} GiB in {len(model.state_dict())} tensors on {world} "
              f"rank(s): median {statistics.median(seconds):.3f} s, min {min(seconds):.3f} s, "
              f"max {max(seconds):.3f} s over {args.repeat}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank_hint = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    device = collective.torch.local_device()
    model = build_model(1000 + rank_hint, args.model_bytes).to(device)
    try:
        if args.model_bytes is None:  # the benchmark's model is already the same everywhere
            collective.torch.sync_module(model)
    except collective.CollectiveError as exc:
        print(f"rank {rank_hint}: error: {exc}", flush=True)
        return exc.exit_code
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    init_process_group(rank_hint, world, device)
    group = None
    if args.check_over == "mpi":
        from mpi4py import MPI

        group = MPI.COMM_WORLD
    code = 0
    try:
        if args.model_bytes is None:
            train_and_check(args, model, rank_hint, world, group)
        else:
            bench(args, model, rank_hint, world, group)
    except collective.CollectiveError as exc:
        print(f"rank {rank_hint}: error: {exc}", flush=True)
        code = exc.exit_code
        dist.barrier()  # every rank has said why before any exits (torchrun stops the rest at the first)
    dist.destroy_process_group()  # gloo's threads joined while the interpreter runs (torch_ddp.py)
    return code


if __name__ == "__main__":
    sys.exit(main())
