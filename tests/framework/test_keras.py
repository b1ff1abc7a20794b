"""collective.tf: Keras variables under MirroredStrategy take rank 0's values on every replica,
in real processes (2 processes x 2 logical CPU devices)."""

from __future__ import annotations

import pytest

from tests.framework.conftest import require
from tests.framework.launchers import spmd, spmd_lines

pytestmark = pytest.mark.integration

SCRIPT = "examples/keras_sync.py"
LINE = (r"rank (?P<rank>\d): own init (?P<own>\w+) -> synced (?P<synced>\w+) on 2 devices \(all replicas equal: True; "
        r"sequential/hidden/kernel:0 / sequential/hidden/kernel/replica_1:0\); fit 4 steps, replicas equal after: True")


@pytest.mark.timeout(400)
def test_two_processes_two_devices_each_keras_model_holds_rank_0s_values():
    require("tensorflow")
    lines = spmd_lines(SCRIPT, 2, LINE, {"KERAS_SYNC_DTYPE": "bfloat16"}, timeout=360)
    assert sorted(lines) == [0, 1]
    assert lines[0]["synced"] == lines[1]["synced"] == lines[0]["own"] != lines[1]["own"]


@pytest.mark.timeout(400)
def test_a_keras_model_that_differs_on_rank_1_fails_both_ranks_listing_the_differences():
    require("tensorflow")
    results = spmd(SCRIPT, 2, {"KERAS_SYNC_MISMATCH_RANK": "1"}, timeout=360)
    for code, out in results:
        assert code != 0, out
        assert "rank-1@" in out and "3 difference(s)" in out, out
        for difference in ("sequential/hidden/kernel: chief (8, 16) float32 vs worker (8, 15) float32",
                           "sequential/hidden/bias: chief (16,) float32 vs worker (15,) float32",
                           "sequential/out/kernel: chief (16, 1) float32 vs worker (15, 1) float32"):
            assert difference in out, out
        assert "fit 4 steps" not in out  # nobody trained
