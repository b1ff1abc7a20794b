"""`collective launch`: the embedded default, its failures, and its clean-up."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.procs import ROOT, SIGINT_IGNORED

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
    assert proc.returncode == 2, proc.stderr  # the chief's exit code for bad input, passed on
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and "nope.yaml" in result["error"]
    # The error is the chief's message, not a whole log line with its timestamp and context.
    assert " ERROR " not in result["error"] and "phase=" not in result["error"], result["error"]
    assert "  seconds" not in proc.stderr and "GiB/s" not in proc.stderr  # no broadcast happened
    assert f"  error       {result['error']}" in proc.stderr


def _launch(run_dir, *args, env=None, timeout=90) -> subprocess.CompletedProcess:
    """Run ``collective launch``; past ``timeout`` kill it and its children by pid, then fail."""
    launch = subprocess.Popen(
        [sys.executable, "-m", "collective.cli", "launch", "--run-dir", str(run_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in _children_of(launch.pid):  # in their own sessions: killing launch would orphan them
            os.kill(pid, signal.SIGKILL)
        launch.kill()
        launch.communicate(timeout=10)
        raise AssertionError(f"launch did not end within {timeout} s") from None
    return subprocess.CompletedProcess(launch.args, launch.returncode, out, err)


def test_a_reused_run_dir_starts_clean_and_never_reads_the_last_runs_files(tmp_path):
    # What a killed earlier run leaves: its port (now dead), its summary and a log of a 4th worker.
    (tmp_path / "chief.port").write_text("1")
    (tmp_path / "result.json").write_text(json.dumps({"ok": False, "error": "run 1 failed"}))
    (tmp_path / "worker-3.log").write_text("2026-01-01T00:00:00.000Z INFO worker rank=3 id=worker-3 phase=join: old\n")
    proc = _launch(tmp_path, "--workers", "2", "--devices-per-worker", "2", "--json", "--quiet", "--join-timeout", "20")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["error"] is None
    assert json.loads((tmp_path / "result.json").read_text())["ok"] is True
    assert not (tmp_path / "worker-3.log").exists() and not (tmp_path / "chief.port").exists()
    # --json summarises replicas as counts (7 variables x 2 devices), not every name of every worker.
    assert [w["replicas"] for w in result["workers"]] == [14, 14]


def test_a_run_dir_it_creates_and_every_file_in_it_are_private_whatever_the_umask(tmp_path):
    # The default run dir (mkdtemp) was 0700 already; one named with --run-dir was 0755 with
    # 0644 logs (the usual umask): other local users could read variable names and addresses.
    run_dir = tmp_path / "r1"  # its parent exists: launch makes the run dir alone
    old = os.umask(0o022)
    try:
        proc = _launch(run_dir, "--workers", "2", "--quiet", "--join-timeout", "20")
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: p.stat().st_mode & 0o777 for p in run_dir.iterdir()}
    assert {"chief.log", "worker-0.log", "worker-1.log", "result.json"} <= set(modes), modes
    assert (run_dir.stat().st_mode & 0o777, set(modes.values())) == (0o700, {0o600}), modes


@pytest.mark.parametrize(("where", "says"), [("file", "it exists and is not a directory"),
                                            ("file/run", "Not a directory")])
def test_a_run_dir_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, where, says):
    (tmp_path / "file").write_text("not a directory")
    proc = _launch(tmp_path / where, "--workers", "1", "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert f"cannot use run directory {tmp_path / where}: {says}; pass another --run-dir" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_more_workers_than_this_hosts_memory_holds_are_refused_before_any_process_starts(tmp_path):
    # A typo (100000 for 10) used to start processes until the machine gave out.
    from collective.cli.launch import PROCESS_BYTES
    from collective.model import available_memory

    n = (available_memory() or 1 << 40) // PROCESS_BYTES + 100  # more than fit, here and on CI
    proc = _launch(tmp_path / "run", "--workers", str(n), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert f"--workers {n} would start {n + 1:,} local processes" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_a_run_dir_held_by_another_live_launch_is_refused_naming_it(tmp_path):
    from collective.cli.launch import Launcher

    holder = Launcher(workers=1, run_dir=str(tmp_path))
    holder._claim_run_dir()  # another launch in this process holds the directory
    try:
        (tmp_path / "chief.log").write_text("the holder's log\n")
        proc = _launch(tmp_path, "--workers", "1", "--quiet")
        assert proc.returncode == 2
        assert f"run directory {tmp_path} is in use by another launch (pid {os.getpid()})" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert (tmp_path / "chief.log").read_text() == "the holder's log\n"  # untouched
    finally:
        holder._release_run_dir()
    proc = _launch(tmp_path, "--workers", "1", "--quiet")  # released (as when a launch dies): usable again
    assert proc.returncode == 0, proc.stderr


def test_launch_fails_within_seconds_naming_workers_that_all_died(tmp_path):
    # A bad setting only workers read: every worker exits at once, the chief would wait 300 s.
    proc = _launch(tmp_path, "--workers", "2", "--json", "--quiet", "--join-timeout", "300",
                   env={"COLLECTIVE_STALL_TIMEOUT": "-1"}, timeout=60)
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False
    assert result["error"].startswith("worker process(es) ended before the round did: "), result["error"]
    assert "worker-0 (pid" in result["error"] and "worker-1 (pid" in result["error"]
    assert "COLLECTIVE_STALL_TIMEOUT" in result["error"]  # each worker's own reason is carried along
    assert result["failed_processes"]["worker 0"] == 2 and result["failed_processes"]["worker 1"] == 2
    # The chief, stopped, still left its summary: the model, and no one culprit (both died) in the join phase.
    assert (result["model"], result["culprit"], result["error_phase"]) == ("preset mlp (seed 0)", None, "join")


@pytest.mark.parametrize(("args", "says"), [
    (["--model", "nothere"], "model 'nothere': no such file or preset"),
    (["--chunk-bytes", "100GiB"], "chunk"),
    (["--model", "{bad}"], "bad.yaml"),
    (["--shards", '{"nope": "dim0", "*": "all"}'], "nope"),
], ids=["unknown-model", "huge-chunk-bytes", "bad-yaml", "bad-shards"])
def test_a_chief_that_fails_before_serving_ends_the_launch_without_its_workers_waiting(tmp_path, args, says):
    """The chief exits 2 before its round exists; its workers, started once its port was bound,
    only retried a closed port until launch stopped them after the linger (41 s). Now launch stops
    them as soon as the chief has exited with its error, and says so."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("variables: [unclosed\n")
    args = [a.replace("{bad}", str(bad)) for a in args]
    proc = _launch(tmp_path / "run", "--workers", "2", "--json", "--quiet", "--join-timeout", "300", *args,
                   timeout=100)
    assert proc.returncode == 2, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and says in result["error"], result["error"]
    assert result["failed_processes"] == {"chief": 2}, result  # the workers it stopped are not blamed
    # Stopped because the chief had ended, not after waiting out the chief's linger.
    stopped = [line for line in proc.stderr.splitlines() if "stopping" in line and line.startswith("launch")]
    assert stopped in ([], ["launch   | the chief ended (exit 2); stopping 2 worker(s) it can no longer tell"]), stopped
    assert "Traceback" not in proc.stderr
    if not stopped:  # the chief was gone before its port was read: no worker was started at all
        assert not (tmp_path / "run" / "worker-0.log").exists()


@pytest.fixture
def full_dir(tmp_path):
    """A tiny tmpfs filled to the last byte, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True, timeout=10)
    try:
        (mnt / "run").mkdir()
        with open(mnt / "filler", "wb", buffering=0) as fh:
            with pytest.raises(OSError) as info:
                while True:
                    fh.write(b"\0" * 4096)
            assert info.value.errno == errno.ENOSPC
        yield mnt / "run"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=10)


def test_a_full_run_dir_cuts_the_logs_but_not_the_round(full_dir):
    proc = _launch(full_dir, "--workers", "2", "--json", "--quiet", "--join-timeout", "30")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is True
    assert "No space left on device" in result["logs_cut"] and "chief.log" in result["logs_cut"]
    assert "broadcast complete" in proc.stderr and "  logs cut    " in proc.stderr


@pytest.mark.parametrize("started", ["in the foreground", "as a background job (SIGINT inherited ignored)"])
def test_ctrl_c_stops_launch_and_leaves_no_process_behind(tmp_path, started):
    out = open(tmp_path / "launch.out", "w")
    # A model that takes a while to materialise keeps the run busy when we interrupt it.
    launch = subprocess.Popen(
        [sys.executable, *(SIGINT_IGNORED if started != "in the foreground" else []), "-m", "collective.cli", "launch", "--workers", "2", "--model", "transformer-100m",
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
        children = _children_of(launch.pid)  # the chief (materialising ~400 MB), maybe workers too
        launch.send_signal(signal.SIGINT)
        launch.wait(30)
        assert launch.returncode == 130, (tmp_path / "launch.out").read_text()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.1)
        assert not any(_alive(c) for c in children)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(10)
        out.close()


def test_a_chief_that_cannot_write_its_summary_keeps_the_rounds_outcome(full_dir, cluster):
    chief = cluster.chief("--workers", "1", "--join-timeout", "30", "--result-file", str(full_dir / "result.json"))
    worker = cluster.worker("w0")
    assert worker.wait(60) == 0, worker.output()
    assert chief.wait(30) == 0, chief.output()  # started stays started
    out = chief.output()
    assert "could not write the round's summary to" in out and "No space left on device" in out
    assert "the outcome stands (started)" in out and "Traceback" not in out


def test_a_run_dir_whose_parent_is_missing_is_refused_and_nothing_is_made(tmp_path):
    """`--run-dir /nonexistent/x` silently created /nonexistent (a mistyped path became a tree)."""
    target = tmp_path / "nonexistent" / "x"
    proc = _launch(target, "--workers", "1", "--quiet", timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].endswith(f"cannot use run directory {target}: its parent directory {target.parent} does not "
                             f"exist (create it first); pass another --run-dir"), lines
    assert not target.parent.exists()


def test_a_failed_launchs_summary_counts_the_workers_asked_for():
    """A launch that failed before any worker joined said `workers 0` for `--workers 2`."""
    from collective.chief.reports import failed_summary
    from collective.summary import summary_table

    failed = failed_summary(None, transport="grpc", model="nothere")
    assert "  workers     0 of 2 joined\n" in summary_table(failed, expected=2)
    assert "  workers     0\n" in summary_table(failed)  # collective.mpi's own table: the count it has


def test_a_worker_refuses_a_gpu_this_host_does_not_show_in_one_line(tmp_path):
    """`--devices cuda:0,gpu:3` on a host without GPUs was taken as two replicas in host memory
    (`training started: 7 variables x 2 replicas`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    proc = subprocess.run([sys.executable, "-m", "collective.worker", "--chief", "127.0.0.1:1", "--join-timeout", "5",
                           "--devices", "cpu:0,gpu:3"], env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.endswith("device gpu:3 does not exist: this host shows 0 GPU(s) (CUDA_VISIBLE_DEVICES applies); "
                         "pass devices it has, such as cpu:0"), line


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_options_that_do_nothing_in_the_run_are_warned_about_in_one_line_each(tmp_path):
    """`--transport mpi --topology chain --no-shm` and `--seed 5` with a .safetensors model were
    accepted without a word (`warnings: []`; the summary said `topology star`)."""
    import numpy as np

    from collective.sources import save_safetensors

    model = tmp_path / "m.safetensors"
    save_safetensors(model, {"w": np.arange(12, dtype=np.float32)})
    proc = _launch(tmp_path / "run", "--workers", "2", "--transport", "mpi", "--topology", "chain", "--no-shm",
                   "--seed", "5", "--model", str(model), "--json", "--quiet", timeout=200)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = [
        f"--seed 5 does nothing: model {model} stores its values (only presets and .yaml/.json specs draw theirs "
        f"from a seed)",
        "--topology chain does nothing under --transport mpi: rank 0 sends each rank its stream (a star, over MPI)",
        "--no-shm does nothing under --transport mpi: MPI moves the bytes, by its own means on one host",
    ]
    assert result["warnings"] == expected, result["warnings"]
    for warning in expected:  # said at start on stderr, one line each, and in the table
        assert f"launch   | WARNING {warning}\n" in proc.stderr, proc.stderr
        assert f"  WARNING     {warning}\n" in proc.stderr, proc.stderr
