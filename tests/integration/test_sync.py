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

import pytest

from tests.integration.test_mpi import MPIEXEC
from tests.procs import ROOT, Proc

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
    procs = [Proc([SCRIPT], tmp_path / f"rank{r}.log", env={**env_for(r, port), **(extra or {})}) for r in range(WORLD)]
    try:
        codes = [p.wait(120) for p in procs]
        outputs = [p.output() for p in procs]
    finally:
        for p in procs:
            p.kill()
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


def assert_everyone_fails_naming_rank_2(results: list[dict], rank_2: str) -> None:
    for r in results:
        assert r["exit"] != 0, r["log"]
        assert rank_2 in r["log"], r["log"]
        for difference in ("dense/kernel: chief (33, 17) float32 vs worker (33, 16)", "dense/bias: chief (17,) float64 vs worker (17,) float32", "extra: chief (missing)"):
            assert difference in r["log"], r["log"]


def test_a_declared_variable_mismatch_on_rank_2_fails_every_rank_naming_it(tmp_path):
    results = run_ranks(tmp_path, collective_env, {"SYNC_MISMATCH_RANK": "2"})
    assert_everyone_fails_naming_rank_2(results, "rank-2@")


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


def test_under_mpiexec_every_rank_ends_with_rank_0s_values(tmp_path):
    proc, results = mpirun_sync(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_every_rank_holds_rank_0s_inputs(results)


def test_under_mpiexec_a_mismatch_on_rank_2_fails_every_rank_naming_it(tmp_path):
    proc, results = mpirun_sync(tmp_path, {"SYNC_MISMATCH_RANK": "2"})
    assert proc.returncode != 0
    assert len(results) == WORLD, proc.stdout + proc.stderr
    assert_everyone_fails_naming_rank_2(results, "mpi-rank-2")
