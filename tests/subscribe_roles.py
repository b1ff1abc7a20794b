"""Roles for the every-step tests, as real processes (tests/integration/test_subscribe_procs.py).

``publisher --address-file F --steps N``: publishes a bf16 state at step 0, then steps 1..N
(1% of elements changed each, from when ``F.go`` exists), one JSON line per step served ({"step", "manifest"}), then
serves on until ``F.stop`` exists (at most 120 s). ``subscriber --source ADDR --until N``:
subscribes and applies every step it receives, one JSON line per step applied ({"step",
"manifest", "kind"}), until it holds step N."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import collective


def publisher(args) -> None:
    rng = np.random.default_rng(0)
    state = {"w": rng.standard_normal(args.elements).astype(ml_dtypes.bfloat16), "step": 0}
    pub = collective.publish(state, step=0, copy=True, bind="127.0.0.1:0", name="trainer")
    print(json.dumps({"step": 0, "manifest": pub.manifest_digest}), flush=True)
    tmp = Path(str(args.address_file) + ".tmp")
    tmp.write_text(pub.address)
    os.replace(tmp, args.address_file)
    go, deadline = Path(str(args.address_file) + ".go"), time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:  # the test's subscribers are up
        time.sleep(0.02)
    for step in range(1, args.steps + 1):
        time.sleep(args.interval)
        idx = rng.choice(state["w"].size, state["w"].size // 100, replace=False)
        state["w"][idx] = (state["w"][idx].astype(np.float32) * 1.5 + 1).astype(ml_dtypes.bfloat16)
        state["step"] = step
        pub.update(state, step, wait=True)
        print(json.dumps({"step": step, "manifest": pub.manifest_digest}), flush=True)
    deadline = time.monotonic() + 120
    while not Path(str(args.address_file) + ".stop").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pub.close()


def subscriber(args) -> None:
    sub = collective.subscribe(args.source, shm=not args.no_shm)
    print(json.dumps({"step": sub.step, "manifest": sub.manifest_digest, "kind": "first"}), flush=True)
    while sub.step < args.until:
        if sub.apply(timeout=1.0) is not None:
            assert sub.state["step"] == sub.step
            print(json.dumps({"step": sub.step, "manifest": sub.manifest_digest, "kind": sub.stats["kind"]}),
                  flush=True)
    sub.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["publisher", "subscriber"])
    p.add_argument("--address-file", type=Path)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--interval", type=float, default=0.3)
    p.add_argument("--elements", type=int, default=2_000_000)
    p.add_argument("--source")
    p.add_argument("--until", type=int)
    p.add_argument("--no-shm", action="store_true")
    args = p.parse_args()
    publisher(args) if args.role == "publisher" else subscriber(args)


if __name__ == "__main__":
    main()
