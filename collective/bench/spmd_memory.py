"""Rank 0's memory around ``collective.torch.sync_module`` (issue 28, item 20).

``python -m collective.bench.spmd_memory --ranks 2 --size-mib 64 [--sharded]`` starts ``--ranks``
processes on loopback; each builds a torch module of about ``--size-mib`` (8 Linear layers), and
rank 0 prints its RSS over its state before the call: the peak during the call (VmHWM reset
first), after the call with the result held, after ``del result; gc.collect()``, and 2 s later.
``--sharded``: every parameter a DTensor ``Shard(0)`` over a 1-D mesh of every rank (gloo), rank 0
passing the whole state as ``values`` (then its shard is about size / ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

RANK = r"""
import gc, json, os, sys, time
import torch
import collective, collective.torch
import collective._api, collective.transport.grpc, collective.chief.service, collective.worker.agent

def rss():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

rank, ranks, mib, sharded = int(os.environ["COLLECTIVE_RANK"]), int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
n = int((mib * 2**20 / 4 / 8) ** 0.5)
torch.manual_seed(rank)
model = torch.nn.Sequential(*[torch.nn.Linear(n, n, bias=False) for _ in range(8)])
kwargs = {}
if sharded:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK=str(rank), WORLD_SIZE=str(ranks))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (ranks,))
    full = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None
    for layer in model:
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    kwargs = {"mesh": mesh, "values": full}
    del full
gc.collect()
before = rss()["VmRSS"]
reset_peak()
result = collective.torch.sync_module(model, **kwargs)
after = rss()
line = {"rank": rank, "before": before, "peak": after["VmHWM"] - before, "held": after["VmRSS"] - before}
del result
gc.collect()
line["dropped"] = rss()["VmRSS"] - before
time.sleep(2.0)
gc.collect()
line["dropped_2s"] = rss()["VmRSS"] - before
line["shard_mib"] = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in model.state_dict().values()) / 2**20
print(json.dumps(line), flush=True)
if sharded:
    dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.spmd_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--sharded", action="store_true")
    args = parser.parse_args()
    port, store = free_port(), free_port()
    procs = []
    for r in range(args.ranks):
        env = {**os.environ, "COLLECTIVE_RANK": str(r), "COLLECTIVE_WORLD_SIZE": str(args.ranks),
               "COLLECTIVE_CHIEF": f"127.0.0.1:{port}"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, str(args.ranks), str(args.size_mib),
                                       str(int(args.sharded)), str(store)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            for line in out.splitlines():
                if line.startswith("{") and json.loads(line)["rank"] == 0:
                    r = json.loads(line)
                    print(f"rank 0, {args.size_mib:g} MiB{' sharded' if args.sharded else ''}: before {r['before']:.1f} MiB; "
                          f"peak +{r['peak']:.1f}, held +{r['held']:.1f}, dropped +{r['dropped']:.1f}, "
                          f"2 s later +{r['dropped_2s']:.1f} MiB (its state: {r['shard_mib']:.1f} MiB)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
