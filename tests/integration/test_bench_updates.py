"""`collective bench updates`: a tiny real run (real publisher and subscriber processes on this
host) prints one table per state (1% changed, AdamW's share, nothing changed) with every row present and verified; bad input is one line.
No timing is asserted: only the tables' shape, the byte counts' order and the verified column."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from collective.bench.updates import ROWS
from tests.procs import ROOT

RUN = 600  # three states x 2 subscriber counts x 5 rows of processes, and the AdamW measurement
pytestmark = [pytest.mark.integration, pytest.mark.timeout(RUN + 60)]
HEAD = ["row", "subs", "link bytes/step", "% of state", "s/step", "min-max s", "s/step from call", "x faster than fetch",
        "pub make s", "pub peak RSS MiB", "sub apply+verify s", "sub peak RSS MiB", "verified"]


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    return subprocess.run([sys.executable, "-m", "collective.cli", "bench", "updates", *args], capture_output=True,
                          text=True, timeout=RUN, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)


def test_a_tiny_run_prints_every_row_for_both_states_and_every_row_verified():
    proc = bench("--bytes", "256KiB", "--tensors", "4", "--subscribers", "1,2", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 < report["adamw"]["used"] < 1, report["adamw"]
    assert [(t["state"], t["where"]) for t in report["tables"]] == [("a", "one host"), ("b", "one host"),
                                                                   ("c", "one host")]
    for t in report["tables"]:
        assert [(r["name"], r["subscribers"]) for r in t["rows"]] == [(n, s) for s in (1, 2) for n in ROWS]
        for r in t["rows"]:
            assert r["skipped"] is None, r
            assert r["verified"] is True, r
            assert len(r["seconds"]) == len(r["bytes"]) == len(r["apply"]) == 2, r
            assert all(b > 0 for b in r["bytes"]), r  # (seconds: no timing asserted)
        rows = {(r["name"], r["subscribers"]): r for r in t["rows"]}
        if t["state"] == "a":  # 1% changed: the delta is a few % of what the full fetch serves
            for s in (1, 2):
                assert max(rows["collective-delta", s]["bytes"]) * 10 < min(rows["collective-fetch", s]["bytes"])
    # The tables themselves (on stderr with --json): a title, the command, the head, a rule, 10 rows.
    lines = proc.stderr.splitlines()
    heads = [i for i, line in enumerate(lines) if line.split("  ")[0] == "row"]
    assert len(heads) == 3, proc.stderr[-3000:]
    for i in heads:
        assert lines[i - 1] == "$ collective bench updates " + " ".join(
            ["--bytes", "256KiB", "--tensors", "4", "--subscribers", "1,2", "--steps", "2", "--json"])
        assert [c.strip() for c in lines[i].split("  ") if c.strip()] == HEAD
        body = lines[i + 2:i + 12]
        assert [line.split()[0] for line in body] == [n for _ in (1, 2) for n in ROWS]
        assert all(line.split()[-1] == "yes" for line in body), body
        assert lines[i + 12] == ""


@pytest.mark.parametrize("args, says", [
    (["--bytes", "lots"], "--bytes"),
    (["--bytes", "1MiB", "--tensors", "3"], "--tensors"),
    (["--fraction", "2"], "--fraction"),
    (["--rate", "1gbit"], "--emulate-hosts"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    proc = bench(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
