"""collective.torch.check_module under real launchers: examples/torch_check.py trains DDP over
gloo and checks every 5 steps. Ranks that agree share one digest per check; one ulp on one rank
makes every rank raise naming that rank and the tensor, and the job exit non-zero."""

from __future__ import annotations

import pytest

from tests.framework.conftest import require
from tests.framework.launchers import mpiexec, rank_lines, rank_matches, torchrun

pytestmark = pytest.mark.integration

SCRIPT = "examples/torch_check.py"
PASSED = r"rank (?P<rank>\d)/4: step (?P<step>\d+): check passed, digest (?P<digest>[0-9a-f]{32})"
ERROR = r"rank (?P<rank>\d): error: (?P<text>.*)"


def passed_checks(out: str) -> dict[int, dict[int, str]]:
    """step -> rank -> digest of every check that passed."""
    steps: dict[int, dict[int, str]] = {}
    for m in rank_matches(out, PASSED):
        steps.setdefault(int(m["step"]), {})[int(m["rank"])] = m["digest"]
    return steps


def assert_every_rank_names(out: str, rank: int, step: int) -> None:
    errors = rank_lines(out, ERROR)
    assert sorted(errors) == [0, 1, 2, 3], out
    others = ",".join(str(r) for r in range(4) if r != rank)
    for m in errors.values():
        assert m["text"] == (f"replicas differ at step {step}: '0.weight' on rank {rank} differs from ranks "
                             f"{others} (1 of 6 tensor(s) differ on 4 ranks)"), out


def test_torchrun_ranks_that_agree_pass_every_check_with_one_digest():
    require("torch")
    code, out = torchrun(SCRIPT, 4, args=["--steps", "10", "--check-every", "5"])
    assert code == 0, out
    steps = passed_checks(out)
    assert sorted(steps) == [5, 10], out
    for by_rank in steps.values():
        assert sorted(by_rank) == [0, 1, 2, 3] and len(set(by_rank.values())) == 1, out
    assert steps[5][0] != steps[10][0]  # training moved the values; the digest followed


def test_torchrun_one_ulp_on_rank_2_fails_every_rank_naming_rank_2_and_the_tensor():
    require("torch")
    code, out = torchrun(SCRIPT, 4, args=["--steps", "10", "--check-every", "5", "--perturb-rank", "2",
                                          "--perturb-step", "10"])
    assert code != 0, out
    assert sorted(passed_checks(out)) == [5], out  # step 5 still agreed; nothing passed at step 10
    assert_every_rank_names(out, rank=2, step=10)


def test_mpiexec_checks_over_mpi4py_and_names_the_rank_that_differs():
    require("torch")
    require("mpi4py")
    code, out = mpiexec(SCRIPT, 4, args=["--steps", "10", "--check-every", "5", "--check-over", "mpi",
                                         "--perturb-rank", "1", "--perturb-step", "10"])
    assert code != 0, out
    steps = passed_checks(out)
    assert sorted(steps) == [5] and len(set(steps[5].values())) == 1 and len(steps[5]) == 4, out
    assert_every_rank_names(out, rank=1, step=10)


def test_the_benchmark_mode_times_checks_of_a_model_in_16_mib_tensors():
    require("torch")
    code, out = torchrun(SCRIPT, 2, args=["--model-bytes", "32MiB", "--steps", "0", "--repeat", "2"])
    assert code == 0, out
    assert rank_lines(out, r"rank (?P<rank>0)/2: checked 0.03 GiB in 2 tensors on 2 rank\(s\): median [\d.]+ s"), out


# A rank that never reaches the check: the others raise when their deadline passes instead of
# waiting for ever (tests/check_rank.py: rank 1 sleeps 6 s and leaves).
DEADLINE = r"rank (?P<rank>0): error after (?P<seconds>[\d.]+) s: DeadlineError: (?P<text>.*) \(phase check\)"


def test_torchrun_a_rank_that_never_checks_fails_the_others_at_the_process_group_timeout():
    require("torch")
    code, out = torchrun("tests/check_rank.py", 2, args=["torch"])
    assert code != 0, out
    (m,) = rank_lines(out, DEADLINE).values()
    assert m["text"].startswith("collective.check at step 3: not every rank of the torch.distributed group took "
                                "part within the process group's timeout"), out
    assert float(m["seconds"]) < 6, out  # its 3 s timeout, not rank 1's exit, ended the wait


def test_mpiexec_a_rank_that_never_checks_fails_the_others_at_the_timeout():
    require("mpi4py")
    code, out = mpiexec("tests/check_rank.py", 2, args=["mpi"])
    assert code != 0, out
    (m,) = rank_lines(out, DEADLINE).values()
    assert m["text"] == ("not every one of the 2 MPI ranks reached collective.check at step 3 within 2 s "
                         "(rank 0 waited)"), out
    assert float(m["seconds"]) < 6, out
