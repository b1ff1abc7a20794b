"""A holder process for tests/integration/test_snapshot*.py: publishes a state and serves it until
killed. Its address goes to ``--address-file`` once it serves; ``state_digests.json`` beside it
holds every tensor's digest, for the fetcher to compare with.

States: ``nested`` (numpy + JSON leaves), ``torch`` (a small nn.Module and its Adam optimizer
after one step), ``big`` (``--mib`` MiB of seeded float32 in 8 tensors).

Test-only misbehaviour, each what a faulty or hostile holder does:
``--pace S``    sleep S s before each chunk it sends (a slow uplink, so a test can kill it mid-fetch)
``--flip NAME`` change tensor NAME after publishing (served in place: its bytes no longer match
                its own plan); ``--flip '*'``: one byte in every MiB of every tensor
``--pickle-tree`` publish, as its structure, a pickle that would create ``--pickle-tree``'s
                file if anyone unpickled it (and digests that match it: only JSON parsing can refuse it)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

import numpy as np

import collective
from collective.digest import array_digest
from collective.snapshot import tree
from collective.stream import Chunker


def nested_state() -> dict:
    rng = np.random.default_rng(7)
    return {
        "layer.0.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "layer.0.bias": np.arange(16, dtype=np.int64),
        "meta": {"lr": 0.001, "betas": (0.9, 0.999), "name": "run-7", "done": False, "none": None,
                 3: ["a", 1, 2.5]},
        "empty": np.zeros((0, 4), np.float16),
    }


def torch_state() -> dict:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def big_state(mib: int) -> dict:
    rng = np.random.default_rng(11)
    per = mib * (1 << 20) // 4 // 8
    return {f"block.{i}.weight": rng.random(per, dtype=np.float32) for i in range(8)}


def digests(state) -> dict:
    _, arrays = tree.flatten(state)
    return {name: array_digest(a) for name, a in arrays.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state", choices=("nested", "torch", "big"), default="nested")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--step", type=int, default=8)
    p.add_argument("--chunk-bytes", type=int, default=None)
    p.add_argument("--copy", action="store_true")
    p.add_argument("--address-file", required=True)
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--flip", default=None)
    p.add_argument("--pickle-tree", default=None)
    p.add_argument("--name", default=None, help="publish(name=): what fetchers' errors call it")
    a = p.parse_args()
    state = {"nested": nested_state, "torch": torch_state}.get(a.state, lambda: big_state(a.mib))()
    if a.pace:
        frames = Chunker.frames

        def paced(self, *args, **kwargs):
            for item in frames(self, *args, **kwargs):
                time.sleep(a.pace)
                print("streaming", flush=True)  # the test acts once a stripe is under way
                yield item

        Chunker.frames = paced
    if a.pickle_tree:
        class Evil:  # unpickling it runs open(path, "w"): the file exists iff someone unpickled it
            def __reduce__(self):
                return (open, (a.pickle_tree, "w"))

        blob = pickle.dumps(Evil())
        tree.encode = lambda skeleton, step: np.frombuffer(blob, dtype=np.uint8)
    pub = collective.publish(state, step=a.step, bind="127.0.0.1:0", copy=a.copy, chunk_bytes=a.chunk_bytes,
                             name=a.name)
    if a.flip == "*":
        for arr in state.values():
            arr.reshape(-1).view(np.uint8)[:: 1 << 20] ^= 0xFF
    elif a.flip:
        target = state
        for key in a.flip.split("/"):
            target = target[key]
        if hasattr(target, "numpy"):
            target = target.numpy()
        target.reshape(-1).view(np.uint8)[-1] ^= 0xFF  # served in place: now differs from the plan
    folder = os.path.dirname(a.address_file)
    with open(os.path.join(folder, "state_digests.json"), "w") as fh:
        json.dump({"digests": digests(state), "manifest": pub.manifest_digest}, fh)
    serve(pub, a.address_file, a.step)


def serve(pub, address_file: str, step: int) -> None:
    """Write ``pub``'s address to ``address_file`` (whole, by a rename) and serve until killed
    (600 s at most: never outlives a test that forgot it)."""
    tmp = address_file + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(pub.address)
    os.replace(tmp, address_file)
    print(f"serving step {step} at {pub.address}", flush=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.2)
    pub.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
