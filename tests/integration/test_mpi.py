"""The same round under a real mpiexec (the MPICH wheel's hydra), not skipped in CI."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tests.procs import ROOT, Proc, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.mpi]

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def mpirun(n: int, *args: str, script: list[str] | None = None, env: dict | None = None, timeout: float = 90,
           shm_list: Path | None = None):
    """Run a job; with ``shm_list``, in a private mount namespace with its own empty /dev/shm,
    whose listing after the job is written to ``shm_list`` (what the job left behind, and only it)."""
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    full_env.update(env or {})
    cmd = [MPIEXEC, "-n", str(n), sys.executable, *(script or ["-m", "collective.mpi"]), *args]
    if shm_list is not None:
        script_text = 'mount -t tmpfs tmpfs /dev/shm || exit 99; "$@"; rc=$?; ls -A /dev/shm > "$SHM_LIST"; exit $rc'
        unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
        cmd = [*unshare, "sh", "-c", script_text, "sh", *cmd]
        full_env["SHM_LIST"] = str(shm_list)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env,
                          stdin=subprocess.DEVNULL)
    return proc


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def digest(a: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).tobytes())


def source_digests(ref: str) -> dict[str, str]:
    from collective.sources import load_source

    source = load_source(ref)
    out = {}
    for spec in source.specs():
        a = np.empty(spec.shape, spec.np_dtype)
        source.fill(spec, a)
        out[spec.name] = digest(a)
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_rank_gets_bit_exact_replicas_of_a_spec_model(tmp_path, ranks):
    spec = tmp_path / "model.yaml"
    spec.write_text(
        "seed: 3\nvariables:\n"
        "  - {name: w, shape: [64, 32], dtype: float32, initializer: glorot_uniform}\n"
        "  - {name: b, shape: [32], dtype: float64, initializer: {type: constant, value: 0.5}}\n"
        "  - {name: acc, shape: [], dtype: float32, initializer: zeros, synchronization: on_read, aggregation: sum}\n"
    )
    proc = mpirun(ranks, "--model", str(spec), "--devices-per-worker", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["ok"] is True and result["transport"] == "mpi"
    assert {v["name"]: v["digest"] for v in result["variables"]} == source_digests(str(spec))
    assert [w["rank"] for w in result["workers"]] == list(range(ranks - 1))
    for w in result["workers"]:
        assert w["replicas"] == 6  # 3 variables on 2 devices: a count, as launch gives it
    assert len({w["digest"] for w in result["workers"]}) == 1
    assert proc.stderr.count("training started:") == ranks  # the chief and every worker


@pytest.mark.parametrize("kind", ["npz", "safetensors"])
def test_checkpoints_reach_every_rank_bit_exact(tmp_path, kind):
    arrays = {"enc.weight": np.arange(600, dtype=np.float32).reshape(20, 30), "enc.bias": np.ones(30, np.int16)}
    path = tmp_path / f"m.{kind}"
    if kind == "npz":
        np.savez(path, **arrays)
    else:
        from safetensors.numpy import save_file

        save_file(arrays, str(path))
    proc = mpirun(4, "--model", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert {v["name"]: v["digest"] for v in last_json(proc.stdout)["variables"]} == {k: digest(a) for k, a in arrays.items()}


def test_a_variable_larger_than_the_split_size_moves_in_calls_below_it(tmp_path):
    """The >2 GiB path, cheaply: a 1000-byte split size (chunks of 500) and a 400 kB variable."""
    arrays = {"big": np.random.default_rng(1).standard_normal(50_000), "small": np.arange(7, dtype=np.int8)}
    path = tmp_path / "big.npz"
    np.savez(path, **arrays)
    log = tmp_path / "largest-bcast"
    proc = mpirun(3, "--model", str(path), "--chunk-bytes", "500", "--split-bytes", "1000", "--json",
                  script=["tests/mpi_probe.py"], env={"PROBE_BCAST_LOG": str(log)})
    assert proc.returncode == 0, proc.stderr
    assert {v["name"]: v["digest"] for v in last_json(proc.stdout)["variables"]} == {k: digest(a) for k, a in arrays.items()}
    assert 0 < int(log.read_text()) <= 1000


def test_a_corrupted_rank_ends_the_job_naming_the_rank_and_the_variable(tmp_path):
    proc = mpirun(3, "--model", "mlp", "--join-timeout", "20", script=["tests/mpi_probe.py"],
                  env={"PROBE_CORRUPT_RANK": "2"})
    # every rank heard the failure together and the job ends with the round's own code: the
    # first rank to exit cannot get the others killed before their lines are out (exit 9)
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout + proc.stderr
    assert "rank 2 (worker" in out and "dense_1/kernel" in out and "digest" in out
    assert "training started" not in out
    # The rank reports its bad data at the ready step, in step with the others: every rank hears
    # it in the same answer and ends normally (no MPI_Abort, whose teardown may lose output).
    assert "MPI_Abort" not in out, out
    assert "round failed: worker mpi-rank-2" in out and "rank 1 (worker on" in out, out


def test_a_rank_that_never_joins_is_named_by_rank_0s_watchdog(tmp_path):
    proc = mpirun(3, "--model", "mlp", "--join-timeout", "4", script=["tests/mpi_probe.py"],
                  env={"PROBE_HOLD_RANK": "2"}, timeout=60)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    [line] = [ln for ln in out.splitlines() if "rank 0 on" in ln and "did not finish within" in ln]
    assert "join did not finish within 4 s" in line, line
    assert "(not yet at join: rank 2 (never heard from))" in line, line
    assert "rank 1" not in line, line


# A rank whose stop-signal handler runs late, as on a loaded machine: before the job was ended
# by one MPI_Abort, each rank exited on its own and mpiexec SIGKILLed the late ones (exit 9).
LATE_SIGNAL = pytest.mark.parametrize("late", [None, "1:0.3", "0:0.3"], ids=["together", "rank1-late", "rank0-late"])


@LATE_SIGNAL
def test_sigterm_to_the_job_leaves_one_line_per_rank_naming_the_phase(tmp_path, late):
    """scancel on an mpirun job (or a preempting scheduler): mpiexec passes SIGTERM on to every
    rank; each says in one line that it was stopped and in which phase, and the job exits 143."""
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    job = Proc(["tests/mpi_probe.py", "--model", "mlp", "--join-timeout", "60"], tmp_path / "out.txt",
               env={"PROBE_HOLD_RANK": "2", **({"PROBE_LATE_SIGNAL": late} if late else {})},
               launcher=[MPIEXEC, "-n", "3"])
    try:
        wait_for(job, "HOLDING", timeout=60)
        time.sleep(1.0)  # ranks 0 and 1 are in their join by now
        job.signal(signal.SIGTERM)
        job.wait(30)
        text = job.output()
    finally:
        job.kill()
    stopped = re.findall(r"rank (\d) \((chief|worker) on \S+\) stopped by SIGTERM during (\w+)", text)
    assert ("0", "chief", "join") in stopped and ("1", "worker", "join") in stopped, text
    assert "Traceback" not in text and "BAD TERMINATION" not in text, text
    assert job.proc.returncode == 143, text


def test_shards_under_the_mpi_command_each_worker_receives_only_its_half(tmp_path):
    proc = mpirun(3, "--model", "mlp", "--shards", "dim0", "--json")
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["ok"] and result["transport"] == "mpi", result
    model = result["bytes"]
    for w in result["workers"]:
        assert w["digest"] == w["expected_digest"]
        assert 0.45 * model < w["bytes"] <= 0.5 * model + 64 * len(result["variables"]), (w["bytes"], model)
    assert len({w["digest"] for w in result["workers"]}) == 2  # each its own shard
    assert "training started: 2 workers hold their shards" in proc.stderr


def test_a_corrupted_shard_ends_the_job_naming_the_rank_in_step(tmp_path):
    """Rank 1 corrupts the first chunk of its own stream; rank 2's stream comes after it, from
    rank 0, point to point: every rank still ends in step, the culprit named, no MPI_Abort."""
    proc = mpirun(3, "--model", "mlp", "--shards", "dim0", "--join-timeout", "20", script=["tests/mpi_probe.py"],
                  env={"PROBE_CORRUPT_RANK": "1"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "rank 1 (worker" in out and "digest" in out and "training started" not in out, out
    assert "MPI_Abort" not in out, out
    assert "round failed: worker mpi-rank-1" in out and "rank 2 (worker on" in out, out


def test_a_bad_model_file_ends_every_rank_naming_rank_0_and_the_file(tmp_path):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\xff" * 20)
    proc = mpirun(3, "--model", str(bad))
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "rank 0 (chief" in out and "broken.safetensors" in out
    assert "Traceback" not in out and "training started" not in out
    # Rank 0's failure before serving is every rank's answer at the join step: each worker names
    # its cause (before: the job was aborted and the workers said nothing).
    for rank in (1, 2):
        line = next((ln for ln in out.splitlines() if f"rank {rank} (worker on" in ln), "")
        assert "rank 0: " in line and "broken.safetensors" in line, out
    assert "MPI_Abort" not in out, out


def test_collective_launch_runs_the_mpi_transport_for_you(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "collective.cli", "launch", "--transport", "mpi", "--workers", "3", "--json",
         "--quiet", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=90, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["ok"] is True and result["transport"] == "mpi" and len(result["workers"]) == 3
    assert {v["name"]: v["digest"] for v in result["variables"]} == source_digests("mlp")


def test_an_aborted_job_leaves_nothing_in_dev_shm(tmp_path):
    listing = tmp_path / "shm-after"
    proc = mpirun(3, "--model", "mlp", "--join-timeout", "20", script=["tests/mpi_probe.py"],
                  env={"PROBE_CRASH_RANK": "2"}, shm_list=listing)
    assert proc.returncode not in (0, 99), proc.stderr  # 99: the private /dev/shm could not be mounted
    # The job really was aborted, skipping MPI_Finalize: the crashing rank says so before it calls
    # MPI_Abort (MPICH's own line may be lost with the job's output).
    assert "rank 2: aborting the job (MPI_Abort" in proc.stdout + proc.stderr, proc.stderr
    assert listing.read_text() == ""


def test_a_successful_job_leaves_nothing_in_dev_shm_either(tmp_path):
    listing = tmp_path / "shm-after"
    proc = mpirun(3, "--model", "mlp", shm_list=listing)
    assert proc.returncode == 0, proc.stderr
    assert listing.read_text() == ""


@LATE_SIGNAL
def test_ctrl_c_on_mpiexec_ends_every_rank_with_one_line_and_exit_130(tmp_path, late):
    import signal
    import time

    if MPIEXEC is None:
        pytest.fail("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    out_path = tmp_path / "mpiexec.out"
    with open(out_path, "w") as out:
        job = subprocess.Popen(
            [MPIEXEC, "-n", "3", sys.executable, "tests/mpi_probe.py", "--join-timeout", "120"],
            stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env={**env, "PROBE_HOLD_RANK": "2", **({"PROBE_LATE_SIGNAL": late} if late else {})},
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "HOLDING" not in out_path.read_text():  # rank 2 holds everyone in the join
            assert job.poll() is None and time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.05)
        job.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends mpiexec
        assert job.wait(30) == 130, out_path.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    text = out_path.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.count("interrupted") == 1, text  # rank 0's line, once
    assert "BAD TERMINATION" not in text, text


def test_rank_0_serves_a_checkpoint_from_its_files_under_mpiexec(tmp_path):
    """--from-file under mpiexec: rank 0 maps the files (nothing copied), reads them while the
    workers wait asleep, then Bcasts straight from the mapping, 32 MiB spans here, each span's
    pages dropped once sent; the digests are the files' bytes."""
    from collective.bench.checkpoint import write_checkpoint
    from tests.integration.test_from_file import tensor_bytes

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, 256 << 20, 2, tensor_bytes=20 << 20)
    proc = mpirun(3, "--model", str(ckpt), "--from-file", "--split-bytes", str(32 << 20), "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["ok"] is True and result["transport"] == "mpi" and result["chief"]["from_file"] is True
    assert {v["name"]: v["digest"] for v in result["variables"]} == {
        n: xxhash.xxh3_128_hexdigest(b) for n, b in tensor_bytes(ckpt).items()}
    assert all(w["digest"] == w["expected_digest"] for w in result["workers"]) and len(result["workers"]) == 2
    rss = result["chief"]["peak_rss_bytes"]
    assert rss < 200 << 20, f"rank 0 peak RSS {rss / 2**20:.1f} MiB: a copy of the 256 MiB model, not its files"


def test_collective_launch_passes_from_file_to_mpiexec(tmp_path):
    ckpt = tmp_path / "ckpt"
    from collective.bench.checkpoint import write_checkpoint

    write_checkpoint(ckpt, 4 << 20, 2, tensor_bytes=1 << 20)
    proc = subprocess.run(
        [sys.executable, "-m", "collective.cli", "launch", "--transport", "mpi", "--workers", "2", "--json", "--quiet",
         "--run-dir", str(tmp_path / "run"), "--model", str(ckpt), "--from-file"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["ok"] is True and result["transport"] == "mpi" and result["chief"]["from_file"] is True


def test_shards_from_the_files_under_mpiexec(tmp_path):
    """--from-file with --shards dim0 under mpiexec: each worker rank's own stream, point to point,
    read from the mapped files; each holds its half, verified."""
    from collective.bench.checkpoint import write_checkpoint

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, 16 << 20, 2, tensor_bytes=2 << 20)
    proc = mpirun(3, "--model", str(ckpt), "--from-file", "--shards", "dim0", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["ok"] is True and result["chief"]["from_file"] is True
    model = result["bytes"]
    for w in result["workers"]:
        assert w["digest"] == w["expected_digest"]
        assert 0.45 * model < w["bytes"] <= 0.5 * model + 64 * len(result["variables"]), (w["bytes"], model)
    assert len({w["digest"] for w in result["workers"]}) == 2
