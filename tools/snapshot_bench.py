"""Fetch time and the fetcher's peak RSS of ``collective.fetch`` from 1..N holder processes.

    python -m tools.snapshot_bench --mib 256 --holders 1,3 --reps 5
    sudo python -m tools.snapshot_bench --mib 64 --holders 1,3 --emulate 200mbit
    python -m tools.snapshot_bench --mib 256 --holders 1,3 --into

Starts the largest number of holders asked for (each publishes the same seeded float32 state in
16 tensors, ``copy=False``), then for each holder count runs ``--reps`` fetches, each in a fresh
process (so its peak RSS is the fetch's own), and prints the median seconds, the rate and the
peak RSS. Every process it starts is killed by its pid at the end.

On loopback (default) holders and fetcher share one machine's cores: it measures the code's
overhead, not the uplinks' sum that striping gives. ``--emulate RATE`` (root) puts each holder
on an emulated host of its own whose link is shaped to RATE (``collective/bench/emulate.py``: network
namespaces, tbf), and the fetcher on another, unshaped: N holders' uplinks at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import os, sys, time, numpy as np, collective
mib, out, bind, advertise = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] or None
rng = np.random.default_rng(1)
state = {f"w{i}": rng.random(mib * (1 << 20) // 4 // 16, dtype=np.float32) for i in range(16)}
pub = collective.publish(state, step=1, bind=bind, advertise=advertise)
open(out + ".tmp", "w").write(pub.address)
os.replace(out + ".tmp", out)
time.sleep(3600)
"""

FETCHER = """
import json, resource, sys, time, numpy as np, collective
mib = int(sys.argv[2])  # > 0: into arrays of the holders' 16 tensors, allocated and written first
into = {f"w{i}": np.ones(mib * (1 << 20) // 4 // 16, dtype=np.float32) for i in range(16)} if mib else None
t = time.perf_counter()
got = collective.fetch(sys.argv[1].split(","), step=1, into=into)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "bytes": got.total_bytes,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "shares": [s["bytes"] for s in got.stats.values()]}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="state size in MiB")
    p.add_argument("--holders", default="1,3", help="holder counts to fetch from, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--into", action="store_true",
                   help="fetch into preallocated arrays (fetch(into=)), as a recovering process would")
    p.add_argument("--emulate", metavar="RATE", default=None,
                   help="each holder on an emulated host whose link is RATE (e.g. 200mbit; needs root)")
    a = p.parse_args(argv)
    counts = sorted({int(c) for c in a.holders.split(",")})
    with tempfile.TemporaryDirectory(prefix="snapshot-bench-") as tmp:
        if a.emulate:
            return _emulated(a, counts, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs: list[subprocess.Popen] = []
        try:
            files = [Path(tmp) / f"holder{i}" for i in range(counts[-1])]
            procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(a.mib), str(f), "127.0.0.1:0", ""],
                                      env=env) for f in files]
            _wait_files(files, lambda: any(pr.poll() is not None for pr in procs))

            def fetch(addresses: str) -> dict:
                return json.loads(subprocess.run([sys.executable, "-c", FETCHER, addresses, _into(a)], env=env, check=True,
                                                 capture_output=True, text=True, timeout=300).stdout)

            _table(a, counts, [f.read_text() for f in files], fetch, "loopback")
        finally:
            for pr in procs:
                pr.kill()
                pr.wait(10)
    return 0


def _into(a) -> str:
    return str(a.mib if a.into else 0)


def _wait_files(files: list[Path], dead) -> None:
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline or dead():
            raise SystemExit("a holder did not start")
        time.sleep(0.1)


def _table(a, counts: list[int], addresses: list[str], fetch, link: str) -> None:
    print(f"| holders | state | link | median s (of {a.reps}) | MiB/s | fetcher peak RSS | shares (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for n in counts:
        runs = [fetch(",".join(addresses[:n])) for _ in range(a.reps)]
        med = statistics.median(r["seconds"] for r in runs)
        rss = max(r["rss"] for r in runs)
        shares = "/".join(str(s >> 20) for s in runs[-1]["shares"])
        print(f"| {n} | {a.mib} MiB{' into' if a.into else ''} | {link} | {med:.2f} | {a.mib / med:.0f} | {rss / 2**20:.0f} MiB | {shares} |",
              flush=True)


def _emulated(a, counts: list[int], tmp: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from collective.bench.emulate import Topology, unavailable_reason

    why = unavailable_reason("--emulate")
    if why:
        raise SystemExit(why)
    names = [f"holder-{i + 1}" for i in range(counts[-1])]
    with Topology(["fetcher", *names], tmp) as net:
        files = []
        for name in names:
            net.shape(name, a.emulate)
            files.append(tmp / name)
            net.run(name, ["python", "-c", HOLDER, str(a.mib), str(files[-1]), "0.0.0.0:0", net.hosts[name].address],
                    env={"PYTHONPATH": str(ROOT)})
        try:
            _wait_files(files, lambda: any(p.returncode is not None for p in net.procs))
        except SystemExit:
            raise SystemExit("a holder did not start: " + " | ".join(p.output()[-300:] for p in net.procs)) from None

        def fetch(addresses: str) -> dict:
            done = net.exec("fetcher", ["python", "-c", FETCHER, addresses, _into(a)], env={"PYTHONPATH": str(ROOT)}, timeout=300)
            if done.returncode:
                raise SystemExit(f"the fetch failed: {done.stderr.strip().splitlines()[-1:]}")
            return json.loads(done.stdout)

        _table(a, counts, [f.read_text() for f in files], fetch, f"{a.emulate} each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
