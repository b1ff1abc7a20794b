"""collective bench --recovery's report: every run set against the faster torchft transport of the
same run."""

from __future__ import annotations

from collective.bench.recovery import CANDIDATES, Row, per_run


def test_the_recovery_bench_sets_each_collective_run_against_the_faster_torchft_of_that_run():
    # "On every run of five": run i of a collective row against the fastest torchft row's run i.
    seconds = {"http0": [1.0, 2.0], "http8": [0.8, 3.0], "pg": [0.9, 1.0], "collective": [0.4, 0.9],
               "collective-copy": [0.2, 0.1]}
    rows = [Row(c, seconds[c.kind]) for c in CANDIDATES]
    lines = per_run(rows)
    assert lines[0] == ("collective-1-holder: x the faster torchft of the same run, run by run: 0.50 0.90 "
                        "(largest 0.90)"), lines
    assert lines[-1].endswith("0.25 0.10 (largest 0.25)") and len(lines) == 3, lines
