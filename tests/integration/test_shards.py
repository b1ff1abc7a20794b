"""Shards between real processes: ``python -m collective.chief --shards`` and two worker processes
over gRPC (raw TCP data path) on loopback; each worker receives only its half."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

FAST = ["--join-timeout", "30"]


def test_two_worker_processes_each_receive_only_their_shard(cluster):
    chief = cluster.chief("--workers", "2", "--shards", "dim0", *FAST)
    workers = [cluster.worker(f"w{i}", "--rank", str(i), "--devices", "cpu:0,cpu:1", *FAST) for i in range(2)]
    for w in workers:
        assert w.wait(90) == 0, w.output()
    assert chief.wait(30) == 0, chief.output()
    result = json.loads((cluster.tmp / "result.json").read_text())
    assert result["ok"], result
    model = result["bytes"]
    by_rank = {w["rank"]: w for w in result["workers"]}
    assert [by_rank[r]["shard"] for r in (0, 1)] == [0, 1]
    for w in by_rank.values():
        # Half of the model each, give or take the 64-byte alignment of each piece.
        assert 0.45 * model < w["bytes"] <= 0.5 * model + 64 * len(result["variables"]), (w["bytes"], model)
        assert w["digest"] == w["expected_digest"]
    assert by_rank[0]["digest"] != by_rank[1]["digest"]
    for i, w in enumerate(workers):
        out = w.output()
        assert f"shard {i} of 2: {by_rank[i]['bytes']} of the model's {model} bytes" in out, out
    assert "training started: 2 workers hold their shards" in chief.output()


def test_a_worker_given_nothing_takes_an_empty_stream_over_the_raw_data_path(cluster):
    chief = cluster.chief("--workers", "2", "--shards", '{"*": 0}', *FAST)
    workers = [cluster.worker(f"w{i}", "--rank", str(i), *FAST) for i in range(2)]
    for w in workers:
        assert w.wait(90) == 0, w.output()
    assert chief.wait(30) == 0, chief.output()
    by_rank = {w["rank"]: w for w in json.loads((cluster.tmp / "result.json").read_text())["workers"]}
    assert by_rank[1]["bytes"] == 0 and by_rank[1]["replicas"] == 0 and by_rank[0]["replicas"]


@pytest.mark.parametrize(("value", "says"), [
    ('{"nope": 0, "*": "all"}', "not variables of the model: 'nope'"),
    ('{"*": 5}', "rank 5 is out of range: 2 training rank(s) are 0..1"),
    ("rows", "--shards"),
])
def test_an_impossible_shard_request_ends_the_chief_with_exit_2_and_one_line(cluster, value, says):
    chief = cluster.chief("--workers", "2", "--shards", value, wait_port=False)
    assert chief.wait(30) == 2
    out = chief.output()
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert says in lines[-1] and "Traceback" not in out, out  # one line (argparse puts its usage above)
    if value != "rows":  # refused by the chief's round, not by argparse: its summary blames it, phase load
        result = json.loads((cluster.tmp / "result.json").read_text())
        assert (result["culprit"], result["error_phase"], result["exit_code"]) == ("chief", "load", 2), result
