"""SPMD: every training process runs this script; all end with rank 0's initial values.

    for r in 0 1 2; do COLLECTIVE_RANK=$r COLLECTIVE_WORLD_SIZE=3 \\
        COLLECTIVE_CHIEF=127.0.0.1:50051 python examples/sync.py & done; wait
    torchrun --nproc-per-node 3 examples/sync.py      # roles from torchrun's variables
    mpiexec -n 3 python examples/sync.py              # roles from MPI, the round over MPI

Each process initialises its own model with its own seed, as independently started training
processes do; after ``collective.sync`` every process holds rank 0's values bit for bit.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collective  # noqa: E402


def init_model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((784, 128)).astype(np.float32),
        "dense/bias": np.zeros(128, np.float32),
        "out/kernel": rng.standard_normal((128, 10)).astype(np.float32),
    }


def main() -> int:
    model = init_model(seed=os.getpid())
    try:
        result = collective.sync(model, devices="cpu:0,cpu:1")
    except collective.CollectiveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    weights = result.arrays(0)
    print(f"rank {result.rank} of {result.world_size}: {len(weights)} variables on {result.devices}, "
          f"digest {result.digest}; dense/kernel[0, :3] = {weights['dense/kernel'][0, :3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
