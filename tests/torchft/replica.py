"""One torchft replica group (world size 1, gloo, CPU) training a small model, for the recovery tests.

    python -m tests.torchft.replica --lighthouse HOST:PORT --replica-id a --seed 1 \
        --transport collective --stop-file PATH

Each step prints ``replica a step N participants P digest D`` (``D``: the combined digest of every
tensor of the model's and the optimizer's state_dict, collective.digest), so the test can compare
two groups bit for bit at the same step; when ``--stop-file`` holds a step number S the loop ends
there. A recovery that the transport refused prints
``replica a recovery refused: <the transport's one line>`` and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import Manager
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.ddp import DistributedDataParallel
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from collective.digest import array_digest, combined_digest
from collective.torch import to_numpy

# Every wait in here ends: a lost peer fails the step's allreduce after TIMEOUT, not never; a
# quorum waits longer, for a killed group's replacement to start (an interpreter and torch).
TIMEOUT = timedelta(seconds=10)
QUORUM_TIMEOUT = timedelta(seconds=60)


def state_digest(state: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(key path, digest) for every tensor in a nested state_dict, in key order."""
    out = []
    for key in sorted(state, key=str):
        value, name = state[key], f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out.append((name, array_digest(to_numpy(value))))
        elif isinstance(value, dict):
            out.extend(state_digest(value, name + "."))
        elif isinstance(value, list):
            out.extend(state_digest(dict(enumerate(value)), name + "."))
    return out


def make_transport(kind: str, replica_id: str = ""):
    if kind == "http":
        return HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    import collective.torchft

    # Its publish / fetch lines ("publishing step N", "fetched step N ... from ...") show the
    # test that the recovery went through it.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger("collective").addHandler(handler)
    logging.getLogger("collective").setLevel(logging.INFO)
    cls = collective.torchft.Transport
    if os.environ.get("COLLECTIVE_TEST_HOSTILE") == "bytes":
        cls = _changes_served_bytes()
    # Named by its replica id: a recovering group's errors say which group's holder it was.
    return cls(token=os.environ.get("COLLECTIVE_TEST_TOKEN"), timeout=TIMEOUT, bind="127.0.0.1:0",
               name=f"replica {replica_id}" if replica_id else None)


def _changes_served_bytes():
    """A test-only hostile holder: it publishes, then changes the tensors it serves in place, so
    every byte it sends of them differs from the digests of its own plan."""
    import collective.torchft

    class ChangesServedBytes(collective.torchft.Transport):
        def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)
            with torch.no_grad():
                for t in state_dict["user"]["default"]["model"].values():
                    t.add_(1.0)
            print("hostile holder: served tensors changed after publishing", flush=True)

    return ChangesServedBytes


def stop_step(path: Path | None) -> int | None:
    try:
        return int(path.read_text()) if path else None
    except (FileNotFoundError, ValueError):
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--transport", choices=["http", "collective"], default="collective")
    p.add_argument("--stop-file", type=Path)
    p.add_argument("--max-steps", type=int, default=200)
    args = p.parse_args()

    torch.manual_seed(args.seed)  # each group starts from values of its own: init_sync must fix them
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    inner = torch.optim.Adam(model.parameters(), lr=0.01)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=1, timeout=TIMEOUT, quorum_timeout=QUORUM_TIMEOUT, connect_timeout=TIMEOUT,
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=f"http://{args.lighthouse}", replica_id=args.replica_id, hostname="127.0.0.1",
        checkpoint_transport=make_transport(args.transport, args.replica_id), init_sync=True, max_retries=20,
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    loss_fn = nn.MSELoss()
    rid = args.replica_id
    try:
        for _ in range(args.max_steps):
            optimizer.zero_grad()  # starts the quorum (and a recovery, when this group is behind)
            x = torch.randn(4, 8)
            loss_fn(ddp(x), torch.zeros(4, 4)).backward()  # gradients averaged across the groups
            optimizer.step()  # commits only when every group of the quorum succeeded
            if manager.errored() is not None and manager._healing:
                print(f"replica {rid} recovery refused: {manager.errored().original_exception}", flush=True)
                return 2
            step = manager.current_step()
            digest = combined_digest(state_digest(state_dict()))
            print(f"replica {rid} step {step} participants {manager.num_participants()} digest {digest}",
                  flush=True)
            target = stop_step(args.stop_file)
            if target is not None and step >= target:
                return 0
            time.sleep(0.05)  # a pace the test can follow on a loaded machine
        print(f"replica {rid} ran out of steps at {manager.current_step()}", flush=True)
        return 1
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
