"""``collective bench scale``: one chief and many workers on this host (issue 31, item 1).

A chief (``python -m collective.chief --no-shm``, a small model of ``--variables`` float32
variables in ``--size`` bytes) and ``--workers`` N workers of the project's own worker code, K
per process (``--per-process``, ``collective.bench.manyworkers``), over gRPC on 127.0.0.1. Every
process imports first; then all N join within the same instant (a join storm). Measured:

* ``round_s``: from the storm until every worker process ended with start released;
* ``admitted_s``: from the storm until ``collective status`` counts N joined;
* ``chief_threads``: the most threads the chief process had (``/proc/PID/status``), and
  ``chief_threads_end`` its threads once start was released (a star's data streams, a thread
  each on the raw data port while they last, are over then);
* ``chief_rss_mib``: the chief's peak RSS (VmHWM);
* ``status_max_s``: the slowest of the Status calls made every 0.2 s throughout;
* ``parked_tries`` / ``parked_checks``: the parked calls the chief tried again, and the
  predicates it asked to know whether to (``collective.parking``; its log);
* ``plan_bytes``: the plan the chief sent each worker (its log), and ``plan_20k_bytes``: the plan
  of N workers and 20,000 variables as the chief's own plan code builds it (nothing sent);
* ``frozen_detect_s`` (unless ``--no-freeze``): a second round; one worker in a process of its own is
  frozen (SIGSTOP) once joined, the other N-1 join; seconds from the freeze until the chief
  logs it silent past the lease (``--lease``): dropped while the others join, or lost during
  the broadcast, which then fails naming it.

Every process is killed by its pid when the run ends; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from collective.bench.spec import write_spec
from collective.errors import AbortedError

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "bench-scale-token"
# The workers run niced: on a machine of a few cores, N workers' processes would otherwise take
# the chief's share (a chief slow to ack its clients' keepalive pings loses their connections),
# and it is the chief that is measured. Each real worker has a host of its own.
WORKERS_NICE = 10
MiB = 1 << 20


def proc_status(pid: int) -> dict[str, int]:
    """Threads and VmHWM (bytes) of process ``pid`` (empty once it is gone)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "Threads":
                out["threads"] = int(value)
            elif key == "VmHWM":
                out["hwm"] = int(value.split()[0]) * 1024
    return out


class _Procs:
    """Processes of one run, their output in files under ``tmp``; ``close`` kills each by pid."""

    def __init__(self, tmp: Path, lease: float) -> None:
        self.tmp, self.procs = tmp, []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
        # The lease for the workers too: one that hears nothing from the chief that long gives up.
        self.env.update(COLLECTIVE_TOKEN=TOKEN, PYTHONUNBUFFERED="1", COLLECTIVE_HEARTBEAT_TIMEOUT=str(lease),
                        COLLECTIVE_LOG_LEVEL="debug",  # the chief's parked-call counter is a debug line
                        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))

    def start(self, name: str, *args: str, nice: int = 0) -> subprocess.Popen:
        with open(self.tmp / f"{name}.log", "w") as log:
            p = subprocess.Popen([*(["nice", "-n", str(nice)] if nice else []), sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=self.env, cwd=ROOT, start_new_session=True)
        p.run_dir = str(self.tmp)  # for the line a failed wait ends in
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)  # a frozen one dies too
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(10)


def proc_dir(proc: subprocess.Popen | None) -> str:
    return getattr(proc, "run_dir", "the run directory")


def _until(predicate, what: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AbortedError(f"bench scale: no {what} within {timeout:g} s; logs in {proc_dir(proc)}")
        if proc is not None and proc.poll() is not None:
            raise AbortedError(f"bench scale: the chief exited ({proc.returncode}) before {what}; "
                               f"logs in {proc_dir(proc)}")
        time.sleep(0.02)


class _Watch:
    """Every ``every`` s: the chief's threads and peak RSS, and one timed Status call."""

    def __init__(self, pid: int, address: str, every: float = 0.2) -> None:
        from collective.transport.grpc import GrpcChiefLink

        self.pid, self.every = pid, every
        self.link = GrpcChiefLink(address, token=TOKEN, name="the chief")
        self.threads = self.hwm = self.threads_end = 0
        self.status_max = 0.0
        self.last = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            now = proc_status(self.pid)
            if not now:
                return
            self.threads = max(self.threads, now.get("threads", 0))
            self.hwm = max(self.hwm, now.get("hwm", 0))
            t0 = time.monotonic()
            try:
                self.last = self.link.status(timeout=10.0)
            except Exception:  # noqa: BLE001 - the chief is going: the samples so far count
                return
            self.status_max = max(self.status_max, time.monotonic() - t0)
            if self.last.phase == "started":  # the round's calls answered, the data streams over
                self.threads_end = now.get("threads", 0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15.0)
        self.link.close()


def _chief(procs: _Procs, workers: int, spec: Path, topology: str, lease: float, join_timeout: float):
    port_file = procs.tmp / "chief.port"
    chief = procs.start("chief", "-m", "collective.chief", "--workers", str(workers), "--model", str(spec),
                        "--bind", "127.0.0.1:0", "--port-file", str(port_file), "--no-shm",
                        "--topology", topology, "--join-timeout", str(join_timeout),
                        "--heartbeat-timeout", str(lease), "--linger", str(join_timeout))
    # A long --linger: on one host of few cores, starved worker processes ask for start many
    # seconds after it was released (the chief still stops once every worker heard it).
    _until(lambda: port_file.exists() and port_file.read_text().strip(), "port file", 60.0, chief)
    return chief, f"127.0.0.1:{port_file.read_text().strip()}"


def _workers(procs: _Procs, address: str, counts: list[int], tag: str, relay: bool, deadline: float):
    """Start processes of ``counts`` workers each, imported and waiting for the go file."""
    go_file, started, first = procs.tmp / f"go-{tag}", [], 0
    for i, k in enumerate(counts):
        ready = procs.tmp / f"ready-{tag}-{i}"
        started.append((procs.start(f"workers-{tag}-{i}", "-m", "collective.bench.manyworkers", "--chief", address,
                                    "--workers", str(k), "--prefix", f"{tag}{i}-", "--ready-file", str(ready),
                                    "--go-file", str(go_file), "--deadline", str(deadline),
                                    *([] if relay else ["--no-relay"]), nice=WORKERS_NICE), ready))
        first += k
    _until(lambda: all(r.exists() for _, r in started), "worker processes ready", 120.0)
    return [p for p, _ in started], go_file


def _go(go_file: Path, lead: float = 0.3) -> float:
    go = time.time() + lead
    tmp = go_file.with_suffix(".tmp")
    tmp.write_text(repr(go))
    tmp.rename(go_file)  # whole, at once: a reader never sees half a time
    return go


def scale_round(workers: int, per_process: int, tmp: Path, *, variables: int = 16, size: int = 16384,
                topology: str = "auto", relay: bool = True, lease: float = 15.0, timeout: float = 300.0) -> dict:
    """One verified round of ``workers`` workers, ``per_process`` to a process; the measurements."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = write_spec(tmp / "model.yaml", size, variables)
    procs = _Procs(tmp, lease)
    counts = [min(per_process, workers - i) for i in range(0, workers, per_process)]
    try:
        chief, address = _chief(procs, workers, spec, topology, lease, timeout)
        watch = _Watch(chief.pid, address)
        try:
            pool, go_file = _workers(procs, address, counts, "w", relay, timeout)
            go = _go(go_file)
            _until(lambda: watch.last is not None and watch.last.joined >= workers and time.time() > go,
                   f"{workers} joined", timeout, chief)
            admitted = time.time() - go
            outs = []
            for p in pool:
                p.wait(max(1.0, go + timeout - time.time()))
                outs.append(p.returncode)
            round_s = time.time() - go
            code = chief.wait(60)
        finally:
            watch.close()
        results = [_last_json(tmp / f"workers-w-{i}.log") for i in range(len(counts))]
        digests = {d for r in results for d in r.get("digests", [])}
        log = (tmp / "chief.log").read_text(errors="replace")
        plan = re.search(r"plan of (\d+) bytes", log)
        parked = re.search(r"parked calls: (\d+) tried again, (\d+) predicates asked", log)
        return {"workers": workers, "per_process": per_process, "ok": code == 0 and outs == [0] * len(outs)
                and len(digests) == 1 and sum(r.get("started", 0) for r in results) == workers,
                "chief_exit": code, "started": sum(r.get("started", 0) for r in results), "digests": sorted(digests), "round_s": round_s, "admitted_s": admitted,
                "chief_threads": watch.threads, "chief_threads_end": watch.threads_end, "chief_rss_mib": watch.hwm / MiB, "status_max_s": watch.status_max,
                "plan_bytes": int(plan.group(1)) if plan else None,
                "parked_tries": int(parked.group(1)) if parked else None,
                "parked_checks": int(parked.group(2)) if parked else None,
                "errors": [e for r in results for e in r.get("errors", [])][:5]}
    finally:
        procs.close()


def frozen_round(workers: int, per_process: int, tmp: Path, *, lease: float = 15.0, timeout: float = 300.0,
                 relay: bool = True) -> float:
    """Seconds from freezing one joined worker until the chief drops it, the other workers joined meanwhile."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = write_spec(tmp / "model.yaml", 16384, 16)
    procs = _Procs(tmp, lease)
    try:
        chief, address = _chief(procs, workers, spec, "auto", lease, timeout)
        watch = _Watch(chief.pid, address)
        try:
            (lone,), lone_go = _workers(procs, address, [1], "frozen", relay, timeout)
            _go(lone_go, 0.0)
            _until(lambda: watch.last is not None and watch.last.joined >= 1, "the lone worker joined", 60.0, chief)
            time.sleep(0.5)  # its presence call and first heartbeat are in
            os.kill(lone.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            counts = [min(per_process, workers - 1 - i) for i in range(0, workers - 1, per_process)]
            _pool, go_file = _workers(procs, address, counts, "w", relay, timeout)
            _go(go_file)

            log = procs.tmp / "chief.log"

            def dropped() -> bool:  # dropped while joining, or lost during the broadcast (the round fails)
                return any("frozen0-0" in line and "no heartbeat for" in line
                           for line in log.read_text(errors="replace").splitlines())

            _until(dropped, "frozen worker dropped", lease * 4 + 60.0)
            return time.monotonic() - frozen_at
        finally:
            watch.close()
    finally:
        procs.close()


def plan_bytes(workers: int, variables: int) -> int:
    """The serialized plan the chief's own code builds for ``workers`` workers and ``variables``
    variables (names as long as a transformer's), built here; nothing is sent."""
    import tempfile

    from collective._proto import collective_pb2 as pb
    from collective.chief.arena import ChiefArena
    from collective.sources import load_source
    from collective.topology import arrange

    with tempfile.TemporaryDirectory() as d:
        spec = Path(d, "big.yaml")
        lines = ["seed: 1", "variables:"] + [
            f"  - {{name: model/layers.{i // 16}/block_{i % 16}/attention/kernel, shape: [4], dtype: float32,"
            f" initializer: uniform}}" for i in range(variables)]
        spec.write_text("\n".join(lines) + "\n")
        arena = ChiefArena(load_source(str(spec)), ranks=workers, trains=False, chunk_bytes=None, shm=False,
                           from_file=False, shards=None, max_bytes=None)
    lay = arrange("auto", ["node-0001"] * workers, "chief-host", int(arena.array.nbytes), share=False)
    infos = [pb.WorkerInfo(rank=r, worker_id=f"node-0001-{100000 + r}", host="node-0001", devices=["cpu:0"],
                           incarnation=f"{r:012x}", parent=lay.parents[r], relay_address=f"10.0.0.1:{40000 + r}")
             for r in range(workers)]
    plan = arena.plan(infos, chunk_bytes=4 * MiB, chief_incarnation="0123456789ab")
    return plan.ByteSize()


def _last_json(path: Path) -> dict:
    with contextlib.suppress(OSError):
        for line in reversed(path.read_text(errors="replace").splitlines()):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    return json.loads(line)
    return {}


PLAN_VARIABLES = 20_000


def add_scale_options(p) -> None:
    """The options only ``collective bench scale`` reads (``--workers`` and ``--json`` are the bench's)."""
    p.add_argument("--per-process", default="64", metavar="K",
                   help="scale: workers per process (collective/bench/manyworkers.py; default 64)")
    p.add_argument("--relay", action="store_true",
                   help="scale: the workers relay (a tree); default: none relays (a star)")
    p.add_argument("--no-freeze", action="store_true", help="scale: skip the frozen-worker round")
    p.add_argument("--lease", default="15", metavar="S",
                   help="scale: the chief's heartbeat lease (--heartbeat-timeout), seconds (default 15)")


def run_scale(args, say) -> int:
    """``collective bench scale``: per worker count, a verified round and (unless --no-freeze) a
    frozen-worker round; a table, or one JSON line with --json."""
    import tempfile

    from collective.bench.spec import _positive, parse_workers
    from collective.errors import UsageError

    counts = parse_workers(args.workers) if args.workers else [1024]
    per_process = _positive(args.per_process, "--per-process")
    try:
        lease = float(args.lease)
    except ValueError:
        raise UsageError(f"--lease {args.lease!r} is not a number of seconds") from None
    rows = []
    for n in counts:
        d = Path(tempfile.mkdtemp(prefix="bench-scale-"))  # kept when a round fails: its logs say why
        say(f"{n} workers, {per_process} per process: a round (logs in {d})")
        row = scale_round(n, per_process, d / "round", relay=args.relay, lease=lease)
        if not row["ok"]:
            first = row["errors"][0] if row["errors"] else f"the chief exited {row['chief_exit']}"
            raise AbortedError(f"bench scale: the round of {n} workers did not complete ({row['started']}"
                               f" started); first: {first[:300]}; logs in {d}")
        if not args.no_freeze:
            say(f"{n} workers: one frozen (SIGSTOP) once joined")
            row["frozen_detect_s"] = frozen_round(n, per_process, d / "frozen", lease=lease, relay=args.relay)
        row["lease_s"] = lease
        row[f"plan_{PLAN_VARIABLES}_bytes"] = plan_bytes(n, PLAN_VARIABLES)
        shutil.rmtree(d, ignore_errors=True)
        rows.append(row)
    if args.json:
        print(json.dumps({"scale": rows}), flush=True)
        return 0
    head = ["workers", "round s", "admitted s", "chief threads (peak / end)", "chief peak RSS MiB", "status max s",
            "plan bytes", f"plan bytes, {PLAN_VARIABLES:,} vars", "frozen detected s (lease)", "heard start",
            "parked calls tried again / predicates asked"]
    print(" | ".join(head))
    for r in rows:
        frozen = f"{r['frozen_detect_s']:.1f} ({r['lease_s']:g})" if "frozen_detect_s" in r else "-"
        print(" | ".join([str(r["workers"]), f"{r['round_s']:.1f}", f"{r['admitted_s']:.1f}",
                          f"{r['chief_threads']} / {r['chief_threads_end']}",
                          f"{r['chief_rss_mib']:.0f}", f"{r['status_max_s']:.2f}", str(r["plan_bytes"]),
                          str(r[f"plan_{PLAN_VARIABLES}_bytes"]), frozen, str(r["started"]),
                          f"{r['parked_tries']} / {r['parked_checks']}"]))
    return 0
