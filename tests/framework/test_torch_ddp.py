"""examples/torch_ddp.py under torch's own launcher and under mpiexec: every rank starts DDP from
rank 0's values bit for bit (checked by the script over gloo), then trains in lockstep."""

from __future__ import annotations

import pytest

from tests.framework.conftest import require
from tests.framework.launchers import mpiexec, rank_lines, spmd, torchrun

pytestmark = pytest.mark.integration

SCRIPT = "examples/torch_ddp.py"
LINE = (r"rank (?P<rank>\d)/3: own init (?P<own>\w+) -> rank 0's (?P<init>\w+) \(same on all 3 ranks: True\); "
        r"5 DDP steps \(init_sync=False\), loss [\d.]+, final (?P<final>\w+) \(same on all ranks: True\)")


def assert_rank_0s_values_then_lockstep(code: int, out: str) -> None:
    assert code == 0, out
    lines = rank_lines(out, LINE)
    assert sorted(lines) == [0, 1, 2], out
    assert len({m["init"] for m in lines.values()}) == 1 and len({m["final"] for m in lines.values()}) == 1
    assert lines[0]["own"] == lines[0]["init"]
    # Every other rank had built different values (its own seed) before the sync.
    assert all(lines[r]["own"] != lines[0]["init"] for r in (1, 2))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torchrun_three_processes_start_ddp_from_rank_0s_values(dtype):
    require("torch")
    assert_rank_0s_values_then_lockstep(*torchrun(SCRIPT, 3, {"TORCH_DDP_DTYPE": dtype}))


def test_mpiexec_three_processes_start_ddp_from_rank_0s_values():
    require("torch")
    require("mpi4py")
    assert_rank_0s_values_then_lockstep(*mpiexec(SCRIPT, 3))


def assert_names_each_difference(text: str) -> None:
    assert "5 difference(s)" in text, text
    assert "0.weight: chief (16, 8) float32 vs worker (24, 8) float32" in text, text
    assert "3.weight: chief (1, 16) float32 vs worker (1, 24) float32" in text, text


def test_a_rank_with_another_model_fails_every_rank_listing_each_difference():
    # Plain processes: each rank lives until it has heard the outcome, so every rank must say why.
    require("torch")
    for code, out in spmd(SCRIPT, 3, {"TORCH_DDP_MISMATCH_RANK": "2"}):
        assert code != 0, out
        errors = rank_lines(out, r"rank (?P<rank>\d): error: (?P<text>.*)")
        assert len(errors) == 1, out
        text = next(iter(errors.values()))["text"]
        assert_names_each_difference(text)
        # The docs' promise: PreconditionError on every rank (rank 1, not at fault, had AbortedError).
        assert text.startswith("PreconditionError: "), out
        assert "DDP steps" not in out  # nobody trained


def test_torchrun_a_rank_with_another_model_fails_the_job_naming_each_difference():
    # torchrun stops the other ranks (SIGTERM) as soon as one exits with an error, so a rank that
    # had not yet heard the outcome may be stopped first: the failing rank and rank 0 (the chief)
    # always say why, and every rank that prints an error names the differences.
    require("torch")
    code, out = torchrun(SCRIPT, 3, {"TORCH_DDP_MISMATCH_RANK": "2"})
    assert code != 0
    errors = rank_lines(out, r"rank (?P<rank>\d): error: (?P<text>.*)")
    assert {0, 2} <= set(errors), out
    for m in errors.values():
        assert_names_each_difference(m["text"])
        assert m["text"].startswith("PreconditionError: "), out  # every rank that says why, rank 1 too
    assert "DDP steps" not in out  # nobody trained
