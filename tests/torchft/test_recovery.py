"""torchft's own recovery with real torchft: its lighthouse (``torchft_lighthouse``) and two
replica groups (a process each, world size 1, gloo, CPU) training a small model with torchft's
DDP and optimizer wrappers. Groups start from different seeds: ``init_sync`` at step 0 makes
them equal; one group is killed (SIGKILL) and restarted; it recovers from the live one at the next
quorum, and from then on both hold the same model and optimizer state bit for bit."""

from __future__ import annotations

import signal

import pytest

from tests.framework.conftest import require
from tests.torchft.harness import Job

pytestmark = pytest.mark.integration


@pytest.fixture
def job_factory(tmp_path):
    require("torchft")
    jobs = []

    def make(transport: str, **kw) -> Job:
        jobs.append(Job(tmp_path, transport, **kw))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def together(steps: dict[int, tuple[int, str]]) -> list[int]:
    """The steps at which this group trained with the other one."""
    return [s for s, (n, _) in steps.items() if n == 2]


def same_state_after_kill_and_restart(job: Job) -> None:
    a, b = job.replica("a", seed=1), job.replica("b", seed=2)
    # init_sync: from step 0 on, both groups hold the same values although each drew its own.
    a_steps = job.wait_steps(a, lambda s: len(together(s)) >= 3)
    b_steps = job.wait_steps(b, lambda s: len(together(s)) >= 3)
    assert "healing is required step=0, max_step=0" in a.output() + b.output()  # through the transport
    common = sorted(set(together(a_steps)) & set(together(b_steps)))
    assert common, (a_steps, b_steps)
    assert all(a_steps[s][1] == b_steps[s][1] for s in common), (a_steps, b_steps)

    b.signal(signal.SIGKILL)
    b.wait(10)
    # The survivor waits for a second group; the restarted one (another seed) heals from it.
    b2 = job.replica("b2", seed=3)
    b2_steps = job.wait_steps(b2, lambda s: len(together(s)) >= 2)
    assert f"healing is required step=0, max_step={min(b2_steps) - 1}" in b2.output()
    job.stop_at(max(job.steps(a)) + 3, a, b2)
    a_steps, b2_steps = job.steps(a), job.steps(b2)
    common = sorted(set(together(a_steps)) & set(together(b2_steps)))
    assert len(common) >= 3, (a_steps, b2_steps)
    assert all(a_steps[s][1] == b2_steps[s][1] for s in common), (a_steps, b2_steps)
    print(f"final step {common[-1]}: digest {a_steps[common[-1]][1]} on both groups")


def test_torchft_http_transport_recovers_a_killed_group(job_factory):
    # The harness against torchft's own HTTPTransport (its default): what the adapter must match.
    same_state_after_kill_and_restart(job_factory("http"))
