"""Run an example under a real launcher (torchrun, mpiexec, N plain processes) with a deadline;
on timeout the launcher's whole process group (it was started in its own session) is killed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def free_port_pair() -> int:
    """A port p with p+1 free too (torchrun's store on p, the chief on p+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no pair of free ports")


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> tuple[int, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVE_", "TORCH_DDP_"))}
    # Every rank writes into this one pipe: buffered output makes each `print(..., flush=True)`
    # line one write, so lines of different ranks cannot interleave (unbuffered, the text and
    # its newline are two writes).
    full.pop("PYTHONUNBUFFERED", None)
    full.update({"PYTHONPATH": str(ROOT), **(env or {})})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, cwd=ROOT, env=full, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd[:4]} did not finish within {timeout} s:\n{out}") from None
    return proc.returncode, out


def torchrun(script: str, n: int, env: dict[str, str] | None = None, args: list[str] = ()) -> tuple[int, str]:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()), script, *args], env)


def mpiexec(script: str, n: int, env: dict[str, str] | None = None, args: list[str] = ()) -> tuple[int, str]:
    if MPIEXEC is None:
        raise AssertionError("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    return run([MPIEXEC, "-n", str(n), sys.executable, script, *args], env)


def rank_matches(output: str, pattern: str) -> list[re.Match]:
    """Every ``rank R...`` line matching ``pattern``, in output order."""
    found = []
    # Ranks share one pipe and a launcher may pass their lines on unbuffered: a rank's line can
    # then start in the middle of another's (``... loss 6.6431rank 3/4: ...``: no word boundary
    # before it), so a line is cut again wherever "rank N/" or "rank N:" begins.
    for line in output.splitlines():
        for piece in re.split(r"(?=rank \d+[/:])", line):
            m = re.match(pattern, piece)
            if m:
                found.append(m)
    return found


def rank_lines(output: str, pattern: str) -> dict[int, re.Match]:
    """``rank R...`` lines matching ``pattern`` (which captures ``rank``), by rank (the last one each)."""
    return {int(m["rank"]): m for m in rank_matches(output, pattern)}


def spmd(script: str, n: int, env: dict[str, str] | None = None, timeout: float = 180) -> list[tuple[int, str]]:
    """``n`` plain processes of ``script`` with COLLECTIVE_RANK/WORLD_SIZE/CHIEF set: (exit, output) each."""
    port = free_port_pair()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVE_", "TORCH_DDP_", "JAX_SYNC_", "KERAS_SYNC_"))}
    base.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})})
    procs = []
    try:
        for r in range(n):
            rank_env = {**base, "COLLECTIVE_RANK": str(r), "COLLECTIVE_WORLD_SIZE": str(n),
                        "COLLECTIVE_CHIEF": f"127.0.0.1:{port}"}
            procs.append(subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, text=True, cwd=ROOT, env=rank_env,
                                          start_new_session=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()


def spmd_lines(script: str, n: int, pattern: str, env: dict[str, str] | None = None,
               timeout: float = 180) -> dict[int, re.Match]:
    """Run ``spmd``; every rank must exit 0 and print a line matching ``pattern`` (which captures
    ``rank``). Returns the matches by rank."""
    lines = {}
    for code, out in spmd(script, n, env, timeout=timeout):
        assert code == 0, out
        m = re.search(pattern, out)
        assert m, out
        lines[int(m["rank"])] = m
    return lines
