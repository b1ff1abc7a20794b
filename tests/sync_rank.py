"""One training process of the sync integration tests: builds its own values (different on every
rank, as independently initialised models are), calls ``collective.sync`` and prints one JSON
line: its rank, the digests of its inputs and of every replica it holds after start.

``SYNC_MISMATCH_RANK=r``: rank r declares a model that differs from rank 0's (one shape, one
dtype, one extra variable). ``SYNC_NO_VALUES=1``: ranks other than 0 pass no values.
``SYNC_LATE_RANK=r``: rank r starts 1 s late (after a mismatch has already failed the round).
``SYNC_OUT=dir``: write the line to ``dir/rank<r>.json`` too (ranks under mpiexec share stdout).
A rank that failed then waits (at most 30 s) until every rank has written its line: mpiexec
kills the ranks still running once one exits with an error, and on a loaded machine that lost
the lines of ranks that had raised the same error a moment later (seen in the suite).
``SYNC_SHARDS=dim0``: rank 0 asks for shards; each rank also prints the digests of the rows of
rank 0's values it should hold (``expected``) and the bytes it received.
``SYNC_SHARDS=bad``: rank 0 asks for shards of a variable its model lacks (``nope``).
``SYNC_STRAGGLER_LOG=s``: the API's "still waiting" warnings come after ``s`` s (default 10).
``SYNC_JOIN_TIMEOUT=s``: the join timeout of every rank (default 30 s).
``SYNC_SLOW_VALUES=s``: rank 0 passes a callable that takes ``s`` s to return its values (a slow
load). Every line says the CPU and wall seconds the sync call took (``cpu``, ``wall``).
``SYNC_FROM_FILE=path``: rank 0 passes ``path`` (a .safetensors of its values) with
``from_file=True`` instead of the arrays; the others pass no values.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import xxhash

import collective
from collective._api import resolve_roles


def values_for(rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    values = {
        "dense/kernel": rng.standard_normal((33, 17)).astype(np.float32),
        "dense/bias": rng.standard_normal(17).astype(np.float64),
        "embedding": rng.standard_normal((300, 16)).astype(np.float16),
        "step": np.array(rank, np.int64),
    }
    if str(rank) == os.environ.get("SYNC_MISMATCH_RANK"):
        values["dense/kernel"] = values["dense/kernel"][:, :16].copy()
        values["dense/bias"] = values["dense/bias"].astype(np.float32)
        values["extra"] = np.zeros(3, np.float32)
    return values


def digests(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    return {k: xxhash.xxh3_128_hexdigest(np.ascontiguousarray(v).tobytes()) for k, v in arrays.items()}


def report(rank: int, line: dict) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if os.environ.get("SYNC_OUT"):
        path = os.path.join(os.environ["SYNC_OUT"], f"rank{rank}.json")
        with open(path + ".part", "w") as f:
            f.write(text)
        os.replace(path + ".part", path)  # whole or absent: another rank waits for it


def await_every_line(world: int) -> None:
    out = os.environ.get("SYNC_OUT")
    deadline = time.monotonic() + 30
    while out and time.monotonic() < deadline and \
            not all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(world)):
        time.sleep(0.05)


def main() -> int:
    roles = resolve_roles(None, None, None)
    rank = roles.rank
    values = values_for(rank)
    given = values if rank == 0 or not os.environ.get("SYNC_NO_VALUES") else None
    path = os.environ.get("SYNC_FROM_FILE")
    if path:
        given = path if rank == 0 else None
    if str(rank) == os.environ.get("SYNC_LATE_RANK"):
        time.sleep(1.0)
    t = collective.Timeouts(join=float(os.environ.get("SYNC_JOIN_TIMEOUT", 30)), rpc=10, stall=10, ready=30, start=30,
                            linger=2, heartbeat=1, lease=10,
                            straggler_log=float(os.environ.get("SYNC_STRAGGLER_LOG", 10)))
    slow = float(os.environ.get("SYNC_SLOW_VALUES", 0))
    if slow and rank == 0:
        loaded = given

        def given():  # noqa: F811 - the same values, after a slow load
            time.sleep(slow)
            return loaded

    shards = os.environ.get("SYNC_SHARDS") or None
    if shards == "bad":
        shards = {"nope": "dim0", "*": "all"}
    wall, cpu = time.monotonic(), time.process_time()
    try:
        result = collective.sync(given, devices="cpu:0,cpu:1", timeouts=t, shards=shards if rank == 0 else None,
                                 from_file=bool(path) if rank == 0 else None)
    except collective.CollectiveError as exc:
        report(rank, {"rank": rank, "error": type(exc).__name__, "message": str(exc), "culprit": exc.culprit,
                      "phase": exc.phase, "cpu": time.process_time() - cpu, "wall": time.monotonic() - wall})
        await_every_line(roles.world_size)
        return exc.exit_code
    line = {
        "rank": result.rank, "world_size": result.world_size, "devices": result.devices,
        "inputs": digests(values), "held": [digests(result.arrays(i)) for i in range(len(result.devices))],
        "digest": result.digest, "cpu": time.process_time() - cpu, "wall": time.monotonic() - wall,
    }
    if result.summary is not None:  # rank 0: did it serve from the file (mapped) or a copy?
        line["from_file"] = result.summary["chief"]["from_file"]
    if result.shards is not None:
        chief = values_for(0)
        line["expected"] = digests({n: chief[n][slice(*p.rows)] if p.placement == "dim0" else chief[n]
                                    for n, p in result.shards.items()})
        line["bytes_received"], line["plan_bytes"] = result.bytes_received, result.plan_bytes
        line["model_bytes"] = sum(a.nbytes for a in chief.values())
    report(rank, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
