"""One training process of a Slurm job: rank 0's initial values on every rank, then torch.

    srun -n 4 python examples/slurm/train.py            # inside an allocation, or alone
    sbatch examples/slurm/job.sbatch                     # the same, as a batch job

No MPI and no settings: ``collective.sync`` takes this process's rank, the number of tasks and
the chief's address from srun's variables (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_STEP_NODELIST``; ``SLURM_LOCALID`` picks the local device). Task 0 is the chief and
trains too; every other task is a worker. The chief listens on the first node of the step, at
port ``COLLECTIVE_PORT`` if set, else ``MASTER_PORT + 1``, else ``20000 + SLURM_JOB_ID % 10000``.

Every task builds its own model with its own seed (as independently started processes do),
then ``collective.torch.sync_module`` makes every parameter and buffer task 0's, in place and
verified. The script checks that the module's tensors now hold exactly the verified values,
takes a few SGD steps and prints one line::

    result rank=1 world=4 node=n1 local=1 digest=<collective digest> state=<torch state digest> ...

``digest`` and ``state`` are the same on every rank. Rank 0 also prints the round's summary
(``round ok=True workers=3 ...``). On a failed round every rank prints ``error rank=r ...: <why>``
(naming the rank at fault) and exits non-zero, so srun and the job fail too.

``--width`` / ``--depth`` size the model (hidden units, hidden layers); every COLLECTIVE_*
setting (timeouts, ``COLLECTIVE_SHM``, ``COLLECTIVE_TOKEN``, TLS files) applies as usual.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import xxhash  # noqa: E402

import collective  # noqa: E402
import collective.torch  # noqa: E402
from collective import logs  # noqa: E402
from collective.clusterenv import resolve_roles  # noqa: E402

STEPS = 3


def build_model(seed: int, width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 1)]
    return torch.nn.Sequential(*layers)


def state_digest(tensors) -> str:
    """xxh3-128 over every tensor's name and bytes, in state_dict order."""
    h = xxhash.xxh3_128()
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(collective.torch.to_numpy(t).tobytes() if isinstance(t, torch.Tensor) else t.tobytes())
    return h.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=64, help="hidden units per layer (default 64)")
    p.add_argument("--depth", type=int, default=2, help="hidden layers (default 2)")
    args = p.parse_args()

    try:
        roles = resolve_roles(None, None, None)  # what sync will use: srun's variables here
    except collective.CollectiveError as exc:
        print(f"error rank=? {exc}", flush=True)
        return exc.exit_code
    rank = roles.rank
    logs.configure("chief" if rank == 0 else "worker")  # one line per event on stderr
    node, local = socket.gethostname(), collective.local_rank()
    device = collective.torch.local_device()  # cuda:<SLURM_LOCALID> on GPUs, else the CPU
    model = build_model(1000 + rank, args.width, args.depth).to(device)
    own = state_digest(model.state_dict())
    t0 = time.monotonic()
    try:
        result = collective.torch.sync_module(model)
    except collective.CollectiveError as exc:
        print(f"error rank={rank} world={roles.world_size} node={node}: {type(exc).__name__}: {exc}", flush=True)
        return exc.exit_code
    seconds = time.monotonic() - t0

    state = state_digest(model.state_dict())
    verified = state_digest(result.arrays(0))  # the replicas collective verified
    if state != verified:
        print(f"error rank={rank}: the module's tensors differ from the verified values", flush=True)
        return 1
    if rank == 0 and result.summary is not None:
        s = result.summary
        agree = {w["digest"] for w in s["workers"]} == {s.get("chief_replicas", {}).get("digest")}
        print(f"round ok={s['ok']} workers={len(s['workers'])} bytes={s['bytes']} seconds={s['seconds']:.3f} "
              f"digests_agree={agree}", flush=True)

    # The hand-off done, training is torch's: a few local SGD steps on this rank's own batches.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(32, 8, generator=data).to(device)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"result rank={result.rank} world={result.world_size} node={node} local={local} digest={result.digest} "
          f"state={state} own={own} sync_seconds={seconds:.3f} steps={STEPS} loss={loss.item():.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
