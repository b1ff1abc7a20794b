"""examples/torch_fsdp_shards.py under torchrun --nproc-per-node 4: an FSDP2 module's local shards
become rank 0's rows, each rank receiving only about a quarter of the model (gloo, CPU)."""

from __future__ import annotations

import pytest

from tests.framework.conftest import require
from tests.framework.launchers import rank_lines, torchrun

pytestmark = pytest.mark.integration

SCRIPT = "examples/torch_fsdp_shards.py"
LINE = (r"rank (?P<rank>\d)/4: own shards (?P<own>\w+) -> (?P<after>\w+); whole state (?P<whole>\w+) "
        r"\(rank 0's initial: (?P<initial>True|False)\); received (?P<received>\d+) bytes \(model (?P<model>\d+), "
        r"model/world \d+, plan (?P<plan>\d+), within 1.05 x model/world \+ plan: (?P<within>True|False)\); "
        r"one FSDP step \(loss (?P<loss>[\d.]+)\)")


def test_torchrun_four_processes_fsdp_shards_take_rank_0s_rows_and_only_their_bytes():
    require("torch")
    code, out = torchrun(SCRIPT, 4)
    assert code == 0, out
    lines = rank_lines(out, LINE)
    assert sorted(lines) == [0, 1, 2, 3], out
    for rank, m in lines.items():
        # DTensor.full_tensor() of every parameter equals rank 0's initial state on every rank.
        assert m["initial"] == "True", out
        assert m["within"] == "True", out
        model, plan, received = int(m["model"]), int(m["plan"]), int(m["received"])
        assert received <= 1.05 * model / 4 + plan, out
        if rank:
            assert m["own"] != m["after"]  # its rows really were its own init before
            assert received > 0.9 * model / 4 and plan > 0
        else:
            assert m["own"] == m["after"] and received == 0  # the chief serves; it receives nothing
    assert len({m["whole"] for m in lines.values()}) == 1 and len({m["loss"] for m in lines.values()}) == 1
