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
private ``/dev/shm`` per host; see ``tools.bench.emulate``) and reports ``link_seconds`` = S/B, the
time one link needs to carry the model once. ``--hosts H --workers-per-host K`` (instead of
``--workers``) puts K workers on each of H worker hosts (ranks in host order), the chief alone on
its own host. The chief and workers run as ``python -m collective.chief`` / ``python -m collective.worker`` on their
hosts; ``--transport mpi`` and the MPI peer run through MPICH's
``mpiexec`` with an rsh-like launcher that enters each host (UCX/libfabric forced onto TCP so no
same-machine shortcut bypasses the shaped links). Needs root.

The module offers ``add_bench_parser(subparsers)`` and ``run_bench(args) -> int`` for
``collective.cli``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from collective.errors import CollectiveError, UsageError
from collective.sizes import NUMBER_UNIT as _NUMBER_UNIT
from collective.sizes import parse_size
from collective.topology import TOPOLOGIES

GiB = 1 << 30
DEFAULT_WORKERS = "4"
DEFAULT_SIZE = "256MiB"
DEFAULT_VARIABLES = 64
DEFAULT_REPEAT = 3
DEFAULT_RATE = "200mbit"
SPEC_SEED = 7
CHIEF_PORT = 50051
GLOO_PORT = 29500
MAX_EMULATED_WORKERS = 99  # host names worker-1 .. worker-99 (the harness allows 13 characters)


class BenchError(CollectiveError):
    """A benchmark run failed (the message names the configuration and where its logs are)."""


# --- option parsing --------------------------------------------------------------------------

_RATE_UNITS = {  # tc(8) units, in bits per second
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 1 << 10, "mibit": 1 << 20, "gibit": 1 << 30, "tibit": 1 << 40,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
    "kibps": 8 << 10, "mibps": 8 << 20, "gibps": 8 << 30, "tibps": 8 << 40,
}


def parse_rate(text: str) -> float:
    """A tc rate (``200mbit``, ``1gbit``, ``25mbps`` = bytes/s) -> bits per second."""
    m = _NUMBER_UNIT.match(str(text))
    unit = (m.group(2).lower() or "bit") if m else None
    if m is None or unit not in _RATE_UNITS:
        raise UsageError(f"--rate {text!r}: expected a tc rate such as 200mbit, 1gbit or 25mbps (bytes/s)")
    bits = float(m.group(1)) * _RATE_UNITS[unit]
    if not bits >= 8000:
        raise UsageError(f"--rate {text!r} is too slow to measure anything; use at least 8kbit")
    return bits


def _positive(text: str, option: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a whole number") from None
    if value < 1:
        raise UsageError(f"{option} must be at least 1, got {value}")
    return value


def parse_workers(values: Sequence[str] | None, *, option: str = "--workers") -> list[int]:
    """``--workers 2 --workers 4,8`` -> [2, 4, 8] (sorted, no duplicates); ``--hosts`` alike."""
    out: set[int] = set()
    for value in values or [DEFAULT_WORKERS]:
        parts = [p for p in str(value).split(",")]
        if not all(p.strip() for p in parts):
            raise UsageError(f"{option} {value!r}: expected a number or a comma list such as 2,4,8")
        out.update(_positive(p, option) for p in parts)
    return sorted(out)


def parse_list(values: Sequence[str] | None, option: str) -> list[str]:
    """Repeatable, comma-separated option values, in order, without duplicates."""
    out: list[str] = []
    for value in values or []:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                raise UsageError(f"{option} {value!r}: empty name in the comma list")
            if part not in out:
                out.append(part)
    return out


@dataclass(frozen=True)
class Candidate:
    """One way of the project's to broadcast: a reported name, a transport and a topology to pass."""

    name: str
    transport: str  # grpc | mpi
    topology: str | None = None  # value for --topology, None: pass none


def candidates(transports: Sequence[str], topologies: Sequence[str]) -> list[Candidate]:
    """The project candidates to run: every requested topology (default: every one but
    ``auto``) on gRPC, and ``mpi`` for ``--transport mpi``."""
    out: list[Candidate] = []
    for t in transports:
        if t not in ("grpc", "mpi"):
            raise UsageError(f"--transport {t!r} is not one of grpc, mpi")
    if "grpc" in transports:
        for name in topologies or [c for c in TOPOLOGIES if c != "auto"]:
            if name not in TOPOLOGIES:
                raise UsageError(f"unknown topology {name!r}; use one of: {', '.join(TOPOLOGIES)}")
            out.append(Candidate(name, "grpc", name))
    elif topologies:
        raise UsageError("--topology applies to the grpc transport; add --transport grpc")
    if "mpi" in transports:
        out.append(Candidate("mpi", "mpi"))
    return out


# --- the model ---------------------------------------------------------------------------------


def variable_lengths(size: int, variables: int) -> list[int]:
    """float32 element counts of ``variables`` variables totalling ``size`` bytes; whole 16-element
    (64-byte) blocks first, so no alignment padding appears in the arena when size allows."""
    if size % 4:
        raise UsageError(f"--size {size} is not a multiple of 4: the model is float32 variables")
    elements = size // 4
    if variables > elements:
        raise UsageError(f"--variables {variables} do not fit {size} bytes (at least 4 bytes each)")
    blocks, extra = divmod(elements, 16)
    if blocks >= variables:
        base, rest = divmod(blocks, variables)
        lengths = [16 * (base + (i < rest)) for i in range(variables)]
        lengths[-1] += extra
    else:
        base, rest = divmod(elements, variables)
        lengths = [base + (i < rest) for i in range(variables)]
    assert sum(lengths) * 4 == size and min(lengths) > 0
    return lengths


def write_spec(path: Path, size: int, variables: int, seed: int = SPEC_SEED) -> Path:
    """A YAML initializer spec of float32 variables ``v00000``... totalling ``size`` bytes."""
    width = max(5, len(str(variables - 1)))
    lines = [f"seed: {seed}", "variables:"]
    for i, n in enumerate(variable_lengths(size, variables)):
        lines.append(f"  - {{name: v{i:0{width}d}, shape: [{n}], dtype: float32, initializer: uniform}}")
    path.write_text("\n".join(lines) + "\n")
    return path


# --- peers ----------------------------------------------------------------------------------------

MPI_BCAST_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np
from mpi4py import MPI

size, repeat = int(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
buf = np.empty(size, dtype=np.uint8)
if comm.rank == 0:
    buf[:] = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)
STEP = 1 << 30

def bcast():
    if size < (1 << 31):
        comm.Bcast(buf, root=0)
    else:
        for off in range(0, size, STEP):
            comm.Bcast(buf[off:off + STEP], root=0)

times = []
for i in range(repeat + 1):  # the first one is an untimed warm-up
    comm.Barrier()
    t0 = time.perf_counter()
    bcast()
    comm.Barrier()
    worst = comm.reduce(time.perf_counter() - t0, op=MPI.MAX, root=0)
    if i and comm.rank == 0:
        times.append(worst)
if comm.rank == 0:
    print(json.dumps({"seconds": statistics.median(times), "samples": times, "bytes": size,
                      "ranks": comm.size}), flush=True)
"""

GLOO_SCRIPT = r"""
import json, statistics, sys, time
import torch
import torch.distributed as dist

rank, world, addr, port, size, repeat = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                          int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
t = torch.empty(size, dtype=torch.uint8)
if rank == 0:
    t.random_(0, 256, generator=torch.Generator().manual_seed(0))
times = []
for i in range(repeat + 1):  # the first one is an untimed warm-up
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(t, src=0)
    dist.barrier()
    worst = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if i:
        times.append(float(worst.item()))
dist.destroy_process_group()
if rank == 0:
    print(json.dumps({"seconds": statistics.median(times), "samples": times, "bytes": size,
                      "ranks": world}), flush=True)
"""

_TORCH_PROBE = (
    "import torch.distributed as d, sys; "
    "sys.exit(0 if d.is_available() and d.is_gloo_available() else 3)"
)


def torch_gloo_problem() -> str | None:
    """Why the gloo peer cannot run here (checked in a subprocess: importing torch is slow and
    heavy), or None when it can."""
    try:
        proc = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL, env=_clean_env())
    except subprocess.TimeoutExpired:
        return "gloo: importing torch took over 120 s"
    if proc.returncode == 0:
        return None
    if "ModuleNotFoundError" in proc.stderr:
        return "gloo: torch not installed"
    if proc.returncode == 3:
        return "gloo: this torch build has no gloo backend"
    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return f"gloo: importing torch failed ({last})"


def mpiexec_path() -> str | None:
    here = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    return here or shutil.which("mpiexec")


def mpi_problem() -> str | None:
    """Why MPI runs (``--transport mpi``, the mpi-bcast peer) cannot happen here, or None."""
    if mpiexec_path() is None:
        return "mpiexec not found: install the mpi extra (pip install 'collective[mpi]')"
    try:
        import mpi4py  # noqa: F401 - only whether it is there
    except ImportError:
        return "mpi4py not installed: install the mpi extra (pip install 'collective[mpi]')"
    return None


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without COLLECTIVE_* (and other launchers') settings, which
    would change what a launch does."""
    drop = ("TF_CONFIG", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_") and k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_json(text: str, key: str) -> dict | None:
    """The last JSON object in ``text`` that starts with ``{"key"``, also when another process's
    log line was glued to the same line (mpiexec merges the ranks' streams)."""
    decoder = json.JSONDecoder()
    marker = '{"' + key + '"'
    pos = text.rfind(marker)
    while pos >= 0:
        try:
            obj, _ = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            return obj
        pos = text.rfind(marker, 0, pos)
    return None


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(ln.strip() for ln in text.strip().splitlines()[-lines:] if ln.strip())


def _run_job(argv: list[str], *, timeout: float, env: dict[str, str], log: Path) -> tuple[int, str]:
    """Run ``argv`` to the end with its output in ``log``; on timeout interrupt it (SIGINT, so a
    launcher stops its own children), then kill it, by pid."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            raise BenchError(f"{Path(argv[0]).name} did not finish within {timeout:g} s; its output is in {log}") from None
        except BaseException:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            raise
    return rc, log.read_text(errors="replace")


# --- the local (one host) runs ---------------------------------------------------------------


def _timeout(size: int, workers: int, bits_per_second: float) -> float:
    """Generous: a broken run fails in minutes, a slow but healthy one is never cut."""
    return 180.0 + 3.0 * size * 8 * max(1, workers) / bits_per_second


class LocalRunner:
    """Everything on this machine: ``collective launch`` and the peers on loopback."""

    link_seconds = None

    def __init__(self, workdir: Path, say: Callable[[str], None], extra: Sequence[str] = (),
                 chunk: Sequence[str] = (), data_path: str | None = None) -> None:
        self.workdir, self.say = workdir, say
        self.env = {"COLLECTIVE_DATA_PATH": data_path} if data_path else {}
        self.extra = list(extra)  # more launch options (--no-shm), for the grpc transport
        self.chunk = list(chunk)  # --chunk-bytes N, for every transport
        self._serial = 0

    def close(self) -> None:
        pass

    def project(self, c: Candidate, workers: int, spec: Path, size: int) -> float:
        self._serial += 1
        run_dir = self.workdir / f"run-{self._serial:03d}-{c.name}-{workers}w"
        argv = [sys.executable, "-m", "collective.cli", "launch", "--workers", str(workers), "--model", str(spec),
                "--json", "--quiet", "--transport", c.transport, "--run-dir", str(run_dir)]
        if c.topology is not None:
            argv += ["--topology", c.topology]
        if c.transport == "grpc":
            argv += self.extra
        argv += self.chunk
        run_dir.mkdir(parents=True)
        rc, out = _run_job(argv, timeout=_timeout(size, workers, 2e9), env=_clean_env(self.env), log=run_dir / "bench.log")
        result = _last_json(out, "ok")
        if rc != 0 or not result or not result.get("ok"):
            why = (result or {}).get("error") or _tail(out)
            raise BenchError(f"{c.name} with {workers} worker(s) failed (exit {rc}): {why}; logs in {run_dir}")
        _check_bytes(c.name, result, size, run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        return float(result["seconds"])

    def mpi_bcast(self, workers: int, size: int, repeat: int) -> list[float]:
        argv = [mpiexec_path() or "mpiexec", "-n", str(workers + 1), sys.executable, "-c", MPI_BCAST_SCRIPT,
                str(size), str(repeat)]
        return self._peer("mpi-bcast", workers, argv, size, repeat)

    def gloo(self, workers: int, size: int, repeat: int) -> list[float]:
        port = _free_port()
        env = _clean_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
        logs = [self.workdir / f"gloo-{workers}w-rank{r}.log" for r in range(workers + 1)]
        procs = []
        try:
            for r in range(workers + 1):
                with open(logs[r], "w") as fh:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-c", GLOO_SCRIPT, str(r), str(workers + 1), "127.0.0.1", str(port),
                         str(size), str(repeat)],
                        stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
            deadline = time.monotonic() + _timeout(size, workers, 1e9) * (repeat + 1)
            for p in procs:
                p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise BenchError(f"gloo with {workers} worker(s) did not finish in time; logs in {self.workdir}") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        out = logs[0].read_text(errors="replace")
        result = _last_json(out, "seconds")
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad or result is None:
            rank = bad[0] if bad else 0
            raise BenchError(f"gloo with {workers} worker(s): rank {rank} failed: "
                             f"{_tail(logs[rank].read_text(errors='replace'))}; logs in {logs[rank]}")
        return _samples(result)

    def _peer(self, name: str, workers: int, argv: list[str], size: int, repeat: int) -> list[float]:
        log = self.workdir / f"{name}-{workers}w.log"
        rc, out = _run_job(argv, timeout=_timeout(size, workers, 1e9) * (repeat + 1), env=_clean_env(), log=log)
        result = _last_json(out, "seconds")
        if rc != 0 or result is None:
            raise BenchError(f"{name} with {workers} worker(s) failed (exit {rc}): {_tail(out)}; log in {log}")
        return _samples(result)


def _check_bytes(name: str, result: dict, size: int, where: Path) -> None:
    # The arena pads each variable to 64 bytes; the spec's lengths avoid padding when they can.
    got = int(result.get("bytes", -1))
    if not size <= got < size + 64 * max(1, len(result.get("variables") or [None])):
        raise BenchError(f"{name}: the round moved {got} bytes, not the {size} asked for; logs in {where}")


# --- emulated hosts -----------------------------------------------------------------------------

# MPICH's UCX (and libfabric) would see that every emulated host is the same machine and move the
# bytes through shared memory or process_vm_readv: force them onto TCP over the shaped eth0.
_MPI_TCP_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp",
                "MPIR_CVAR_CH4_NOLOCAL": "1"}


class EmulatedRunner:
    """Hosts ``chief``, ``worker-1``..``worker-H`` in network namespaces, every link shaped to
    ``rate`` both ways; ``per_host`` workers on each worker host (ranks in host order: ranks
    0..K-1 on worker-1 ...), the chief alone on its host. One network per host count, rebuilt
    when the count changes."""

    def __init__(self, workdir: Path, say: Callable[[str], None], rate: str, size: int,
                 extra: Sequence[str] = (), chunk: Sequence[str] = (), per_host: int = 1) -> None:
        self.workdir, self.say, self.rate = workdir, say, rate
        self.per_host = per_host
        self.extra = list(extra)  # more chief and worker options (--no-shm)
        self.chunk = list(chunk)  # --chunk-bytes N for the chief (gRPC) or rank 0 (MPI)
        self.bits = parse_rate(rate)
        self.link_seconds = size * 8 / self.bits
        self.net = None
        self.workers = 0
        self._serial = 0

    def _hosts(self, workers: int) -> list[str]:
        return ["chief", *dict.fromkeys(self.placement(workers))]

    def placement(self, workers: int) -> list[str]:
        """The host of every worker rank."""
        return [f"worker-{r // self.per_host + 1}" for r in range(workers)]

    def _network(self, workers: int):
        from tools.bench.emulate import Topology

        hosts = self._hosts(workers)
        if self.net is not None and self.workers == workers:
            return self.net
        self.close()
        net = Topology(hosts, self.workdir / f"net-{workers}w")
        net.__enter__()
        self.net, self.workers = net, workers
        for host in net.hosts:
            net.shape(host, self.rate)
        self.rsh = net.write_rsh(net.workdir / "rsh")
        self.say(f"emulated network: chief + {len(hosts) - 1} worker host(s) x {self.per_host} worker(s), "
                 f"every link {self.rate} both ways")
        return net

    def close(self) -> None:
        if self.net is not None:
            net, self.net = self.net, None
            net.close()

    def _timeout(self, size: int, workers: int) -> float:
        return _timeout(size, workers, self.bits)

    def project(self, c: Candidate, workers: int, spec: Path, size: int) -> float:
        if c.transport == "mpi":
            return self._project_mpi(c, workers, spec, size)
        from tools.bench.emulate import HostProcessError, wait_all

        net = self._network(workers)
        self._serial += 1
        tag = f"{self._serial:03d}-{c.name}"
        result_file = net.workdir / f"result-{tag}.json"
        env = {"COLLECTIVE_TOKEN": secrets.token_hex(16)}
        chief_argv = ["python", "-m", "collective.chief", "--workers", str(workers), "--model", str(spec),
                      "--bind", f"0.0.0.0:{CHIEF_PORT}", "--result-file", str(result_file)]
        if c.topology is not None:
            chief_argv += ["--topology", c.topology]
        chief_argv += self.extra + self.chunk
        chief = net.run("chief", chief_argv, env=env, name=f"chief-{tag}")
        procs = [chief]
        try:
            chief.wait_for("serving on", 120)
            procs += [
                net.run(h, ["python", "-m", "collective.worker", "--chief", f"chief:{CHIEF_PORT}", "--worker-id", f"{h}-{i}",
                            "--rank", str(i), *self.extra], env=env, name=f"{h}-{i}-{tag}")
                for i, h in enumerate(self.placement(workers))
            ]
            codes = wait_all(procs, self._timeout(size, workers))
        except HostProcessError as exc:
            _kill(procs)
            raise BenchError(f"{c.name} with {workers} emulated worker host(s): {_tail(str(exc), 3)}; "
                             f"logs in {net.workdir}") from None
        except BaseException:
            _kill(procs)
            raise
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        why = result.get("error") or _tail(chief.output())
        _kill(procs)  # all have exited: this closes their logs
        if any(codes.values()) or not result.get("ok"):
            raise BenchError(f"{c.name} with {workers} emulated worker host(s) failed (exit codes {codes}): {why}; "
                             f"logs in {net.workdir}")
        _check_bytes(c.name, result, size, net.workdir)
        return float(result["seconds"])

    def _mpiexec(self, workers: int, argv: list[str], name: str, timeout: float, env: dict[str, str] | None = None) -> str:
        from tools.bench.emulate import HostProcessError, wait_all

        net = self._network(workers)
        self._serial += 1
        hosts = ",".join(f"{h}:{1 if h == 'chief' else self.per_host}" for h in self._hosts(workers))
        full = [mpiexec_path() or "mpiexec", "-launcher", "rsh", "-launcher-exec", str(self.rsh),
                "-hosts", hosts, "-n", str(workers + 1), *argv]
        p = net.run("chief", full, env=_MPI_TCP_ENV | (env or {}), name=f"{self._serial:03d}-{name}")
        try:
            code = wait_all([p], timeout)[p.name]
        except HostProcessError as exc:
            _kill([p])
            raise BenchError(f"{name} with {workers} emulated worker host(s): {_tail(str(exc), 3)}; "
                             f"log in {p.log}") from None
        except BaseException:
            _kill([p])
            raise
        out = p.output()
        _kill([p])
        if code != 0:
            raise BenchError(f"{name} with {workers} emulated worker host(s) failed (exit {code}): {_tail(out)}; "
                             f"log in {p.log}")
        return out

    def _project_mpi(self, c: Candidate, workers: int, spec: Path, size: int) -> float:
        out = self._mpiexec(workers, [sys.executable, "-m", "collective.mpi", "--json", "--model", str(spec), *self.chunk], c.name,
                            self._timeout(size, workers), env={"COLLECTIVE_TOKEN": secrets.token_hex(16)})
        result = _last_json(out, "ok")
        if not result or not result.get("ok"):
            raise BenchError(f"{c.name} with {workers} emulated worker host(s) failed: "
                             f"{(result or {}).get('error') or _tail(out)}")
        _check_bytes(c.name, result, size, self.workdir)
        return float(result["seconds"])

    def mpi_bcast(self, workers: int, size: int, repeat: int) -> list[float]:
        out = self._mpiexec(workers, [sys.executable, "-c", MPI_BCAST_SCRIPT, str(size), str(repeat)], "mpi-bcast",
                            self._timeout(size, workers) * (repeat + 1))
        result = _last_json(out, "seconds")
        if result is None:
            raise BenchError(f"mpi-bcast with {workers} emulated worker host(s) printed no result: {_tail(out)}")
        return _samples(result)

    def gloo(self, workers: int, size: int, repeat: int) -> list[float]:
        from tools.bench.emulate import HostProcessError, wait_all

        net = self._network(workers)
        self._serial += 1
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
        procs = [
            net.run(h, ["python", "-c", GLOO_SCRIPT, str(r), str(workers + 1), "chief", str(GLOO_PORT), str(size),
                        str(repeat)], env=env, name=f"{self._serial:03d}-gloo-rank{r}")
            for r, h in enumerate(["chief", *self.placement(workers)])
        ]
        try:
            codes = wait_all(procs, self._timeout(size, workers) * (repeat + 1))
        except HostProcessError as exc:
            _kill(procs)
            raise BenchError(f"gloo with {workers} emulated worker host(s): {_tail(str(exc), 3)}") from None
        except BaseException:
            _kill(procs)
            raise
        outputs = {p.name: p.output() for p in procs}
        _kill(procs)
        result = _last_json(outputs[procs[0].name], "seconds")
        bad = [p for p in procs if codes[p.name] != 0]
        if bad or result is None:
            p = bad[0] if bad else procs[0]
            raise BenchError(f"gloo with {workers} emulated worker host(s): {p.name} failed: {_tail(outputs[p.name])}; "
                             f"log in {p.log}")
        return _samples(result)


def _samples(result: dict) -> list[float]:
    """A peer's timed repetitions (their median is the peer's figure)."""
    return [float(x) for x in result.get("samples") or [result["seconds"]]]


def _kill(procs) -> None:
    """Kill (by pid) those still running and close every one's log."""
    for p in procs:
        p.kill()


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
                    per_host, data_path)


def _check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401 - only whether it is there
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None


def _check_emulation_available() -> None:
    from tools.bench.emulate import unavailable_reason

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
        runner = EmulatedRunner(workdir, say, settings.rate, settings.size, extra, chunk, settings.workers_per_host)
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
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
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
    p.add_argument("--hosts", action="append", metavar="H",
                   help="emulated worker hosts (repeatable or a comma list; instead of --workers): "
                        "H x --workers-per-host workers, the chief on a host of its own")
    p.add_argument("--workers-per-host", default=None, metavar="K",
                   help="workers on each emulated worker host (default 1)")
    return p
