"""What a round's summary says: the same JSON keys wherever it is printed (``collective launch``
over gRPC or MPI, ``python -m collective.mpi --json``), on failure too; the chief's cause and exit
code under mpiexec; the phases that make up the time; the bytes each worker really received."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from collective.chief.reports import PHASES, SUMMARY_KEYS
from collective.config import Timeouts
from tests.clusters import SLOW_RECEIVER
from tests.integration.test_launch import _launch
from tests.integration.test_mpi import MPIEXEC, last_json, mpirun
from tests.procs import wait_for, wait_until

pytestmark = pytest.mark.integration

# mpiexec beside this interpreter, for launch --transport mpi
MPI_ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _shape(result: dict) -> tuple[set, set, dict]:
    """Top-level keys, a worker entry's keys, and the type of every value that is not null."""
    worker_keys = {k for w in result["workers"] for k in w}
    types = {k: type(v).__name__ for k, v in result.items() if v is not None}
    types.update({f"workers.{k}": type(v).__name__ for w in result["workers"] for k, v in w.items() if v is not None})
    return set(result), worker_keys, types


def test_launch_grpc_launch_mpi_and_collective_mpi_print_one_shape_of_json(tmp_path):
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    grpc = _launch(tmp_path / "grpc", "--workers", "2", "--json", "--quiet", "--join-timeout", "30")
    over_mpi = _launch(tmp_path / "mpi", "--transport", "mpi", "--workers", "2", "--json", "--quiet",
                       "--join-timeout", "30", env=MPI_ENV)
    bare = mpirun(3, "--json")
    lines = {}
    for name, proc in (("launch", grpc), ("launch --transport mpi", over_mpi), ("collective.mpi", bare)):
        assert proc.returncode == 0, (name, proc.stderr)
        lines[name] = last_json(proc.stdout)
    shapes = {name: _shape(line) for name, line in lines.items()}
    for name, (keys, worker_keys, types) in shapes.items():
        assert keys == set(SUMMARY_KEYS), (name, keys ^ set(SUMMARY_KEYS))
        assert worker_keys == shapes["launch"][1], (name, worker_keys ^ shapes["launch"][1])
        common = types.keys() & shapes["launch"][2].keys()
        assert {k: types[k] for k in common} == {k: shapes["launch"][2][k] for k in common}, name
        # A count everywhere (it was a list of every name under collective.mpi): 7 variables, 1 device.
        assert [w["replicas"] for w in lines[name]["workers"]] == [7, 7], name
        assert lines[name]["exit_code"] == 0 and lines[name]["failed_processes"] == {}, name


def test_launch_under_mpi_with_a_bad_model_exits_2_with_the_chiefs_own_message(tmp_path):
    # Before: exit 1 and `error  rank 0: aborting the job (MPI_Abort, exit code 2)`; the cause
    # only in the `mpi |` stream.
    proc = _launch(tmp_path, "--transport", "mpi", "--workers", "2", "--model", "nothere", "--json", "--quiet",
                   env=MPI_ENV)
    assert proc.returncode == 2, proc.stderr
    result = last_json(proc.stdout)
    assert "model 'nothere': no such file or preset" in result["error"], result["error"]
    assert "MPI_Abort" not in result["error"]
    assert (result["culprit"], result["error_phase"], result["model"]) == ("chief", "load", "nothere")
    assert set(result) == set(SUMMARY_KEYS)
    assert f"  error       {result['error']}" in proc.stderr


def test_a_bad_model_over_grpc_gives_every_key_naming_the_chief_and_the_load_phase(tmp_path):
    # Before: no culprit, error_phase or model in the JSON.
    proc = _launch(tmp_path, "--workers", "1", "--model", str(tmp_path / "nope.yaml"), "--json", "--quiet")
    assert proc.returncode == 2, proc.stderr
    result = last_json(proc.stdout)
    assert set(result) == set(SUMMARY_KEYS)
    assert (result["culprit"], result["error_phase"]) == ("chief", "load")
    assert result["model"].endswith("nope.yaml") and "nope.yaml" in result["error"]
    assert result["failed_processes"] == {"chief": 2} and result["exit_code"] == 2


def test_the_chief_writes_its_summary_as_soon_as_the_round_fails_not_after_its_linger(cluster, tmp_path):
    """w0 is frozen mid-stream (the chief's sender blocks on flow control, so it cannot tell w0
    the outcome and lingers its 5 s), w1 is killed. The summary must be written when the round
    fails: once in 4 tries, launch SIGKILLed a chief lingering so (3 s after SIGTERM) and printed
    `model -`, `workers 0`, `culprit: null`. Before, the file came only as the chief ended."""
    spec = tmp_path / "model.yaml"  # 64 MiB in 64 KiB chunks: a slow receiver takes 5 s or more
    spec.write_text("variables:\n  - {name: w, shape: [4096, 4096], dtype: float32, initializer: zeros}\n")
    chief = cluster.chief("--workers", "2", "--model", str(spec), "--no-shm", "--chunk-bytes", "65536")
    w0 = cluster.worker("w0", "--rank", "0", "--no-shm", code=SLOW_RECEIVER)
    w1 = cluster.worker("w1", "--rank", "1", "--no-shm")
    wait_for(w0, "receiving from chief")  # its stream is under way
    wait_for(w1, "verified")
    w0.signal(signal.SIGSTOP)
    try:
        w1.signal(signal.SIGKILL)
        killed = time.monotonic()
        result_file = cluster.tmp / "result.json"
        wait_until(lambda: result_file.exists() or chief.proc.poll() is not None, "the summary", timeout=60)
        waited = time.monotonic() - killed
        # Within the chief's 5 s linger (it waits for frozen w0): before, 6.5 s, as the chief ended.
        assert chief.proc.poll() is None and waited < Timeouts().linger - 1, (waited, chief.output())
        result = json.loads(result_file.read_text())
    finally:
        w0.signal(signal.SIGCONT)
    assert result["ok"] is False and result["culprit"] == "w1" and result["error_phase"] == "broadcast", result
    assert set(result) == set(SUMMARY_KEYS) and [w["id"] for w in result["workers"]] == ["w0", "w1"]
    assert chief.wait(60) == 1, chief.output()


def test_a_sharded_launch_reports_each_workers_own_bytes_and_says_shards(tmp_path):
    # Before: launch had no --shards (only COLLECTIVE_SHARDS), and GiB/s counted the whole model per worker.
    proc = _launch(tmp_path, "--workers", "2", "--shards", "dim0", "--json", "--join-timeout", "30")
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["shards"] == "dim0"
    got = [w["bytes"] for w in result["workers"]]
    assert all(0 < b < result["bytes"] for b in got) and sum(got) <= result["bytes"] + 64 * 7 * 2, got
    assert [w["shard"] for w in result["workers"]] == [0, 1]
    assert "  shards      dim0 (each worker receives its own part, not a replica)" in proc.stderr
    assert "the bytes each worker received, over the broadcast phase; 2 streamed" in proc.stderr


def test_from_file_with_a_preset_says_it_was_ignored(tmp_path):
    proc = _launch(tmp_path, "--workers", "1", "--from-file", "--json", "--quiet", "--join-timeout", "30")
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert len(result["warnings"]) == 1 and "--from-file was ignored" in result["warnings"][0]
    assert f"  WARNING     {result['warnings'][0]}" in proc.stderr


def test_the_summary_shows_each_phase_and_the_total_and_workers_say_what_they_timed(tmp_path):
    proc = _launch(tmp_path, "--workers", "2", "--no-shm", "--json", "--join-timeout", "30")
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    phases = result["phases"]
    assert list(phases) == [*PHASES, "total"] and all(isinstance(v, float) for v in phases.values()), phases
    assert abs(sum(phases[p] for p in PHASES) - phases["total"]) < 0.002, phases  # back to back
    assert result["topology"] == "star" and result["wall_seconds"] >= phases["total"]
    time_line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("  time "))
    for name in PHASES:
        assert f"{name} {phases[name]:.3f}" in time_line, time_line
    assert "  wall        " in proc.stderr and "topology star" in proc.stderr
    # The worker logs its preparation apart from its transfer, and says what each figure spans.
    for i in range(2):
        worker = (tmp_path / f"worker-{i}.log").read_text()
        assert "prepared to receive 940616 bytes in" in worker, worker
        assert "received 940616 bytes through the network in" in worker and "from every worker prepared" in worker
    assert {w["via"] for w in result["workers"]} == {"stream"}


def test_workers_that_map_shared_memory_are_reported_as_mapped_not_as_a_network_rate(tmp_path):
    # Before: `GiB/s 15.856 aggregate` for a mapping.
    proc = _launch(tmp_path, "--workers", "2", "--json", "--join-timeout", "30")
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert {w["via"] for w in result["workers"]} == {"shm"}
    assert "GiB/s" not in proc.stderr and "2 worker(s) mapped the chief's arena through shared memory" in proc.stderr
    assert "mapped 940616 bytes through shared memory" in (tmp_path / "worker-0.log").read_text()
