"""``collective bench --recovery``: a restarted replica takes a live peer's torchft state dict.

One run times, side by side, the recovering process's ``recv_checkpoint`` with torchft's
``HTTPTransport`` (``num_chunks`` 0 and 8) and ``PGTransport`` (gloo), and with
``collective.torchft.Transport`` from 1 holder and from 3 holders of the same step, and from 1
holder with ``copy=True`` (a sealed memfd the fetcher maps on the same host). The state
dict is torchft's shape (``{"user": {"default": {"model": ...}}, "torchft": {...}}``) with
``--variables`` float32 tensors sharing ``--size`` bytes, the same bytes in every holder.

Every holder and the recovering process are processes of their own (``python -m
collective.bench.recovery holder|recover``); a holder builds the state, publishes it (``send_checkpoint``)
and prints its metadata and the state's digest; then the recovering process starts, imports
everything, and times ``recv_checkpoint`` alone (for PGTransport: from after the process group
is up until the last tensor is in). It then reports the seconds, its peak RSS (``ru_maxrss``) and
its RSS before the call, and the digest of what it received, which must equal the holder's (a
row whose digest differs fails the bench). Runs are interleaved over ``--repeat``: every run is
reported, and each collective row against the faster torchft transport of the same run; the
floor beside them is this machine's memcpy and xxh3 rates (``floor``).

``--emulate-hosts`` puts every holder and the recovering process on a host of its own
(``collective.bench.emulate``), each holder's link shaped to ``--rate`` both ways; the recovering
host's link is not shaped, so what three holders gain is their three uplinks at once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from collective.errors import UsageError
from collective.sizes import parse_size

MiB = 1 << 20
CHECKOUT = Path(__file__).resolve().parents[2]
STEP = 7
# Each process ends on its own after this long whatever happens (the bench kills it by pid too).
LIFETIME = 900.0
TOKEN = "bench-recovery-token"


@dataclass(frozen=True)
class Candidate:
    name: str
    kind: str  # http0, http8, pg, collective, collective-copy
    holders: int = 1
    path: str = ""  # how the bytes travel on one host (the table's "path")


CANDIDATES = [Candidate("torchft-http", "http0", path="HTTP, 1 connection"),
              Candidate("torchft-http-chunks8", "http8", path="HTTP, 8 connections"),
              Candidate("torchft-pg-gloo", "pg", path="gloo send/recv"),
              # copy=False (the default): served from the holder's own tensors; on one host the
              # raw data path's abstract unix socket (fetch's shm=True finds no sealed copy).
              Candidate("collective-1-holder", "collective", path="stream, unix socket"),
              Candidate("collective-3-holders", "collective", 3, path="stream, unix socket"),
              # copy=True: the holder copies its state into a sealed memfd at send_checkpoint
              # (outside the clock, one more copy of the state in the holder); a same-host
              # fetcher maps it (fetch's shm=True) and checks every chunk instead of receiving.
              Candidate("collective-1-holder-copy", "collective-copy", path="memfd mapped (shm)")]


@dataclass
class Row:
    candidate: Candidate
    seconds: list[float] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)
    base_mib: list[float] = field(default_factory=list)


# --- inside the holder and recovering processes ------------------------------------------------


def build_state(size: int, variables: int):
    """torchft's state dict shape, ``variables`` float32 tensors of ``size`` bytes in all; the
    same values in every process (so three holders hold the same step)."""
    import torch

    per = size // variables // 4
    model = {f"layers.{i}.weight": torch.arange(per, dtype=torch.float32).mul_(1.0 + i / 64)
             for i in range(variables)}
    return {"user": {"default": {"model": model}}, "torchft": {"step": STEP, "batches_committed": 2 * STEP}}


def state_digest(state) -> str:
    from collective.digest import array_digest, combined_digest
    from collective.torch import to_numpy

    model = state["user"]["default"]["model"]
    return combined_digest((k, array_digest(to_numpy(model[k]))) for k in sorted(model))


def _transport(kind: str):
    if kind.startswith("http"):
        from torchft.checkpointing.http_transport import HTTPTransport

        return HTTPTransport(timeout=timedelta(seconds=LIFETIME), num_chunks=int(kind[4:]))
    import collective.torchft

    return collective.torchft.Transport(token=TOKEN, timeout=LIFETIME, copy=kind == "collective-copy")


def _pg(store: str, rank: int):
    from torchft.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=LIFETIME))
    pg.configure(store_addr=f"{store}/recovery", replica_id="0", rank=rank, world_size=2)
    return pg


def holder(args: argparse.Namespace) -> int:
    state = build_state(args.size, args.variables)
    print(f"digest {state_digest(state)}", flush=True)
    if args.kind == "pg":
        import torch
        from torch.distributed import TCPStore
        from torchft.checkpointing.pg_transport import PGTransport

        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=LIFETIME))
        print(f"metadata {os.uname().nodename}:{store.port}", flush=True)
        pg = _pg(f"127.0.0.1:{store.port}", 0)
        PGTransport(pg, timeout=timedelta(seconds=LIFETIME), device=torch.device("cpu")).send_checkpoint(
            [1], STEP, state, timedelta(seconds=LIFETIME))
        _wait_for(args.done)
        return 0
    transport = _transport(args.kind)
    transport.send_checkpoint([1], STEP, state, timedelta(seconds=LIFETIME))
    print(f"metadata {transport.metadata()}", flush=True)
    _wait_for(args.done)
    transport.disallow_checkpoint()
    transport.shutdown()
    return 0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + LIFETIME
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def recover(args: argparse.Namespace) -> int:
    import torch  # noqa: F401 - imported before the baseline RSS, as in a training process

    if args.kind == "pg":
        from torchft.checkpointing.pg_transport import PGTransport

        pg = _pg(args.metadata, 1)
        transport = PGTransport(pg, timeout=timedelta(seconds=LIFETIME), device=torch.device("cpu"))
    else:
        transport = _transport(args.kind)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    state = transport.recv_checkpoint(0, args.metadata, STEP, timedelta(seconds=LIFETIME))
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("result " + json.dumps({"seconds": seconds, "peak_mib": peak, "base_mib": base,
                                  "digest": state_digest(state)}), flush=True)
    return 0


# --- the bench: start processes, collect, print ----------------------------------------------


def _argv(role: str, c: Candidate, size: int, variables: int, done: Path, metadata: str = "") -> list[str]:
    argv = [sys.executable, "-m", "collective.bench.recovery", role, "--kind", c.kind, "--size", str(size),
            "--variables", str(variables), "--done", str(done)]
    return argv + (["--metadata", metadata] if metadata else [])


class _Place:
    """Where processes run: this host, or the hosts of a Topology (holder-1..3, recoverer)."""

    def __init__(self, workdir: Path, rate: str | None) -> None:
        self.workdir, self.topology, self.serial = workdir, None, 0
        if rate is not None:
            from collective.bench.emulate import Topology

            self.topology = Topology(["holder-1", "holder-2", "holder-3", "recoverer"], workdir).__enter__()
            # The holders' links are the bottleneck (three uplinks striped is the point of three
            # holders); the recovering host's own link is left unshaped.
            for host in ("holder-1", "holder-2", "holder-3"):
                self.topology.shape(host, rate)

    def start(self, host: str, argv: list[str]):
        from collective.bench.emulate import Process

        self.serial += 1
        name = f"{self.serial:03d}-{host}"
        if self.topology is not None:
            # The directory holding collective, as emulate.base_env sets it.
            return self.topology.run(host, argv, name=name, env={"PYTHONPATH": str(CHECKOUT)})
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return Process("local", name, argv, env, self.workdir / f"{name}.log", Path.cwd())

    def close(self) -> None:
        if self.topology is not None:
            self.topology.close()


def run_once(place: _Place, c: Candidate, size: int, variables: int) -> dict:
    done = place.workdir / f"done-{place.serial}"
    procs = []
    try:
        holders = [place.start(f"holder-{i + 1}", _argv("holder", c, size, variables, done)) for i in range(c.holders)]
        procs += holders
        meta = [h.wait_for(r"metadata (\S+)", LIFETIME).group(1) for h in holders]
        digests = {h.wait_for(r"digest (\w+)", LIFETIME).group(1) for h in holders}
        rec = place.start("recoverer", _argv("recover", c, size, variables, done, ",".join(meta)))
        procs.append(rec)
        result = json.loads(rec.wait_for(r"result (\{.*\})", LIFETIME).group(1))
        if {result["digest"]} != digests:
            raise UsageError(f"{c.name}: the recovered state's digest {result['digest']} differs from the "
                             f"holders' {sorted(digests)} (logs in {place.workdir})")
        return result
    finally:
        done.touch()
        for p in procs:
            try:
                p.wait(30)
            except AssertionError:
                pass
            p.kill()


def floor(size: int) -> dict[str, float]:
    """This machine's memory rates, the floor of a receive on one host (GiB/s, the best of three
    over ``size`` bytes, at most 256 MiB, pages in place first): ``memcpy`` (one pass that
    writes the bytes: what a socket's copy into the arena is at best) and ``xxh3`` (the check
    of every chunk)."""
    import numpy as np

    from collective.digest import bytes_digest

    n = min(size, 256 * MiB)
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    best = {"memcpy": float("inf"), "xxh3": float("inf")}
    for _ in range(3):
        for name, run in (("memcpy", lambda: np.copyto(dst, src)), ("xxh3", lambda: bytes_digest(memoryview(src)))):
            began = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - began)
    return {name: n / seconds / (1 << 30) for name, seconds in best.items()}


def table(rows: list[Row], size: int, link_seconds: float | None, rates: dict[str, float] | None = None) -> str:
    from collective.bench.spec import aligned

    med = statistics.median

    torchft = [med(r.seconds) for r in rows if not r.candidate.kind.startswith("collective")]
    best = min(torchft) if torchft else None
    one = next((med(r.seconds) for r in rows if r.candidate.kind == "collective" and r.candidate.holders == 1), None)
    head = ["transport", "path", "holders", "median s", "runs s", "x faster torchft", "x 1 holder",
            "peak RSS MiB", "RSS before MiB", "growth MiB", "growth - state MiB"]
    if link_seconds:
        head.append("x S/B")
    out = [head]
    for r in rows:
        s = med(r.seconds)
        growth = max(p - b for p, b in zip(r.peak_mib, r.base_mib, strict=True))
        line = [r.candidate.name, r.candidate.path, str(r.candidate.holders), f"{s:.3f}",
                " ".join(f"{x:.3f}" for x in r.seconds),
                f"{s / best:.2f}" if best else "-",
                f"{s / one:.2f}" if one and r.candidate.kind.startswith("collective") else "-",
                f"{max(r.peak_mib):.0f}", f"{med(r.base_mib):.0f}", f"{growth:.0f}", f"{growth - size / MiB:.0f}"]
        if link_seconds:
            line.append(f"{s / link_seconds:.2f}")
        out.append(line)
    text = aligned(out)
    text.append(f"state: {size / MiB:.0f} MiB; seconds: the recovering process's recv_checkpoint call alone; "
                "RSS: that process's ru_maxrss at the end (peak) and before the call (torch and torchft imported); "
                "growth: peak - before (the largest of the runs)")
    text += per_run(rows)
    if rates:
        text.append(f"floor: memcpy {rates['memcpy']:.2f} GiB/s ({size / MiB / 1024 / rates['memcpy']:.3f} s for the "
                    f"state), xxh3 {rates['xxh3']:.2f} GiB/s ({size / MiB / 1024 / rates['xxh3']:.3f} s)")
    if link_seconds:
        text.append(f"S/B (one link carrying the state once): {link_seconds:.3f} s")
    return "\n".join(text)


def per_run(rows: list[Row]) -> list[str]:
    """Each collective row against the faster torchft transport of the same run (run i of every
    row): the largest of those ratios is what "on every run" asks of it."""
    peers = [r for r in rows if not r.candidate.kind.startswith("collective")]
    if not peers:
        return []
    runs = min(len(r.seconds) for r in rows)
    best = [min(r.seconds[i] for r in peers) for i in range(runs)]
    out = []
    for r in rows:
        if r.candidate.kind.startswith("collective"):
            ratios = [r.seconds[i] / best[i] for i in range(runs)]
            out.append(f"{r.candidate.name}: x the faster torchft of the same run, run by run: "
                       + " ".join(f"{x:.2f}" for x in ratios) + f" (largest {max(ratios):.2f})")
    return out


def run_recovery(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    from collective.bench.spec import _positive

    size, variables = parse_size(args.size), _positive(args.variables, "--variables")
    repeat = _positive(args.repeat, "--repeat")
    for module in ("torch", "torchft"):
        try:
            __import__(module)
        except ImportError:
            raise UsageError(f"--recovery needs {module}: pip install -e '.[torch,torchft]' (make test installs both)") from None
    if size % (4 * variables):
        raise UsageError(f"--size {args.size} is not a multiple of 4 x --variables {variables}")
    rate = (args.rate or "200mbit") if args.emulate_hosts else None
    link_seconds = None
    if rate is not None:
        from collective.bench.spec import parse_rate

        link_seconds = size * 8 / parse_rate(rate)
    workdir = Path(tempfile.mkdtemp(prefix="collective-bench-recovery-"))
    place = _Place(workdir, rate)
    rows = [Row(c) for c in CANDIDATES]
    try:
        for rep in range(repeat):
            for row in rows:
                result = run_once(place, row.candidate, size, variables)
                row.seconds.append(result["seconds"])
                row.peak_mib.append(result["peak_mib"])
                row.base_mib.append(result["base_mib"])
                say(f"{row.candidate.name:<22} run {rep + 1}/{repeat}: {result['seconds']:.3f} s, "
                    f"peak RSS {result['peak_mib']:.0f} MiB (before {result['base_mib']:.0f})")
    finally:
        place.close()
    # After the runs: a process started after this one held the floor's buffers would begin its
    # ru_maxrss at this one's (fork keeps it), and its "RSS before" with it.
    rates = floor(size)
    say(f"floor: memcpy {rates['memcpy']:.2f} GiB/s, xxh3 {rates['xxh3']:.2f} GiB/s")
    print(table(rows, size, link_seconds, rates), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps({"results": [{"name": r.candidate.name, "holders": r.candidate.holders, "bytes": size,
                                       "path": r.candidate.path,
                                       "seconds": round(statistics.median(r.seconds), 6),
                                       "runs": [round(x, 6) for x in r.seconds],
                                       "peak_rss_mib": round(max(r.peak_mib), 1)} for r in rows],
                          "link_seconds": link_seconds, "floor_gib_s": rates}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collective.bench.recovery")
    p.add_argument("role", choices=["holder", "recover"])
    p.add_argument("--kind", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--variables", type=int, required=True)
    p.add_argument("--done", type=Path, required=True)
    p.add_argument("--metadata", default="")
    args = p.parse_args(argv)
    return (holder if args.role == "holder" else recover)(args)


if __name__ == "__main__":
    sys.exit(main())
