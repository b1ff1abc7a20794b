"""Time one ``collective.sync`` of a small model across SPMD ranks on this host (issue 28, item 19).

``python -m collective.bench.spmd --ranks 3 --size-mib 1 --repeat 5 [--rank0-late 0.5]`` starts
``--ranks`` processes on loopback (COLLECTIVE_RANK / _WORLD_SIZE / _CHIEF); each imports its
modules and says so, and once every rank has, all are given a common start time (so import skew
is not measured, however loaded the machine), rank 0 sleeps ``--rank0-late`` s, then each times
its ``collective.sync`` call. Prints one line per repeat: each rank's call time, the time from
the last rank's call to the last return ("all in": what a call costs when every rank calls at
once, whatever delayed one of them past the common start on a loaded machine), and rank 0's
broadcast ("transfer": first byte to every worker ready, from its summary), then the medians.
The call time of a rank other than 0, less ``--rank0-late``, is what it waited beyond rank 0's
own start. ``--preimport``: import what the first call imports (grpc, the chief, the worker,
the relay, the options) before timing, as in a process that synced before; without it the call
time includes those imports."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

RANK = """
import json, os, sys, time
import numpy as np
import collective
if os.environ.get("BENCH_LOG"):
    import logging; logging.basicConfig(level=logging.DEBUG if os.environ["BENCH_LOG"].lower() == "debug" else logging.INFO, format="%%(created).3f %%(name)s %%(message)s")
values = {f"v{i}": np.full(%(n)d // 4 // %(k)d, i, np.float32) for i in range(%(k)d)}
late = float(sys.argv[1])
if sys.argv[2] == "1":  # what the first call would import: a script that synced before has it
    import collective._api, collective.transport.grpc, collective.chief.service, collective.worker.agent
    import collective.options, collective.chief.pending, collective.chief.round, collective.worker.relay
    import collective.transport.registry, collective.transport.rawtcp, collective.transport.shm
    import grpc._channel, grpc.experimental, encodings.idna, tempfile, queue, concurrent.futures.thread
rank = int(os.environ["COLLECTIVE_RANK"])
print("imported", flush=True)
go = float(sys.stdin.readline())
time.sleep(max(0.0, go - time.time()) + (late if rank == 0 else 0.0))
began, t0 = time.time(), time.perf_counter()
result = collective.sync(values if rank == 0 else None)
call = time.perf_counter() - t0
summary = result.summary or {}
print(json.dumps({"rank": rank, "call": call, "began": began, "ended": began + call,
                  "transfer": summary.get("seconds")}), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(ranks: int, nbytes: int, late: float, preimport: bool, variables: int = 4) -> dict[int, dict]:
    port = free_port()
    code = RANK % {"n": nbytes, "k": variables}
    procs = []
    for r in range(ranks):
        env = {**os.environ, "COLLECTIVE_RANK": str(r), "COLLECTIVE_WORLD_SIZE": str(ranks),
               "COLLECTIVE_CHIEF": f"127.0.0.1:{port}", "COLLECTIVE_SHM": os.environ.get("COLLECTIVE_SHM", "1")}
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(late), str(int(preimport))], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=None if os.environ.get("BENCH_LOG") else subprocess.DEVNULL, text=True))
    out = {}
    try:
        for p in procs:  # every rank has imported what it needs: a start time close ahead
            if p.stdout.readline().strip() != "imported":
                raise RuntimeError(f"a rank (pid {p.pid}) exited before its call")
        go = time.time() + 0.2
        for p in procs:
            p.stdin.write(f"{go}\n")
            p.stdin.flush()
        for p in procs:
            stdout, _ = p.communicate(timeout=60)
            line = json.loads(stdout.strip().splitlines()[-1])
            out[line["rank"]] = line
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m collective.bench.spmd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rank0-late", type=float, default=0.0)
    parser.add_argument("--variables", type=int, default=4, help="the model's bytes in this many float32 variables")
    parser.add_argument("--preimport", action="store_true",
                        help="import the modules the first call would (grpc, the chief, the worker) before timing")
    args = parser.parse_args()
    calls: dict[int, list[float]] = {r: [] for r in range(args.ranks)}
    transfers, all_in = [], []
    for i in range(args.repeat):
        res = one(args.ranks, int(args.size_mib * 2**20), args.rank0_late, args.preimport, args.variables)
        for r, line in res.items():
            calls[r].append(line["call"])
        transfers.append(res[0]["transfer"])
        all_in.append(max(x["ended"] for x in res.values()) - max(x["began"] for x in res.values()))
        print(f"run {i + 1}: " + ", ".join(f"rank {r} {res[r]['call']:.3f} s" for r in sorted(res))
              + f"; all in {all_in[-1]:.3f} s; transfer {res[0]['transfer']:.3f} s", flush=True)
    print("median: " + ", ".join(f"rank {r} {statistics.median(c):.3f} s" for r, c in calls.items())
          + f"; all in {statistics.median(all_in):.3f} s (runs {min(all_in):.3f}-{max(all_in):.3f} s)"
          + f"; transfer {statistics.median(transfers):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
