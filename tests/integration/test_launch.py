"""`collective launch`: the embedded default, its failures, and its clean-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.integration


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_launch_prints_the_summary_and_prefixes_log_lines_by_role_and_rank(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "collective.cli", "launch", "--workers", "2", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=90, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    assert "broadcast complete" in proc.stdout and "digests     agree" in proc.stdout
    prefixes = {line.split("|", 1)[0].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert {"chief", "worker 0", "worker 1"} <= prefixes


def test_a_bad_model_makes_launch_fail_with_the_chiefs_reason(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "collective.cli", "launch", "--workers", "1", "--json", "--quiet",
         "--model", str(tmp_path / "nope.yaml"), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=90, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and "nope.yaml" in result["error"]


def test_ctrl_c_stops_launch_and_leaves_no_process_behind(tmp_path):
    out = open(tmp_path / "launch.out", "w")
    # A model that takes a while to materialise keeps the run busy when we interrupt it.
    launch = subprocess.Popen(
        [sys.executable, "-m", "collective.cli", "launch", "--workers", "2", "--model", "transformer-100m",
         "--run-dir", str(tmp_path), "--join-timeout", "120", "--start-timeout", "120"],
        stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        children: list[int] = []
        while time.monotonic() < deadline and not children:
            children = _children_of(launch.pid)
            time.sleep(0.05)
        assert children, "the chief should be running"
        time.sleep(0.5)  # the chief is still materialising ~400 MB of initial values
        children = _children_of(launch.pid)
        launch.send_signal(signal.SIGINT)
        launch.wait(30)
        assert launch.returncode != 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.1)
        assert not any(_alive(c) for c in children)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(10)
        out.close()
