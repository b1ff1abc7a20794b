"""collective under a real Slurm cluster: srun, sbatch, preemption (SIGTERM) and requeue."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

RESULT = re.compile(r"result rank=(\d+) world=(\d+) .*?digest=(\S+) state=(\S+)")
ROUND = re.compile(r"round ok=True workers=3 .* digests_agree=True")
FAST = {"COLLECTIVE_SHM": "0"}


def check_round(text: str) -> None:
    """Four result lines, ranks 0..3, one digest and one state; rank 0's round summary ok."""
    results = [RESULT.search(line) for line in text.splitlines()]
    results = [m for m in results if m]
    assert sorted(int(m[1]) for m in results) == [0, 1, 2, 3], text
    assert {m[2] for m in results} == {"4"}, text
    assert len({m[3] for m in results}) == 1, text
    assert len({m[4] for m in results}) == 1, text
    assert ROUND.search(text), text


@pytest.mark.timeout(300)
def test_srun_four_tasks_round_and_torch(slurm):
    t0 = time.monotonic()
    proc = slurm.run("srun", "-n", "4", "--label", "python", "examples/slurm/train.py", timeout=240, env=FAST)
    print(f"cluster start {slurm.started_seconds:.1f} s; srun round {time.monotonic() - t0:.1f} s")
    check_round(proc.stdout)


@pytest.mark.timeout(300)
def test_sbatch_job_completes(slurm, tmp_path):
    out = tmp_path / "job.out"
    t0 = time.monotonic()
    job = slurm.sbatch("examples/slurm/job.sbatch", output=out, env=FAST)
    state = slurm.wait_finished(job, 240)
    print(f"sbatch job {time.monotonic() - t0:.1f} s")
    info = slurm.job(job)
    assert state == "COMPLETED" and info.get("ExitCode") == "0:0", (info, out.read_text())
    check_round(out.read_text())


def _wait_pids(slurm, step: str, count: int, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        pids = slurm.task_pids(step)
        if len(pids) >= count:
            return pids
        assert time.monotonic() < deadline, f"step {step}: tasks {pids} after {timeout:g} s\n{slurm.log_tail()}"
        time.sleep(0.2)


@pytest.mark.timeout(400)
def test_preempted_worker_ends_round_naming_its_rank(slurm, tmp_path):
    """Preemption as Slurm does it to a step's task: SIGTERM, SIGKILL after KillWait. Here one
    worker task (rank 2) gets the SIGTERM mid-round (``scancel --signal=TERM`` reaches every task
    of a step; a single preempted node's tasks are what one rank stands for). The round must end
    on every task, with errors naming rank 2, before the SIGKILL would have been needed."""
    out = tmp_path / "job.out"
    env = {**FAST, "COLLECTIVE_CHUNK_BYTES": "4096", "COLLECTIVE_HEARTBEAT_INTERVAL": "0.5"}
    job = slurm.sbatch("examples/slurm/job.sbatch", "--width", "2048", "--depth", "8", output=out, env=env)
    slurm.wait_state(job, {"RUNNING"}, 120)
    pids = _wait_pids(slurm, f"{job}.0", 4, 120)
    # Wait until the round is under way (the chief has logged its plan / a worker receives).
    deadline = time.monotonic() + 120
    while "receive" not in out.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.1)
    t0 = time.monotonic()
    os.kill(pids[2], signal.SIGTERM)
    state = slurm.wait_finished(job, 180)
    print(f"preemption: SIGTERM -> job ended {time.monotonic() - t0:.1f} s (KillWait {slurm.kill_wait} s)")
    text = out.read_text(errors="replace")
    assert state == "FAILED", (state, text)
    assert "result rank=" not in text, text
    errors = [line for line in text.splitlines() if "error rank=" in line]
    # The chief names the preempted task by its worker id, rank-<SLURM_PROCID>@<node>.
    assert any(line.startswith("0:") and f"rank-2@{slurm.host}" in line for line in errors), text
    # Rank 2 itself says, in one line, that SIGTERM stopped it and in which phase (joining,
    # receiving...: where its own round was when the signal came).
    assert any(line.startswith("2:") and f"worker rank-2@{slurm.host} stopped by SIGTERM while " in line
               for line in errors), text
    assert len(errors) == 4, text  # every rank ended with an error line
    # Every task ended by itself: none was SIGKILLed at the end of KillWait.
    assert "SIGKILL" not in text and "Killed" not in text, text
    assert "CANCELLED" not in text, text


@pytest.mark.timeout(400)
def test_scancel_mid_round_every_task_says_it_was_stopped(slurm, tmp_path):
    """``scancel JOBID``, as users stop a job: SIGTERM to every task of the step. Each says in one
    line that SIGTERM stopped it and in which phase (the chief: whom it still waited for), before
    KillWait's SIGKILL; the job fails with srun's exit status (``exec srun`` in the script)."""
    out = tmp_path / "job.out"
    env = {**FAST, "COLLECTIVE_CHUNK_BYTES": "4096", "COLLECTIVE_HEARTBEAT_INTERVAL": "0.5"}
    job = slurm.sbatch("examples/slurm/job.sbatch", "--width", "2048", "--depth", "8", output=out, env=env)
    slurm.wait_state(job, {"RUNNING"}, 120)
    _wait_pids(slurm, f"{job}.0", 4, 120)
    deadline = time.monotonic() + 120
    while "receive" not in out.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.1)
    slurm.run("scancel", job)
    state = slurm.wait_finished(job, 180)
    text = out.read_text(errors="replace")
    assert state in ("FAILED", "CANCELLED"), (state, text)
    assert slurm.job(job).get("ExitCode", "0:0") != "0:0", (slurm.job(job), text)
    assert "result rank=" not in text, text
    errors = [line for line in text.splitlines() if "error rank=" in line]
    # The chief's own line (its log), whichever came first: the signal, or a worker that went.
    assert any(line.startswith("0:") and "chief shutting down (SIGTERM) while " in line
               for line in text.splitlines()), text
    for rank in (1, 2, 3):
        assert any(line.startswith(f"{rank}:") and "SIGTERM" in line for line in errors), (rank, text)
    assert "Killed" not in text, text


@pytest.mark.timeout(400)
def test_requeued_job_runs_a_clean_round(slurm, tmp_path):
    out = tmp_path / "job.out"
    job = slurm.sbatch("examples/slurm/job.sbatch", "--width", "1024", "--depth", "6", output=out, env=FAST)
    slurm.wait_state(job, {"RUNNING"}, 120)
    _wait_pids(slurm, f"{job}.0", 4, 120)
    t0 = time.monotonic()
    slurm.run("scontrol", "requeue", job)
    deadline = time.monotonic() + 240
    while True:
        info = slurm.job(job)
        if info.get("Restarts") == "1" and info.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED"}:
            break
        assert time.monotonic() < deadline, (info, out.read_text(errors="replace"))
        time.sleep(0.2)
    print(f"requeue: scontrol requeue -> second run done {time.monotonic() - t0:.1f} s")
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", (info, out.read_text())
    text = out.read_text(errors="replace")
    second = text.split(f"job {job} run 2 ", 1)
    assert len(second) == 2, text
    check_round(second[1])
