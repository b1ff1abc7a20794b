"""Ctrl-C on every command: exit 130, one line naming what happened, no traceback.

Each case is repeated at several delays, since the defects seen were races with start-up (a
relay server half started when the KeyboardInterrupt landed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.hold import held_worker_env
from tests.integration.test_launch import _alive, _children_of
from tests.procs import ROOT, SIGINT_IGNORED, wait_until

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean(output: str) -> None:
    assert "Traceback" not in output and "Exception in thread" not in output, output


@pytest.mark.parametrize("delay", [0.3, 0.5, 1.0, 1.5, 2.0, 3.0])
def test_ctrl_c_on_a_background_worker_with_no_chief_exits_130_without_a_traceback(cluster, delay):
    """Early (0.3, 0.5 s: while its modules load, when a background job's SIGINT was lost and the
    worker ran out its join timeout) and later (as the relay server starts, and while it joins)."""
    worker = cluster.worker("w0", chief=f"127.0.0.1:{_closed_port()}", sigint_ignored=True)
    time.sleep(delay)
    worker.signal(signal.SIGINT)
    assert worker.wait(30) == 130, worker.output()
    _clean(worker.output())
    assert worker.output().rstrip().endswith("interrupted"), worker.output()


@pytest.mark.parametrize("delay", [0.0, 0.5, 1.5])
def test_ctrl_c_on_a_background_chief_exits_130_naming_sigint(cluster, delay):
    chief = cluster.chief("--workers", "1", wrapper=SIGINT_IGNORED)  # returns once it serves
    time.sleep(delay)
    chief.signal(signal.SIGINT)
    assert chief.wait(30) == 130, chief.output()  # was 1, where launch and the worker exit 130
    _clean(chief.output())
    assert "chief interrupted (SIGINT)" in chief.output() and "SIGTERM" not in chief.output()


def _launch(tmp_path, *args: str, env: dict[str, str], stdout=subprocess.STDOUT) -> tuple[subprocess.Popen, object]:
    """``stdout``: where launch's stdout goes (a file of its own for ``--json``), else with stderr."""
    out = open(tmp_path / "launch.out", "w")
    launch = subprocess.Popen(
        [sys.executable, "-m", "collective.cli", "launch", "--workers", "2", "--run-dir", str(tmp_path / "run"),
         "--join-timeout", "60", *args],
        stdout=out if stdout == subprocess.STDOUT else stdout, stderr=out, text=True, cwd=ROOT,
        stdin=subprocess.DEVNULL, env={**os.environ, **env},
    )
    return launch, out


def _interrupt_launch(tmp_path, launch, out, hold, delay: float) -> str:
    """SIGINT ``launch`` ``delay`` s after its held process is held; return its output once it
    has ended with every child gone."""
    children: list[int] = []
    reached = hold.with_name(hold.name + ".reached")
    try:
        wait_until(lambda: reached.exists() or launch.poll() is not None, "the held process", timeout=60)
        time.sleep(delay)
        children = _children_of(launch.pid)
        launch.send_signal(signal.SIGINT)
        launch.wait(30)
        wait_until(lambda: not any(_alive(c) for c in children), "the launch's children gone", timeout=15)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(10)
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
        out.close()
    text = (tmp_path / "launch.out").read_text()
    assert launch.returncode == 130, text
    run_dir = tmp_path / "run"
    assert text.rstrip().splitlines()[-1] == (f"interrupted: every process of the run was stopped; its logs are in "
                                              f"{run_dir} (collective logs {run_dir})"), text
    _clean(text)
    return text


@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_ctrl_c_on_launch_passes_sigint_on_and_says_where_the_logs_are(tmp_path, delay):
    env, hold = held_worker_env(tmp_path)  # the run stays in its join phase until interrupted
    launch, out = _launch(tmp_path, env=env)
    text = _interrupt_launch(tmp_path, launch, out, hold, delay)
    chief_log = (tmp_path / "run" / "chief.log").read_text()
    assert "chief interrupted (SIGINT)" in chief_log and "SIGTERM" not in chief_log + text, chief_log
    _clean(chief_log + (tmp_path / "run" / "worker-0.log").read_text())


@pytest.mark.parametrize("transport", ["grpc", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_ctrl_c_on_launch_json_still_prints_the_summary_line(tmp_path, transport):
    """``--json``: the last line on stdout is the summary, for every ending; on Ctrl-C there was
    none. It is the chief's (naming SIGINT and the phase the run was in), exit code 130."""
    if transport == "mpi":
        env, hold = held_worker_env(tmp_path, "PMI_RANK=2", module="collective.mpi")
    else:
        env, hold = held_worker_env(tmp_path)
    with open(tmp_path / "launch.json", "w") as stdout:
        launch, out = _launch(tmp_path, "--transport", transport, "--json", "--quiet", env=env, stdout=stdout)
        _interrupt_launch(tmp_path, launch, out, hold, 0.5)
    lines = (tmp_path / "launch.json").read_text().splitlines()
    assert lines, "no JSON line on stdout"
    result = json.loads(lines[-1])
    assert (result["ok"], result["exit_code"], result["transport"]) == (False, 130, transport), result
    assert "SIGINT" in result["error"], result["error"]
    assert result["run_dir"] == str(tmp_path / "run") and result["failed_processes"] == {}, result
    assert json.loads((tmp_path / "run" / "result.json").read_text()) == result  # kept with the logs


@pytest.mark.mpi
@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_ctrl_c_on_an_mpi_launch_shows_no_bad_termination_banner(tmp_path, delay):
    env, hold = held_worker_env(tmp_path, "PMI_RANK=2", module="collective.mpi")  # rank 2 holds MPI_Init
    launch, out = _launch(tmp_path, "--transport", "mpi", env=env)
    text = _interrupt_launch(tmp_path, launch, out, hold, delay)
    assert "BAD TERMINATION" not in text, text


def test_ctrl_c_before_the_entry_point_has_loaded_is_held_not_lost(tmp_path):
    """A background job starts with SIGINT ignored; the entry point used to restore Python's
    handler only after its imports (a second on a loaded machine), so a Ctrl-C then was lost
    and the worker ran on for its whole join timeout."""
    proc = subprocess.Popen(
        [sys.executable, *SIGINT_IGNORED, "-c",
         "import os, signal, sys; sys.argv[0] = 'collective.worker'; "
         "import collective.entry as e; e.defer_sigint(); os.kill(os.getpid(), signal.SIGINT); "
         "from collective.worker.__main__ import main; sys.exit(main(['--chief', '127.0.0.1:1']))"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130 and out.strip() == "interrupted", out
