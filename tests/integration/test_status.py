"""`collective status`: who is being waited for, from the chief's Status RPC."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.procs import ROOT, wait_until

pytestmark = pytest.mark.integration



def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "collective.cli", "status", *args], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, stdin=subprocess.DEVNULL)


def test_status_names_the_joined_worker_and_who_is_still_missing(cluster):
    cluster.chief("--workers", "2", env={"COLLECTIVE_TOKEN": "t0k"})
    w = cluster.worker("early-bird", "--devices", "cpu:0,cpu:1", env={"COLLECTIVE_TOKEN": "t0k"})
    wait_until(lambda: "waiting for the plan" in w.output(), "the worker's join")
    proc = status("--chief", cluster.address, "--token", "t0k", "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert st["phase"] == "joining" and st["expected"] == 2 and st["joined"] == 1
    assert "1 more worker(s) to join" in st["waiting_for"]
    [worker] = st["workers"]
    assert worker["worker_id"] == "early-bird" and worker["devices"] == ["cpu:0", "cpu:1"]
    assert worker["phase"] == "joined" and worker["seconds_since_heartbeat"] < 10
    # Byte counts are numbers, not protobuf's JSON strings for 64-bit fields.
    assert worker["bytes_received"] == 0 and isinstance(worker["bytes_total"], int) and worker["bytes_total"] > 0
    text = status("--chief", cluster.address, "--token", "t0k")
    assert text.returncode == 0
    assert "1/2 workers joined" in text.stdout and "early-bird" in text.stdout
    assert "waiting for: 1 more worker(s) to join" in text.stdout


def test_status_with_a_wrong_token_is_refused_with_exit_2(cluster):
    cluster.chief("--workers", "1", env={"COLLECTIVE_TOKEN": "right"})
    proc = status("--chief", cluster.address, "--token", "wrong")
    assert proc.returncode == 2
    assert "refused the cluster token" in proc.stderr and "Traceback" not in proc.stderr


def test_status_watch_follows_the_round_until_start(cluster, tmp_path):
    cluster.chief("--workers", "1")
    out_path = tmp_path / "watch.out"
    with open(out_path, "w") as out_fh:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "collective.cli", "status", "--chief", cluster.address, "--watch", "--interval", "0.1"],
            stdout=out_fh, stderr=subprocess.STDOUT, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
        )
    try:
        # The worker starts only once the watcher has drawn the empty cluster.
        wait_until(lambda: "0/1 workers joined" in out_path.read_text(), "the watcher's first table")
        cluster.worker("w0")
        watcher.wait(30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(10)
    out = out_path.read_text()
    assert watcher.returncode == 0, out
    assert "0/1 workers joined" in out and ": started for" in out


def test_status_shows_the_bytes_of_workers_fed_by_a_relay(cluster):
    """In a chain only rank 0 takes bytes from the chief; the others report theirs in their
    heartbeats. Rank 0 takes its stream slowly, so the others hold part of the model while we
    look. (It used to be frozen with SIGSTOP once a quarter through: under load the 0.67 s
    broadcast of the raw data path had ended before the signal landed.)"""
    from collective.transport.grpc import GrpcChiefLink
    from tests.clusters import SLOW_RECEIVER

    # The default 5 s between heartbeats: while relay-fed, a worker beats every second anyway.
    hb = ["--heartbeat-interval", "5", "--heartbeat-timeout", "30"]
    cluster.chief("--workers", "3", "--topology", "chain", "--no-shm", "--model", "transformer-100m",
                  "--chunk-bytes", "65536", *hb)
    workers = [cluster.worker(f"w{i}", "--rank", str(i), "--no-shm", *hb, code=SLOW_RECEIVER if i == 0 else None)
               for i in range(3)]
    link = GrpcChiefLink(cluster.address)
    try:
        deadline = time.monotonic() + 60
        while True:  # ranks 1 and 2 hold part of what rank 0 relayed, and say so in their heartbeats
            st = link.status(timeout=5)
            fed = {w.rank: w for w in st.workers if w.rank > 0}
            if len(fed) == 2 and all(0 < w.bytes_received < w.bytes_total for w in fed.values()):
                break
            assert time.monotonic() < deadline and all(w.proc.poll() is None for w in workers), st
            time.sleep(0.1)
        assert all(f"relaying to worker w{r + 1}" in workers[r].output() for r in (0, 1))
        assert st.phase == "broadcasting"
        assert {w.phase for w in fed.values()} == {"receiving"}, st
        proc = status("--chief", cluster.address, "--json")
        assert proc.returncode == 0, proc.stderr
        shown = {w["rank"]: w for w in json.loads(proc.stdout)["workers"]}
        assert all(0 < int(shown[r]["bytes_received"]) < int(shown[r]["bytes_total"]) for r in (1, 2)), shown
    finally:
        link.close()


def test_status_reaches_a_default_launch_through_its_run_dir(tmp_path):
    """`collective launch` picks a random token and port and shows neither; its run dir holds
    them (status.json, 0600, while the chief runs), so `status --run-dir` answers."""
    import os
    import stat

    from tests.hold import held_worker_env

    env, hold = held_worker_env(tmp_path)  # worker-1 joins only when told: the run waits in join
    run_dir = tmp_path / "run"
    out = open(tmp_path / "launch.out", "w")
    launch = subprocess.Popen(
        [sys.executable, "-m", "collective.cli", "launch", "--workers", "2", "--run-dir", str(run_dir),
         "--join-timeout", "60"], stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        stdin=subprocess.DEVNULL, env={**os.environ, **env},
    )
    try:
        status_file = run_dir / "status.json"
        wait_until(status_file.exists, "the launch's status file", timeout=60)
        st = os.lstat(status_file)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        # The line comes just after the file (written, then said): wait for it, not a moment.
        said = f"status: collective status --run-dir {run_dir}"
        wait_until(lambda: said in (tmp_path / "launch.out").read_text(), "launch's status line", timeout=60)
        proc = status("--run-dir", str(run_dir), "--json")
        assert proc.returncode == 0, proc.stderr
        shown = json.loads(proc.stdout)
        assert shown["phase"] in ("loading", "joining") and shown["expected"] == 2, shown  # the chief binds, then loads
        text = status("--run-dir", str(run_dir))
        assert text.returncode == 0 and "/2 workers joined" in text.stdout, text.stdout + text.stderr
        hold.unlink()  # worker-1 may join now: the round completes
        assert launch.wait(90) == 0, (tmp_path / "launch.out").read_text()
    finally:
        if launch.poll() is None:
            launch.kill()  # its children are in their own sessions: they end at their join timeouts
            launch.wait(10)
        out.close()
    assert not status_file.exists()  # the chief is gone: nothing left to reach, no token left behind
    after = status("--run-dir", str(run_dir), "--json")  # its outcome, from the summary it left
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) | {"workers": 2} == {
        "ok": True, "phase": "started", "ended": True, "run_dir": str(run_dir), "error": None, "culprit": None,
        "workers": 2, "summary": str(run_dir / "result.json")}
    (run_dir / "result.json").unlink()
    none = status("--run-dir", str(run_dir), "--json")
    assert none.returncode == 2 and json.loads(none.stdout)["ok"] is False
    assert none.stderr.strip() == f"collective status: error: no running launch in {run_dir}: it has no " \
        f"status.json (the launch has ended, or its chief has not started yet); its logs: collective logs {run_dir}"


@pytest.mark.timeout(240)
def test_status_watch_of_a_launch_that_succeeds_ends_with_started_and_exit_0(tmp_path):
    """The chief of a launch ends half a second after start; a watcher that asks next finds no
    chief. It used to end `error: chief at 127.0.0.1:P unreachable during status`, exit 1, on a
    launch that succeeded; it shows the outcome from the summary launch leaves in the run dir."""
    from tests.procs import Proc

    run_dir = tmp_path / "run"
    launch = Proc(["-m", "collective.cli", "launch", "--workers", "2", "--run-dir", str(run_dir), "--quiet"],
                  tmp_path / "launch.out")
    watcher = None
    try:
        wait_until((run_dir / "status.json").exists, "the launch's status file", timeout=90)
        # Redraws 3 s apart: the chief's half second of answers after start falls between two.
        watcher = Proc(["-m", "collective.cli", "status", "--run-dir", str(run_dir), "--watch", "--interval", "3"],
                       tmp_path / "watch.out")
        assert watcher.wait(200) == 0, watcher.output()
        assert launch.wait(60) == 0, launch.output()
    finally:
        for p in (watcher, launch):
            if p is not None:
                p.kill()
    out = watcher.log.read_text()
    assert "unreachable" not in out, out
    # The outcome from the run dir, or (when a redraw fell in the chief's last half second) its own table.
    assert f"the launch in {run_dir} has ended: started: 2/2 workers verified" in out or ": started for" in out, out


@pytest.mark.timeout(180)
def test_status_of_an_mpi_launch_says_mpi_serves_no_status_and_what_to_use(tmp_path, capsys):
    """Under `--transport mpi` no chief serves Status: `status --run-dir` said `no running launch`
    while the launch ran."""
    import shutil
    from pathlib import Path

    from collective import cli
    from tests.procs import Proc

    if not (shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")):
        pytest.fail("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    run_dir = tmp_path / "run"
    launch = Proc(["-m", "collective.cli", "launch", "--workers", "2", "--transport", "mpi", "--run-dir", str(run_dir),
                   "--quiet"], tmp_path / "launch.out")
    try:
        wait_until((run_dir / "mpiexec.log").exists, "mpiexec started by the launch", timeout=90)
        code = cli.main(["status", "--run-dir", str(run_dir)])
        running = launch.proc.poll() is None
        err = capsys.readouterr().err
        assert launch.wait(120) == 0, launch.output()
    finally:
        launch.kill()
    if running:  # asked while it ran (it lasts seconds; the call takes milliseconds)
        assert (code, err) == (2, f"collective status: error: the launch in {run_dir} runs under MPI (--transport "
                                  f"mpi), where no chief serves status; follow it with collective logs {run_dir} (its "
                                  f"outcome: {run_dir / 'result.json'} once it ends)\n")
    after = status("--run-dir", str(run_dir))  # ended: its outcome, as for gRPC
    assert after.returncode == 0, after.stderr
    assert after.stdout.startswith(f"the launch in {run_dir} has ended: started: 2/2 workers verified"), after.stdout


def test_status_errors_are_its_own_one_line_and_json_says_so_too(tmp_path):
    proc = status("--chief", "127.0.0.1:1", "--json")
    assert proc.returncode != 0
    shown = json.loads(proc.stdout)
    assert shown["ok"] is False and "127.0.0.1:1" in shown["error"], shown
    assert proc.stderr.startswith("collective status: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert " ERROR launch " not in proc.stderr
    logs = subprocess.run([sys.executable, "-m", "collective.cli", "logs", str(tmp_path / "nope")], capture_output=True,
                          text=True, timeout=30, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert (logs.returncode, logs.stderr) == (2, f"collective logs: error: run directory {tmp_path / 'nope'} does not exist\n")
