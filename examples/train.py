"""A training script's side of the broadcast: join, get verified replicas, train.

Run a chief first (``python -m collective.chief --workers 1 --bind 127.0.0.1:50051``), then
``python examples/train.py --chief 127.0.0.1:50051``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collective  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--chief", default=None, help="HOST:PORT; default COLLECTIVE_CHIEF, TF_CONFIG or torchrun's")
    p.add_argument("--devices", default="cpu:0,cpu:1")
    args = p.parse_args()
    try:
        # The token, TLS files and timeouts come from COLLECTIVE_*, as for `python -m collective.worker`.
        result = collective.join(args.chief, devices=args.devices)
    except collective.CollectiveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    store = result.variables
    print(f"rank {result.rank}: start released after a {result.broadcast_seconds:.3f} s broadcast")
    print(f"trainable variables: {len(store.trainable_variables)}")
    for var in store.global_variables:
        print(f"  {var.name:<20} {str(var.shape):<12} {var.dtype} replicas: {', '.join(var.replica_names)}")
    # One SGD-like step on every replica of the first trainable floating-point variable, whatever
    # the model: a mirrored variable combines per-replica updates.
    weights = next((v for v in store.trainable_variables if np.dtype(v.dtype).kind == "f"), None)
    if weights is None:
        print("no trainable floating-point variable to take a step on")
        return 0
    weights.assign([r - 0.01 for r in weights.replicas])
    print(f"one step on {weights.name}: every replica updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
