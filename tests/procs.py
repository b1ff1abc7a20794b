"""Real processes for integration tests: started with a deadline, always killed by process id."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# Starts the command after it with SIGINT ignored, as a shell starts a background job; an
# ignored disposition survives exec. (Not a preexec_fn: forking a process that holds grpc's
# threads runs its at-fork handlers, whose warnings the suite treats as errors.)
SIGINT_IGNORED = ["-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


def file_limit(soft: int, hard: int) -> list[str]:
    """An exec wrapper like SIGINT_IGNORED: the command after it starts with RLIMIT_NOFILE
    (soft, hard), as under a shell's ``ulimit -n``."""
    return _rlimit("RLIMIT_NOFILE", soft, hard)


def memory_limit(nbytes: int) -> list[str]:
    """An exec wrapper: the command after it starts with RLIMIT_AS ``nbytes`` (``ulimit -v``), so
    a process that would take more gets a MemoryError instead of the machine's memory."""
    return _rlimit("RLIMIT_AS", nbytes, nbytes)


def _rlimit(name: str, soft: int, hard: int) -> list[str]:
    return ["-c", f"import os, resource, sys; resource.setrlimit(resource.{name}, ({soft}, {hard})); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


class Proc:
    """A child process whose combined output goes to a file; killed by pid when closed."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None,
                 sigint_ignored: bool = False, wrapper: list[str] | None = None,
                 launcher: list[str] | None = None) -> None:
        """``sigint_ignored``: start it as a shell starts a background job (``cmd &`` in a
        script, as CI runs): SIGINT inherited as SIG_IGN, which Python keeps unless told.
        ``wrapper``: another exec wrapper to start it through (``file_limit``). ``launcher``:
        what runs the Python process (``mpiexec -n 3``); its pid is the one signalled and killed."""
        if sigint_ignored:
            wrapper = SIGINT_IGNORED
        self.log = log
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        self._fh = open(log, "w")
        self.proc = subprocess.Popen(
            [*(launcher or []), sys.executable, *(wrapper or []), *args], stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, cwd=ROOT, start_new_session=True,
        )
        self.pid = self.proc.pid

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        self._fh.flush()
        return self.log.read_text()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._fh.close()


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds, as /proc/net/* tables name them."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def files_open_in(pid: int, folder: Path) -> list[str]:
    """What process ``pid`` holds open in ``folder``, as /proc/PID/fd names it: an unnamed file
    (O_TMPFILE) shows as ``FOLDER/#INODE (deleted)``, so it is seen before it has a name."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{folder}/"):
            found.append(target)
    return found


def wait_for_file(path: Path, proc: Proc, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        if proc.proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.proc.returncode} before writing {path}:\n{proc.output()}")
        time.sleep(0.02)
    raise AssertionError(f"{path} not written within {timeout} s:\n{proc.output()}")


def wait_until(predicate, what: str, timeout: float = 20.0) -> None:
    """Wait for ``predicate()``; fail naming ``what`` when the time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout:g} s")
        time.sleep(0.02)


def wait_for(proc: Proc, text: str, timeout: float = 30.0) -> None:
    """Wait until ``text`` is in the output of ``proc``; fail if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while text not in proc.output():
        if time.monotonic() > deadline or proc.proc.poll() is not None:
            raise AssertionError(f"{text!r} not seen; output so far:\n{proc.output()}")
        time.sleep(0.02)


def error_line(output: str, marker: str = " ERROR ") -> str:
    """The last log line holding ``marker``: where a culprit must be named (not in a join line)."""
    lines = [ln for ln in output.splitlines() if marker in ln]
    if not lines:
        raise AssertionError(f"no line with {marker!r}; output:\n{output}")
    return lines[-1]


def run_all(argv: list[str], logs: list[Path], envs: list[dict[str, str]], timeout: float) -> tuple[list[int], list[str]]:
    """Start one process of ``argv`` per (log, env), wait for each within ``timeout`` and kill
    every one of them (by pid) whatever happens: their exit codes and outputs, in order."""
    procs = [Proc(argv, log, env=env) for log, env in zip(logs, envs, strict=True)]
    try:
        codes = [p.wait(timeout) for p in procs]
        return codes, [p.output() for p in procs]
    finally:
        for p in procs:
            p.kill()


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it (a launcher's proxies and ranks: MPICH's
    proxies start sessions of their own, so no process group holds them all)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            continue  # gone meanwhile
    return found


def kill_tree(proc: Proc) -> None:
    """Kill ``proc`` and every process it started, each by its pid (the tree is read first:
    once the launcher is gone its children are no longer found under it)."""
    for pid in reversed(process_tree(proc.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.kill()


def start_holder(tmp_path, started: list, module: str, args, token: str):
    """A holder process (``python -m module``, e.g. tests.snapshot_holder) named h0, h1, ... in
    the order of ``started``, to which it is added (the caller kills them by pid): (its address,
    the digests it wrote of its state, its Proc)."""
    import json

    folder = tmp_path / f"holder{len(started)}"
    folder.mkdir()
    addr_file = folder / "address"
    proc = Proc(["-m", module, "--address-file", str(addr_file), "--name", f"h{len(started)}", *args],
                folder / "log", env={"COLLECTIVE_TOKEN": token})
    started.append(proc)
    address = wait_for_file(addr_file, proc, timeout=60)
    return address, json.loads((folder / "state_digests.json").read_text()), proc
