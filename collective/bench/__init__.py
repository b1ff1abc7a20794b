"""``collective bench``: time the broadcast phase against bare MPI and gloo broadcasts.

For every configuration (workers N, transport, topology) the bench writes a model spec of K
float32 variables totalling SIZE bytes (seeded ``uniform`` initializers: the chief generates the
values, nothing big is written to disk), runs ``collective launch --workers N --model SPEC --json
--quiet`` as a subprocess R times, and reports the median of the JSON ``seconds``: the broadcast
phase, from the chief's first byte sent until every worker has reported ready with verified
digests. ``--no-shm`` passes ``--no-shm`` to launch (same-host workers then take the bytes over
gRPC too); without it launch's default same-host path is timed. ``--chunk-bytes`` is passed on
to launch (or the chief) as well. Runs are interleaved (run 1 of every candidate, then run 2
...) so a slow spell of the machine does not land on one candidate only. Nothing runs
concurrently.

Peers (``--peers``) move the same SIZE bytes from rank 0 to N receivers:

* ``mpi-bcast``: ``mpiexec -n N+1 python -c <script>``, one ``comm.Bcast`` of a uint8 numpy array
  (split in 1 GiB calls from 2 GiB on), timed from a Barrier before to a Barrier after on every
  rank; the slowest rank counts. One untimed warm-up broadcast, then the median of R.
* ``gloo``: N+1 processes with ``torch.distributed`` (gloo, TCP rendezvous on loopback), one
  ``broadcast`` of a uint8 tensor, timed the same way. Skipped, saying so, without torch.

Every row has a ``path``: ``mapped`` (one host without ``--no-shm``: the workers map the chief's
sealed arena and copy nothing; only their hashing and the ready reports are timed), ``network``
(the bytes are copied over TCP into each worker's own arena: ``--no-shm``, or emulated hosts),
``mpi`` (``--transport mpi``: MPI_Bcast into each rank's arena) and ``peer``. The ``x best peer``
column compares only rows that copy the bytes into every receiver (``network``, ``mpi``) with
the peers, which copy too; a ``mapped`` row gets ``-`` there, since it moves no bytes at all.

What the clock holds (``CLOCK``, printed under the table): for the project, from the chief's
first byte sent until every worker has reported ready: the transfer, every chunk hashed and
checked, the replicas and the ready reports, and on the network path opening the data
connection. Outside it, for the project as for the peers: process start, model generation and
the plan, allocating and touching the receive buffers, the barrier before the first byte. The
peers' connections are open and their buffers warm (an untimed warm-up broadcast), and they
check nothing.

``--emulate-hosts --rate 200mbit`` runs everything on emulated hosts instead (network namespaces
``chief``, ``worker-1`` ... on one bridge, every host's link shaped both ways with ``tc tbf``, a
private ``/dev/shm`` per host; see ``collective.bench.emulate``) and reports ``link_seconds`` = S/B, the
time one link needs to carry the model once. ``--hosts H --workers-per-host K`` (instead of
``--workers``) puts K workers on each of H worker hosts (ranks in host order), the chief alone on
its own host. The chief and workers run as ``python -m collective.chief`` / ``python -m collective.worker`` on their
hosts; ``--transport mpi`` and the MPI peer run through MPICH's
``mpiexec`` with an rsh-like launcher that enters each host (UCX/libfabric forced onto TCP so no
same-machine shortcut bypasses the shaped links). Needs root.

``collective bench sim`` runs no broadcast: it fits the simulator (``sim``) to the emulated runs
and prints the projection (``simreport``).

Its parts: ``spec`` (defaults, option parsers, candidates, the model spec), ``runners`` (one
candidate run, on this host or on emulated hosts), ``fromfile`` and ``checkpoint`` (``--from-file``:
a sharded checkpoint served by a copying chief and from its files), this module (settings, the run, the table and
the plot, the command). It offers ``add_bench_parser(subparsers)`` and ``run_bench(args) -> int`` for
``collective.cli``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from collective.bench.runners import EmulatedRunner, LocalRunner, mpi_problem, torch_gloo_problem
from collective.bench.scale import add_scale_options
from collective.bench.spec import (
    DEFAULT_RATE,
    DEFAULT_REPEAT,
    DEFAULT_SIZE,
    DEFAULT_VARIABLES,
    DEFAULT_WORKERS,
    MAX_EMULATED_WORKERS,
    Candidate,
    _positive,
    aligned,
    candidates,
    parse_list,
    parse_rate,
    parse_workers,
    variable_lengths,
    write_spec,
)
from collective.bench.updates import add_updates_options
from collective.errors import UsageError
from collective.sizes import parse_size  # noqa: F401 - the bench's size parser, for its tests

GiB = 1 << 30
# --- the bench --------------------------------------------------------------------------------


PATHS = {
    "mapped": "shared memory: workers map the chief's arena, no byte is copied (never compared with peers)",
    "network": "copied over a socket into each worker's own arena (raw data path: unix socket on one host, TCP across hosts)",
    "net-tcp": "copied over TCP into each worker's own arena (raw data path, TCP even on one host: --data-path tcp)",
    "net-grpc": "copied over gRPC (FetchRaw) into each worker's own arena (--data-path grpc)",
    "mpi": "MPI_Bcast into each rank's arena",
    "peer": "a bare broadcast of the same bytes, nothing checked",
}
CLOCK = (
    "inside the clock: project rows from the chief's first byte sent until every worker reported ready "
    "(transfer, every chunk hashed and checked, replicas, ready reports); peers from a barrier before to a "
    "barrier after one broadcast. Outside for both: process start, model and plan, allocating and touching "
    "the receive buffers (peers: an untimed warm-up broadcast), the barrier before the first byte."
)


@dataclass
class Result:
    name: str
    workers: int
    bytes: int
    samples: list[float] = field(default_factory=list)
    peer: bool = False  # a peer's samples are its inner repetitions (one process launch)
    path: str = "network"  # a key of PATHS

    @property
    def copies(self) -> bool:
        """Whether every receiver gets its own copy of the bytes (so a peer ratio is fair)."""
        return self.path != "mapped"

    @property
    def seconds(self) -> float:
        return statistics.median(self.samples)


@dataclass
class Settings:
    workers: list[int]
    size: int
    variables: int
    repeat: int
    transports: list[str]
    topologies: list[str]
    peers: bool
    as_json: bool
    plot: Path | None
    emulate: bool
    rate: str | None
    no_shm: bool = False
    chunk_bytes: int | None = None
    workers_per_host: int = 1  # emulated hosts only
    data_path: str | None = None
    queue: str = "100ms"  # emulated links: tbf's latency, how long a packet may wait in a link's queue
    burst: str = "256kb"  # emulated links: tbf's bucket


def settings_from_args(args: argparse.Namespace) -> Settings:
    variables = _positive(args.variables, "--variables")
    size = parse_size(args.size)
    variable_lengths(size, variables)  # size a multiple of 4, enough bytes for every variable
    repeat = _positive(args.repeat, "--repeat")
    hosts, per_host = getattr(args, "hosts", None), getattr(args, "workers_per_host", None)
    if (hosts or per_host) and not args.emulate_hosts:
        raise UsageError("--hosts and --workers-per-host apply to emulated hosts; add --emulate-hosts")
    if hosts and args.workers:
        raise UsageError("give --workers or --hosts (with --workers-per-host), not both")
    per_host = _positive(per_host, "--workers-per-host") if per_host else 1
    if hosts:
        workers = [h * per_host for h in parse_workers(hosts, option="--hosts")]
    else:
        workers = parse_workers(args.workers)
        odd = [n for n in workers if n % per_host]
        if odd:
            raise UsageError(f"--workers {odd[0]} is not a multiple of --workers-per-host {per_host}")
    transports = parse_list(args.transport, "--transport") or ["grpc"]
    for t in transports:
        if t not in ("grpc", "mpi"):
            raise UsageError(f"--transport {t!r} is not one of grpc, mpi")
    topologies = parse_list(args.topology, "--topology")
    if args.rate is not None and not args.emulate_hosts:
        raise UsageError("--rate applies to emulated hosts; add --emulate-hosts")
    rate = (args.rate or DEFAULT_RATE) if args.emulate_hosts else None
    if rate is not None:
        parse_rate(rate)
        if max(workers) // per_host > MAX_EMULATED_WORKERS:
            raise UsageError(f"--emulate-hosts builds at most {MAX_EMULATED_WORKERS} worker hosts, "
                             f"not {max(workers) // per_host}")
    plot = Path(args.plot) if args.plot else None
    data_path = getattr(args, "data_path", None)
    if data_path is not None:
        if data_path not in ("auto", "tcp", "grpc"):
            raise UsageError(f"--data-path {data_path!r} is not one of auto, tcp, grpc")
        if args.emulate_hosts:
            raise UsageError("--data-path applies to one host; emulated hosts always reach each other over TCP")
    return Settings(workers, size, variables, repeat, transports, topologies, bool(args.peers), bool(args.json),
                    plot, bool(args.emulate_hosts), rate, bool(getattr(args, "no_shm", False)),
                    parse_size(args.chunk_bytes, option="--chunk-bytes") if getattr(args, "chunk_bytes", None) else None,
                    per_host, data_path, *_shaping(args))


def _shaping(args: argparse.Namespace) -> tuple[str, str]:
    """``--queue`` and ``--burst`` (emulated hosts only): a tc time such as 100ms, a tc size such
    as 256kb (tbf's latency and bucket)."""
    queue, burst = getattr(args, "queue", None), getattr(args, "burst", None)
    if (queue or burst) and not args.emulate_hosts:
        raise UsageError(f"{'--queue' if queue else '--burst'} applies to emulated hosts; add --emulate-hosts")
    if queue is not None and not re.fullmatch(r"[0-9]+(\.[0-9]+)?(us|ms|s)", queue):
        raise UsageError(f"--queue {queue!r} is not a time such as 100ms or 5ms")
    if burst is not None and not re.fullmatch(r"[0-9]+(kb|mb)", burst):
        raise UsageError(f"--burst {burst!r} is not a size such as 256kb or 1mb")
    return queue or "100ms", burst or "256kb"


def _check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401 - only whether it is there
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None


def _check_emulation_available() -> None:
    from collective.bench.emulate import unavailable_reason

    if os.geteuid() != 0:
        raise UsageError("--emulate-hosts needs root (it creates network namespaces and shapes links with tc)")
    reason = unavailable_reason("--emulate-hosts")
    if reason:
        raise UsageError(reason)
    if shutil.which("tc") is None:
        raise UsageError("--emulate-hosts needs tc (iproute2) on PATH to shape the links")


def run(settings: Settings, say: Callable[[str], None]) -> tuple[list[Result], float | None]:
    """Run every configuration; returns the results and link_seconds (None on one host)."""
    cands = candidates(settings.transports, settings.topologies)
    extra: list[str] = ["--no-shm"] if settings.no_shm else []
    chunk: list[str] = [] if settings.chunk_bytes is None else ["--chunk-bytes", str(settings.chunk_bytes)]
    if any(c.transport == "mpi" for c in cands) and (problem := mpi_problem()):
        raise UsageError(f"--transport mpi: {problem}")
    peers: list[str] = []
    if settings.peers:
        problem = mpi_problem()
        if problem:
            say(f"mpi-bcast: skipped, {problem}")
        else:
            peers.append("mpi-bcast")
        problem = torch_gloo_problem()
        if problem:
            say(f"{problem}; skipped")
        else:
            peers.append("gloo")
    workdir = Path(tempfile.mkdtemp(prefix="collective-bench-"))
    runner: LocalRunner | EmulatedRunner
    if settings.emulate:
        assert settings.rate is not None
        runner = EmulatedRunner(workdir, say, settings.rate, settings.size, extra, chunk, settings.workers_per_host,
                                queue=settings.queue, burst=settings.burst)
    else:
        runner = LocalRunner(workdir, say, extra, chunk, settings.data_path)
    ok = False
    try:
        spec = write_spec(workdir / "model.yaml", settings.size, settings.variables)
        results: list[Result] = []
        for n in settings.workers:
            mine = [Result(c.name, n, settings.size, path=_path(c, settings)) for c in cands]
            for rep in range(settings.repeat):
                for c, r in zip(cands, mine, strict=True):
                    seconds = runner.project(c, n, spec, settings.size)
                    r.samples.append(seconds)
                    say(f"{c.name:<10} {n} worker(s), run {rep + 1}/{settings.repeat}: {seconds:.4f} s")
            results += mine
            for name in peers:
                samples = (runner.mpi_bcast if name == "mpi-bcast" else runner.gloo)(n, settings.size, settings.repeat)
                r = Result(name, n, settings.size, samples, peer=True, path="peer")
                results.append(r)
                say(f"{name:<10} {n} worker(s), median of {len(samples)}: {r.seconds:.4f} s")
        ok = True
        return results, runner.link_seconds
    finally:
        runner.close()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")


def _path(c: Candidate, settings: Settings) -> str:
    """Which data path a project candidate's runs take (see PATHS)."""
    if c.transport == "mpi":
        return "mpi"
    if not (settings.emulate or settings.no_shm):
        return "mapped"
    return {"tcp": "net-tcp", "grpc": "net-grpc"}.get(settings.data_path or "", "network")


def table(results: Sequence[Result], link_seconds: float | None) -> str:
    best_peer: dict[int, float] = {}
    for r in results:
        if r.peer:
            best_peer[r.workers] = min(best_peer.get(r.workers, math.inf), r.seconds)
    head = ["name", "path", "workers", "bytes", "median s", "min-max s", "GiB/s", "x best peer"]
    if link_seconds is not None:
        head.append("x S/B")
    rows = [head]
    for r in results:
        peer = best_peer.get(r.workers) if r.copies else None
        row = [r.name, r.path, str(r.workers), str(r.bytes), f"{r.seconds:.4f}",
               f"{min(r.samples):.4f}-{max(r.samples):.4f}",
               f"{r.bytes / r.seconds / GiB:.3f}" if r.seconds > 0 else "-",
               f"{r.seconds / peer:.2f}" if peer else "-"]
        if link_seconds is not None:
            row.append(f"{r.seconds / link_seconds:.2f}")
        rows.append(row)
    lines = aligned(rows)
    if link_seconds is not None:
        lines.append(f"S/B (one link carrying the model once): {link_seconds:.4f} s")
    for path in dict.fromkeys(r.path for r in results):
        lines.append(f"path {path}: {PATHS[path]}")
    lines.append(CLOCK)
    return "\n".join(lines)


def plot(results: Sequence[Result], link_seconds: float | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(r.name for r in results))
    for name in names:
        pts = sorted((r.workers, r.seconds) for r in results if r.name == name)
        style = "--" if any(r.peer for r in results if r.name == name) else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
    if link_seconds is not None:
        ax.axhline(link_seconds, color="grey", linestyle=":", label="S/B (one link)")
    ax.set_xlabel("workers")
    ax.set_ylabel("broadcast seconds (median)")
    ax.set_xticks(sorted({r.workers for r in results}))
    times = [r.seconds for r in results if r.seconds > 0] + ([link_seconds] if link_seconds else [])
    if times and max(times) / min(times) > 20:
        ax.set_yscale("log")  # a slow path would flatten every other line to the axis
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _human(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def run_bench(args: argparse.Namespace) -> int:
    """``collective bench``: run, then print the table (or one JSON line with --json)."""
    what = getattr(args, "what", None)
    say = lambda line: print(f"bench     | {line}", file=sys.stderr, flush=True)  # noqa: E731
    if what == "sim":
        from collective.bench.simreport import run_sim

        return run_sim(args, say)
    if what == "hops":
        from collective.bench.hops import run_hops

        return run_hops(args, say)
    if what == "scale":
        from collective.bench.scale import run_scale

        return run_scale(args, say)
    if what == "updates":
        from collective.bench.updates import run_updates

        return run_updates(args, say)
    if what is not None:
        raise UsageError(f"collective bench {what!r}: the modes are 'sim' and 'scale' (the simulator, many workers), "
                         "'hops' (a relay's cost per hop) and 'updates' (every-step weight updates), or none, "
                         "to run the benchmark")
    if getattr(args, "from_file", False):
        from collective.bench.fromfile import run_from_file

        return run_from_file(args, lambda line: print(f"bench     | {line}", file=sys.stderr, flush=True))
    if getattr(args, "recovery", False):
        from collective.bench.recovery import run_recovery

        return run_recovery(args, lambda line: print(f"bench     | {line}", file=sys.stderr, flush=True))
    settings = settings_from_args(args)
    if settings.plot is not None:
        _check_plot_available()
    if settings.emulate:
        _check_emulation_available()

    def say(line: str) -> None:
        print(f"bench     | {line}", file=sys.stderr, flush=True)

    results, link_seconds = run(settings, say)
    text = table(results, link_seconds)
    print(text, file=sys.stderr if settings.as_json else sys.stdout, flush=True)
    if settings.plot is not None:
        where = f"emulated hosts, {settings.rate} links" if settings.emulate else "one host"
        plot(results, link_seconds, settings.plot,
             f"{_human(settings.size)} in {settings.variables} variable(s), {where}")
        say(f"plot written to {settings.plot}")
    if settings.as_json:
        print(json.dumps({
            "results": [{"name": r.name, "path": r.path, "workers": r.workers, "bytes": r.bytes,
                         "seconds": round(r.seconds, 6)} for r in results],
            "link_seconds": None if link_seconds is None else round(link_seconds, 6),
            **({"workers_per_host": settings.workers_per_host} if settings.emulate else {}),
        }), flush=True)
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to ``collective``'s subcommands. Values are checked by ``run_bench`` so a bad
    one is reported in one line (exit 2)."""
    p = subparsers.add_parser(
        "bench", help="time the broadcast against bare MPI Bcast and gloo (one host or emulated hosts)",
        description="Time the broadcast phase (first byte sent until every worker is ready) for each "
                    "configuration, median of --repeat runs; with --peers also MPI_Bcast (mpi4py) and "
                    "gloo (torch) moving the same bytes to the same number of receivers.")
    p.add_argument("what", nargs="?", metavar="sim|hops|scale|updates",
                   help="sim: fit the simulator (collective/bench/sim.py) to the emulated runs and project every "
                        "topology to 64, 1,024 and 10,000 hosts (collective/bench/simreport.py); no byte is sent. "
                        "hops: a chain (or --topology dtree) of --workers relays on this host without a control plane, the slope of "
                        "a chunk's arrival over the hops: the relay's own cost per hop (collective/bench/hops.py). "
                        "scale: one chief and many workers, K per process (collective/bench/scale.py): round and "
                        "join-storm seconds, the chief's threads, peak RSS and status latency, plan bytes, "
                        "frozen-worker detection (default --workers 1024). "
                        "updates: every-step weight updates of a bf16 state to live subscribers, collective's delta "
                        "against its full fetch, a gloo broadcast and a sparse safetensors delta file "
                        "(collective/bench/updates.py)")
    p.add_argument("--svg", default=None, metavar="FILE.svg",
                   help="with sim: draw time / (S/B) against hosts, one line per topology, the emulated runs as points")
    p.add_argument("--workers", action="append", metavar="N",
                   help=f"worker count(s): repeatable or a comma list such as 2,4,8 (default {DEFAULT_WORKERS})")
    p.add_argument("--size", default=DEFAULT_SIZE, metavar="BYTES",
                   help=f"model bytes, e.g. 256MiB, 1GiB, 20000KiB (default {DEFAULT_SIZE})")
    p.add_argument("--variables", default=str(DEFAULT_VARIABLES), metavar="K",
                   help=f"float32 variables sharing those bytes (default {DEFAULT_VARIABLES})")
    p.add_argument("--topology", action="append", metavar="NAME",
                   help="topologies to run (repeatable or a comma list; default: every one launch offers)")
    p.add_argument("--transport", action="append", metavar="T",
                   help="grpc, mpi or grpc,mpi (default grpc)")
    p.add_argument("--repeat", default=str(DEFAULT_REPEAT), metavar="R",
                   help=f"runs per configuration; the median counts (default {DEFAULT_REPEAT})")
    p.add_argument("--peers", action="store_true",
                   help="also time mpi4py Bcast (mpi-bcast) and torch.distributed gloo broadcast (if torch is installed)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON line: {"results": [{"name", "path", "workers", "bytes", "seconds"}], "link_seconds"}')
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw time against workers (needs matplotlib)")
    p.add_argument("--chunk-bytes", default=None, metavar="BYTES",
                   help="bytes per data message, passed to launch / the chief (e.g. 1MiB; default: theirs)")
    p.add_argument("--no-shm", action="store_true",
                   help="pass --no-shm to launch: same-host workers take the bytes over the network too "
                        "(default: launch's default)")
    p.add_argument("--data-path", default=None, metavar="PATH",
                   help="one host: the workers' data path, auto (unix socket on one host), tcp (TCP over "
                        "loopback, as containers on one machine get) or grpc (FetchRaw); default auto")
    p.add_argument("--emulate-hosts", action="store_true",
                   help="run on emulated hosts (network namespaces, every link shaped with tc; needs root)")
    p.add_argument("--rate", default=None, metavar="RATE",
                   help=f"link rate of every emulated host, a tc rate (default {DEFAULT_RATE})")
    p.add_argument("--queue", default=None, metavar="TIME",
                   help="how long a packet may wait in an emulated link's queue (tc tbf latency; default 100ms)")
    p.add_argument("--burst", default=None, metavar="SIZE",
                   help="the token bucket of every emulated link (tc tbf burst, e.g. 1mb; default 256kb)")
    p.add_argument("--hosts", action="append", metavar="H",
                   help="emulated worker hosts (repeatable or a comma list; instead of --workers): "
                        "H x --workers-per-host workers, the chief on a host of its own")
    p.add_argument("--workers-per-host", default=None, metavar="K",
                   help="workers on each emulated worker host (default 1)")
    p.add_argument("--from-file", action="store_true",
                   help="instead: a sharded safetensors checkpoint of --size served by a copying chief and by "
                        "--from-file to --workers local workers: read, broadcast and to-ready seconds, the chief's "
                        "peak RSS (collective/bench/fromfile.py)")
    p.add_argument("--recovery", action="store_true",
                   help="instead: a restarted torchft replica takes a --size state dict of --variables tensors from "
                        "live holders: torchft's HTTPTransport (num_chunks 0, 8) and PGTransport (gloo) against "
                        "collective.torchft.Transport from 1 and 3 holders; seconds and peak RSS (collective/bench/recovery.py)")
    p.add_argument("--files", default="4", metavar="F", help="with --from-file: files of the generated checkpoint (default 4)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="with --from-file: serve this checkpoint instead of writing one")
    p.add_argument("--drop-caches", action="store_true",
                   help="with --from-file: drop the page cache before every run (root), so every read is cold")
    add_scale_options(p)
    add_updates_options(p)
    return p
