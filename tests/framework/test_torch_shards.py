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
        r"(?P<shards>\d+) shards, model/shards \d+, plan (?P<plan>\d+), within 1.05 x model/shards \+ plan: "
        r"(?P<within>True|False)\); one FSDP step \(loss (?P<loss>[\d.]+)\)")


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


def test_torchrun_hsdp_on_a_2x2_mesh_each_replica_group_takes_rank_0s_model_in_halves():
    """HSDP: (Replicate(), Shard(0)) over a 2x2 mesh. Ranks 0 and 2 hold shard 0, ranks 1 and 3
    shard 1: each receives about half the model (rank 0, the chief, nothing), and every
    DTensor's full_tensor() is rank 0's initial state on every rank."""
    require("torch")
    code, out = torchrun(SCRIPT, 4, env={"TORCH_SHARDS_MESH": "2x2"})
    assert code == 0, out
    lines = rank_lines(out, LINE)
    assert sorted(lines) == [0, 1, 2, 3], out
    for rank, m in lines.items():
        assert m["shards"] == "2" and m["initial"] == "True" and m["within"] == "True", out
        model, plan, received = int(m["model"]), int(m["plan"]), int(m["received"])
        assert received <= 1.05 * model / 2 + plan, out
        if rank:
            assert received > 0.9 * model / 2 and m["own"] != m["after"], out
    # Rank 2 holds shard 0, as rank 0 does: after the sync its local shards are rank 0's own.
    assert lines[2]["after"] == lines[0]["after"] and lines[3]["after"] == lines[1]["after"], out
    assert lines[0]["after"] != lines[1]["after"]
    assert len({m["whole"] for m in lines.values()}) == 1 and len({m["loss"] for m in lines.values()}) == 1
