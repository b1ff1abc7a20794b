"""Running one bench candidate: ``LocalRunner`` (``collective launch`` on this host, the MPI and
gloo peers) and ``EmulatedRunner`` (the same on emulated hosts, ``collective.bench.emulate``)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from collective.bench.spec import CHIEF_PORT, GLOO_PORT, BenchError, Candidate, parse_rate

GiB = 1 << 30

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
        run_dir.mkdir(parents=True, mode=0o700)  # launch refuses a run dir others may write (umask 002)
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
                 extra: Sequence[str] = (), chunk: Sequence[str] = (), per_host: int = 1,
                 queue: str = "100ms", burst: str = "256kb") -> None:
        self.workdir, self.say, self.rate = workdir, say, rate
        self.queue, self.burst = queue, burst  # a shaped link's tbf latency and bucket
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
        from collective.bench.emulate import Topology

        hosts = self._hosts(workers)
        if self.net is not None and self.workers == workers:
            return self.net
        self.close()
        net = Topology(hosts, self.workdir / f"net-{workers}w")
        net.__enter__()
        self.net, self.workers = net, workers
        for host in net.hosts:
            net.shape(host, self.rate, queue=self.queue, burst=self.burst)
        self.rsh = net.write_rsh(net.workdir / "rsh")
        self.say(f"emulated network: chief + {len(hosts) - 1} worker host(s) x {self.per_host} worker(s), "
                 f"every link {self.rate} both ways, queue {self.queue}, bucket {self.burst}")
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
        from collective.bench.emulate import HostProcessError, wait_all

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
        from collective.bench.emulate import HostProcessError, wait_all

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
        from collective.bench.emulate import HostProcessError, wait_all

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


