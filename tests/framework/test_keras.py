"""collective.tf: Keras variables under MirroredStrategy take rank 0's values on every replica,
in real processes (2 processes x 2 logical CPU devices)."""

from __future__ import annotations

import pytest

from tests.framework.conftest import require
from tests.framework.launchers import spmd_lines

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
