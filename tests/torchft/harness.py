"""torchft's lighthouse and replica groups as real processes for the recovery tests; every one has
a deadline and is killed by pid when the test ends."""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

from tests.procs import Proc, wait_for

STEP = re.compile(r"replica (?P<rid>\S+) step (?P<step>\d+) participants (?P<n>\d+) digest (?P<digest>\w+)")


def lighthouse_script() -> str:
    """torchft's ``torchft_lighthouse`` entry point (a Python script beside this interpreter)."""
    path = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if path is None:
        raise AssertionError("torchft_lighthouse not found beside this Python: `make test` installs torchft")
    return path


class Job:
    """A lighthouse and the replica groups started against it (``python -m tests.torchft.replica``)."""

    def __init__(self, tmp: Path, transport: str, env: dict[str, str] | None = None) -> None:
        self.tmp, self.transport, self.env = tmp, transport, env or {}
        self.stop_file = tmp / "stop"
        self.procs: list[Proc] = []
        # Two groups in every quorum: the first one has both at step 0 (init_sync), and after a
        # kill the survivor waits for the restarted group. A killed group leaves within 1.5 s.
        self.lighthouse = self._start(
            [lighthouse_script(), "--bind", "127.0.0.1:0", "--min_replicas", "2", "--join_timeout_ms", "1000",
             "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1500"], "lighthouse")
        wait_for(self.lighthouse, "Lighthouse listening on", timeout=30)
        port = re.search(r"Lighthouse listening on: \S+:(\d+)", self.lighthouse.output()).group(1)
        self.address = f"127.0.0.1:{port}"

    def _start(self, args: list[str], name: str, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, self.tmp / f"{name}.log", env={**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def replica(self, rid: str, seed: int, transport: str | None = None, env: dict[str, str] | None = None) -> Proc:
        return self._start(["-m", "tests.torchft.replica", "--lighthouse", self.address, "--replica-id", rid,
                            "--seed", str(seed), "--transport", transport or self.transport,
                            "--stop-file", str(self.stop_file)], f"replica-{rid}", env)

    @staticmethod
    def steps(proc: Proc) -> dict[int, tuple[int, str]]:
        """step -> (participants, digest) as the replica printed them (the last line of a step)."""
        return {int(m["step"]): (int(m["n"]), m["digest"]) for m in STEP.finditer(proc.output())}

    def wait_steps(self, proc: Proc, what, timeout: float = 90.0) -> dict[int, tuple[int, str]]:
        """Wait until ``what(steps)`` holds for the replica's printed steps; fail if it exits first."""
        deadline = time.monotonic() + timeout
        while not what(self.steps(proc)):
            if time.monotonic() > deadline or proc.proc.poll() is not None:
                raise AssertionError(f"condition not met within {timeout} s (exit {proc.proc.poll()}):\n"
                                     f"{proc.output()[-6000:]}\nlighthouse:\n{self.lighthouse.output()[-2000:]}")
            time.sleep(0.05)
        return self.steps(proc)

    def stop_at(self, step: int, *procs: Proc, timeout: float = 60.0) -> None:
        """Every group ends at ``step``; each must exit 0."""
        self.stop_file.write_text(str(step))
        for proc in procs:
            code = proc.wait(timeout)
            assert code == 0, proc.output()[-6000:]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
