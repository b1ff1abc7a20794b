"""`collective bench --emulate-hosts --hosts H --workers-per-host K`: K workers on each of H
emulated worker hosts, the chief on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collective.bench import EmulatedRunner

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    return subprocess.run([sys.executable, "-m", "collective.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, says", [
    (["--hosts", "2"], "add --emulate-hosts"),
    (["--emulate-hosts", "--hosts", "2", "--workers", "4"], "not both"),
    (["--emulate-hosts", "--workers", "3", "--workers-per-host", "2"], "not a multiple of --workers-per-host 2"),
    (["--emulate-hosts", "--hosts", "0"], "--hosts must be at least 1"),
    (["--emulate-hosts", "--hosts", "2", "--workers-per-host", "0"], "--workers-per-host must be at least 1"),
    (["--emulate-hosts", "--hosts", "100"], "at most 99 worker hosts, not 100"),
])
def test_bad_host_options_exit_2_with_one_line(args, says):
    proc = bench(*args, "--size", "1MiB", "--json", timeout=30)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_ranks_fill_each_host_in_turn_and_the_chief_has_its_own():
    runner = EmulatedRunner(Path("."), print, "1gbit", 1 << 20, per_host=3)
    assert runner.placement(7) == ["worker-1"] * 3 + ["worker-2"] * 3 + ["worker-3"]
    assert runner._hosts(7) == ["chief", "worker-1", "worker-2", "worker-3"]


@pytest.mark.multihost
@pytest.mark.timeout(300)
def test_two_hosts_of_two_workers_run_with_the_asked_workers_and_hosts(namespaces):
    proc = bench("--emulate-hosts", "--rate", "1gbit", "--hosts", "2", "--workers-per-host", "2", "--size", "4MiB",
                 "--variables", "4", "--repeat", "1", "--topology", "auto", "--json", timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["workers_per_host"] == 2 and [r["workers"] for r in out["results"]] == [4]
    assert "chief + 2 worker host(s) x 2 worker(s)" in proc.stderr
    assert out["results"][0]["seconds"] > 0
