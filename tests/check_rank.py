"""One rank of a collective.check whose rank 1 never calls it (test-only; never shipped).

    torchrun --nproc-per-node 2 tests/check_rank.py torch    # over gloo, process group timeout 3 s
    mpiexec -n 2 python tests/check_rank.py mpi              # over mpi4py, timeout=2

Rank 1 sleeps 6 s and leaves; every other rank must raise within its deadline and prints
``rank R: error after S s: Class: message (phase P)``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import collective  # noqa: E402


def main() -> None:
    if sys.argv[1] == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=3))
        rank = dist.get_rank()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.rank
    start = time.monotonic()
    if rank == 1:
        time.sleep(6)
        print("rank 1: left without checking", flush=True)
        os._exit(0)
    try:
        collective.check({"w": np.zeros(4, dtype=np.float32)}, step=3, timeout=2)
        print(f"rank {rank}: passed", flush=True)
        os._exit(0)
    except collective.CollectiveError as exc:
        print(f"rank {rank}: error after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc} "
              f"(phase {exc.phase})", flush=True)
        os._exit(exc.exit_code)


if __name__ == "__main__":
    main()
