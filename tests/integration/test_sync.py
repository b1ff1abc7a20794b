"""collective.sync in real processes: every rank calls it, rank 0's values win, bit for bit.

Roles come from COLLECTIVE_*, from torchrun's variables, from a TF_CONFIG with only workers, and
from a real mpiexec; in each, rank 0 trains too (it holds replicas of its own).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.integration.test_mpi import MPIEXEC
from tests.procs import ROOT, Proc, kill_tree, run_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

WORLD = 3
SCRIPT = str(ROOT / "tests" / "sync_rank.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_env(rank: int, port: int) -> dict[str, str]:
    return {"COLLECTIVE_RANK": str(rank), "COLLECTIVE_WORLD_SIZE": str(WORLD), "COLLECTIVE_CHIEF": f"127.0.0.1:{port}"}


def torchrun_env(rank: int, port: int) -> dict[str, str]:
    # The chief listens on MASTER_PORT+1 (torchrun's store holds MASTER_PORT).
    return {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port - 1)}


def tf_config_env(rank: int, port: int) -> dict[str, str]:
    workers = [f"127.0.0.1:{port}"] + [f"127.0.0.1:{free_port()}" for _ in range(WORLD - 1)]
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})}


def run_ranks(tmp_path, env_for, extra: dict[str, str] | None = None) -> list[dict]:
    port = free_port()
    codes, outputs = run_all([SCRIPT], [tmp_path / f"rank{r}.log" for r in range(WORLD)],
                             [{**env_for(r, port), **(extra or {})} for r in range(WORLD)], 120)
    return [_result(out, code) for out, code in zip(outputs, codes, strict=True)]


def _result(output: str, code: int) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"exit {code}, no result line:\n{output}"
    result = json.loads(lines[-1])
    result["exit"], result["log"] = code, output
    return result


def assert_every_rank_holds_rank_0s_inputs(results: list[dict]) -> None:
    for r in results:
        assert r["exit"] == 0 and "error" not in r, r["log"]
    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == list(range(WORLD))
    want = by_rank[0]["inputs"]
    assert by_rank[1]["inputs"] != want  # the ranks really started from different values
    for r in results:
        assert r["world_size"] == WORLD and r["devices"] == ["cpu:0", "cpu:1"]
        assert r["held"] == [want, want], f"rank {r['rank']} holds other values"
    assert len({r["digest"] for r in results}) == 1


@pytest.mark.parametrize("env_for", [collective_env, torchrun_env, tf_config_env],
                         ids=["COLLECTIVE_vars", "torchrun", "TF_CONFIG_workers_only"])
def test_three_processes_calling_sync_all_end_with_rank_0s_values(tmp_path, env_for):
    assert_every_rank_holds_rank_0s_inputs(run_ranks(tmp_path, env_for))


def test_ranks_that_pass_no_values_receive_rank_0s(tmp_path):
    assert_every_rank_holds_rank_0s_inputs(run_ranks(tmp_path, collective_env, {"SYNC_NO_VALUES": "1"}))


def assert_each_rank_holds_its_rows(results: list[dict]) -> None:
    for r in results:
        assert r["exit"] == 0 and "error" not in r, r["log"]
        assert r["held"] == [r["expected"], r["expected"]], f"rank {r['rank']} holds other rows"
        if r["rank"]:
            # 4 variables, each 64-byte aligned; the 0-d "step" goes to every rank.
            assert r["bytes_received"] <= r["model_bytes"] / WORLD + 4 * 64 + 8, r
            assert r["plan_bytes"] > 0
    assert len({r["digest"] for r in results}) == WORLD  # each rank verified its own shard
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[1]["held"][0]["step"] == by_rank[0]["inputs"]["step"]  # 0-d: whole everywhere


def test_shards_over_grpc_each_rank_receives_only_its_rows(tmp_path):
    """Three processes (torchrun's variables): rank 0 asks for dim0 shards; each rank holds on
    both devices exactly its rows of rank 0's values and received about a third of the model."""
    assert_each_rank_holds_its_rows(run_ranks(tmp_path, torchrun_env, {"SYNC_SHARDS": "dim0"}))


def test_shards_under_mpiexec_each_rank_receives_only_its_rows(tmp_path):
    """The same under a real mpiexec: each rank's plan and stream are its own, point to point
    from rank 0 (a Bcast is one stream to all)."""
    proc, results = mpirun_sync(tmp_path, {"SYNC_SHARDS": "dim0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(results) == WORLD, proc.stdout + proc.stderr
    assert_each_rank_holds_its_rows(results)


def write_rank_0s_values(tmp_path) -> str:
    from safetensors.numpy import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from sync_rank import values_for

    path = tmp_path / "rank0.safetensors"
    save_file(values_for(0), str(path))
    return str(path)


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_rank_0_serves_its_checkpoint_from_the_file_and_each_rank_receives_its_rows(tmp_path, launcher):
    """sync(path, from_file=True, shards="dim0") on rank 0, as an FSDP job would hand over a
    checkpoint: the file is mapped, not copied, and each rank holds its rows of it."""
    extra = {"SYNC_FROM_FILE": write_rank_0s_values(tmp_path), "SYNC_SHARDS": "dim0"}
    if launcher == "torchrun":
        results = run_ranks(tmp_path, torchrun_env, extra)
    else:
        proc, results = mpirun_sync(tmp_path, extra)
        assert proc.returncode == 0 and len(results) == WORLD, proc.stdout + proc.stderr
    assert_each_rank_holds_its_rows(results)
    assert {r["rank"]: r.get("from_file") for r in results} == {0: True, 1: None, 2: None}


def assert_everyone_fails_naming_rank_2(results: list[dict], rank_2: str) -> None:
    for r in results:
        assert r["exit"] != 0, r["log"]
        assert rank_2 in r["log"], r["log"]
        for difference in ("dense/kernel: chief (33, 17) float32 vs worker (33, 16)", "dense/bias: chief (17,) float64 vs worker (17,) float32", "extra: chief (missing)"):
            assert difference in r["log"], r["log"]


def test_a_declared_variable_mismatch_on_rank_2_fails_every_rank_naming_it(tmp_path):
    # Rank 1 starts late, after rank 2's join has failed the round: the chief keeps serving until
    # rank 1 has heard the cause (before, rank 1 found a closed port and blamed the chief).
    results = run_ranks(tmp_path, collective_env, {"SYNC_MISMATCH_RANK": "2", "SYNC_LATE_RANK": "1"})
    assert_everyone_fails_naming_rank_2(results, "rank-2@")
    # Not only in the message: every rank's error names rank 2 as the culprit, in the join phase.
    for r in results:
        assert (r["culprit"] or "").startswith("rank-2@") and r["phase"] == "join", (r["culprit"], r["phase"], r["log"])


@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_shards_request_on_rank_0_reaches_every_rank_at_once(tmp_path, world):
    """Rank 0 asks for shards of a variable its model lacks; every rank starts at once. Rank 0
    binds its port before checking, so every other rank's join is answered with rank 0's own
    error (exit 2, naming 'nope'), long before the 300 s join timeout: a rank that had to wait
    it out would overrun this test's 120 s wait (before: rank 0 exited and the others waited it
    out, then blamed an unreachable chief)."""
    port = free_port()
    envs = [{"COLLECTIVE_RANK": str(r), "COLLECTIVE_WORLD_SIZE": str(world), "COLLECTIVE_CHIEF": f"127.0.0.1:{port}",
             "SYNC_SHARDS": "bad", "SYNC_JOIN_TIMEOUT": "300"} for r in range(world)]
    codes, outputs = run_all([SCRIPT], [tmp_path / f"rank{r}.log" for r in range(world)], envs, 120)
    for code, output in zip(codes, outputs, strict=True):
        r = _result(output, code)
        assert r["exit"] == 2 and r["error"] == "UsageError", r["log"]
        assert "not variables of the model: 'nope'" in r["message"], r["log"]


# --- under a real mpiexec ------------------------------------------------------------------


def mpirun_sync(tmp_path, extra: dict[str, str] | None = None) -> list[dict]:
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("COLLECTIVE_") and k not in ("TF_CONFIG", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    env["SYNC_OUT"] = str(tmp_path)
    proc = subprocess.run([MPIEXEC, "-n", str(WORLD), sys.executable, SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    lines = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    for line in lines:
        line["exit"], line["log"] = (1 if "error" in line else 0), proc.stdout + proc.stderr
    return proc, lines


@pytest.mark.parametrize("ranks", [2, 3])
def test_under_mpiexec_a_bad_shards_request_on_rank_0_reaches_every_rank_at_once(tmp_path, ranks):
    """Rank 0 asks for shards of a variable its model lacks, under a real mpiexec. Every rank
    joins MPI before any check can fail, and rank 0's error is every other rank's answer at the
    join step: each rank raises it (naming 'nope'), the job ends well within the join timeout
    (300 s), no MPI_Abort. Before: rank 0 raised before MPI_Init and the others spun at
    100% CPU inside theirs for ever, deaf to Ctrl-C (this test waited out its 120 s)."""
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: `make test` installs the mpich wheel (the `mpi` extra)")
    env = {"SYNC_SHARDS": "bad", "SYNC_JOIN_TIMEOUT": "300", "SYNC_OUT": str(tmp_path)}
    job = Proc([SCRIPT], tmp_path / "job.log", env=env, launcher=[MPIEXEC, "-n", str(ranks)])
    try:
        code = job.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end within 120 s:\n{job.output()}")
    finally:
        kill_tree(job)
    out = job.log.read_text()
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in results] == list(range(ranks)), out
    for r in results:
        assert r["error"] == "UsageError" and "not variables of the model: 'nope'" in r["message"], out
    # Each rank's script exits 2 once it raised; mpiexec kills the ranks still on their way out
    # when the first exits (then it exits 9): either way, no rank was left behind.
    assert code in (2, 9) and "MPI_Abort" not in out, out


def test_under_mpiexec_the_other_ranks_wait_asleep_while_rank_0_loads_its_values(tmp_path):
    """Rank 0's values take 20 s to load (a callable). Every rank enters MPI first, so the others
    wait for rank 0 in the join step's non-blocking barrier, asleep: each uses a small part of a
    core meanwhile (measured at load 36 on two cores: 0.33 s of CPU in a 21.7 s call). Before,
    rank 0 loaded before its MPI_Init and the others spun inside theirs (sched_yield) all that
    time, taking whatever share of a core the machine gave them (3.24 s in 21.5 s at that load;
    a whole core on a quiet machine)."""
    proc, results = mpirun_sync(tmp_path, {"SYNC_SLOW_VALUES": "20"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_every_rank_holds_rank_0s_inputs(results)
    for r in results:
        if r["rank"]:
            assert r["wall"] > 20 and r["cpu"] < 0.1 * r["wall"], (r["cpu"], r["wall"], r["log"])


def test_under_mpiexec_every_rank_ends_with_rank_0s_values(tmp_path):
    proc, results = mpirun_sync(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_every_rank_holds_rank_0s_inputs(results)


def test_under_mpiexec_a_mismatch_on_rank_2_fails_every_rank_naming_it(tmp_path):
    proc, results = mpirun_sync(tmp_path, {"SYNC_MISMATCH_RANK": "2"})
    assert proc.returncode != 0
    assert len(results) == WORLD, proc.stdout + proc.stderr
    assert_everyone_fails_naming_rank_2(results, "mpi-rank-2")


def test_collective_mpi_with_chief_trains_verifies_rank_0s_own_replicas(tmp_path):
    from tests.integration.test_mpi import last_json, mpirun

    proc = mpirun(3, "--chief-trains", "--devices-per-worker", "2", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = last_json(proc.stdout)
    assert summary["ok"] and summary["chief_replicas"]["devices"] == ["cpu:0", "cpu:1"]
    assert {w["digest"] for w in summary["workers"]} == {summary["chief_replicas"]["digest"]}
    assert "the chief's own replicas (training rank 0" in proc.stderr

    plain = last_json(mpirun(3, "--json").stdout)
    assert plain["ok"] and plain["chief_replicas"] is None  # off by default for the command (the key is always there)


def serve_and_join(values, worker_ids: list[str], **serve_kwargs) -> list:
    """``collective.serve(values, **serve_kwargs)`` on loopback (port 0) and one
    ``collective.join`` per id in ``worker_ids``, each on a thread of this process: [chief, *workers]
    results (or the exception each raised)."""
    import threading

    import collective
    from tests.clusters import run_threads

    t = collective.Timeouts(join=20, ready=20, start=20, linger=1, heartbeat=1, lease=10)
    listening: list = []
    port_known = threading.Event()

    def on_listening(address, port):
        listening.append(port)
        port_known.set()

    def worker(name):
        assert port_known.wait(20)
        return collective.join(f"127.0.0.1:{listening[0]}", worker_id=name, devices="cpu:0", timeouts=t,
                               relay_host=None)

    results = run_threads([
        lambda: collective.serve(values, bind="127.0.0.1:0", timeouts=t, shm=False, on_listening=on_listening,
                                 **serve_kwargs),
        *[lambda name=name: worker(name) for name in worker_ids],
    ], timeout=60)
    for r in results:
        assert not isinstance(r, BaseException), r
    return results


def test_serve_and_join_in_one_process_off_the_main_thread(monkeypatch):
    """serve() off the main thread installs no signal handlers (Python forbids it there) and is
    sized from COLLECTIVE_WORKERS like the command; join() takes the chief it reports."""
    import numpy as np

    monkeypatch.setenv("COLLECTIVE_WORKERS", "2")
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.int8)}
    chief, w1, w2 = serve_and_join(arrays, ["a", "b"], devices="cpu:0,cpu:1")
    assert chief.summary["ok"] and len(chief.summary["workers"]) == 2 and chief.world_size == 3
    for i in range(2):
        assert {k: v.tobytes() for k, v in chief.arrays(i).items()} == {k: v.tobytes() for k, v in arrays.items()}
    assert w1.variables.get("w").replicas[0].tobytes() == arrays["w"].tobytes()


@pytest.mark.parametrize("how", ["argument", "variable"])
def test_serve_takes_from_file_as_an_argument_or_from_its_variable(tmp_path, monkeypatch, how):
    """serve(path, from_file=True) (or COLLECTIVE_FROM_FILE=1) serves a sharded checkpoint from
    its files, as the command's --from-file does; the workers get the files' exact values."""
    from tests.unit.test_sharded import values, write_sharded

    arrays = values()
    index, _ = write_sharded(tmp_path, arrays, 2)
    if how == "variable":
        monkeypatch.setenv("COLLECTIVE_FROM_FILE", "1")
    chief, w = serve_and_join(str(index), ["w"], workers=1, from_file=True if how == "argument" else None)
    assert chief.summary["ok"] and chief.summary["chief"]["from_file"] is True, chief.summary
    for name, value in arrays.items():
        assert w.variables.get(name).replicas[0].tobytes() == value.tobytes()


SERVE_ON_MAIN = """
import sys, collective
try:
    collective.serve("mlp", workers=1, bind="127.0.0.1:0", timeouts=collective.Timeouts(join=60),
                     on_listening=lambda address, port: print("listening", port, flush=True))
except collective.AbortedError as exc:
    print("aborted:", exc, flush=True)
    sys.exit(3)
"""


def test_serve_on_the_main_thread_turns_sigint_into_an_aborted_round(tmp_path):
    import signal

    script = tmp_path / "serve.py"
    script.write_text(SERVE_ON_MAIN)
    proc = Proc([str(script)], tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 60
        while "listening" not in proc.output():
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.output()
            time.sleep(0.05)
        proc.signal(signal.SIGINT)
        assert proc.wait(30) == 3, proc.output()
        assert "aborted: chief interrupted (SIGINT)" in proc.output()
    finally:
        proc.kill()
