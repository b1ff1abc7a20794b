"""collective logs: merging a run's per-process logs into one timeline."""

from __future__ import annotations

import io
import json
import logging
import os
from datetime import UTC, datetime

import pytest

from collective import logs
from collective.cli.logs import format_records, logs_command, merge_run
from collective.errors import UsageError


def text(t: str, role: str, rank: str, wid: str, phase: str, msg: str, level: str = "INFO") -> str:
    return f"2026-12-02T{t}Z {level} {role} rank={rank} id={wid} phase={phase}: {msg}\n"


def jline(t: str, role: str, rank: str, wid: str, phase: str, msg: str, level: str = "INFO") -> str:
    return json.dumps({"time": f"2026-12-02T{t}Z", "level": level, "role": role, "rank": rank,
                       "worker_id": wid, "phase": phase, "message": msg}) + "\n"


@pytest.fixture
def run(tmp_path):
    """A failed run: worker-1 never got past join, the chief names it at the deadline."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "chief.log").write_text(
        text("13:18:00.100", "chief", "-", "-", "-", "chief abc serving on 127.0.0.1:5000; waiting for 2 worker(s)")
        + text("13:18:00.500", "chief", "-", "-", "join", "worker worker-0 (rank 0, host vm) joined (1/2)")
        + text("13:18:05.000", "chief", "-", "-", "join", "still waiting for 1 worker(s) for rank(s) 1")
        + text("13:18:10.100", "chief", "-", "-", "failed", "1/2 workers joined; missing rank(s) 1", level="ERROR")
    )
    (d / "worker-0.log").write_text(
        text("13:18:00.500", "worker", "0", "worker-0", "join", "joined chief as rank 0 of 2")
        + text("13:18:10.200", "worker", "0", "worker-0", "failed", "round aborted by the chief", level="ERROR")
    )
    (d / "worker-1.log").write_text(
        text("13:18:00.300", "worker", "-", "worker-1", "join", "chief not reachable yet; retrying")
        + "Traceback (most recent call last):\n"
        + '  File "worker/agent.py", line 1, in join\n'
        + "RuntimeError: boom\n"
    )
    (d / "chief.port").write_text("5000")
    (d / "result.json").write_text(json.dumps({"ok": False, "error": "1/2 workers joined; missing rank(s) 1",
                                               "failed_processes": {"chief": 1, "worker 0": 1}}))
    return d


def test_lines_of_every_file_are_ordered_by_time_with_files_interleaved(run):
    recs = merge_run(str(run))
    times = [r.time for r in recs]
    assert times == sorted(times)
    assert [(r.file, r.message[:12]) for r in recs[:3]] == [
        ("chief.log", "chief abc se"), ("worker-1.log", "chief not re"), ("worker-1.log", "Traceback (m"),
    ]
    assert recs[-1].file == "worker-0.log" and recs[-1].phase == "failed" and recs[-1].level == "ERROR"
    assert len(recs) == 4 + 2 + 4
    assert all(r.time.tzinfo is not None for r in recs)


def test_equal_times_keep_file_order_then_line_order(tmp_path):
    for name in ("worker-10.log", "worker-2.log", "chief.log", "mpiexec.log"):
        (tmp_path / name).write_text(
            text("10:00:00.000", "x", "-", name, "join", "first") + text("10:00:00.000", "x", "-", name, "join", "second")
        )
    recs = merge_run(str(tmp_path))
    assert [(r.file, r.message) for r in recs] == [
        (f, m) for f in ("chief.log", "worker-2.log", "worker-10.log", "mpiexec.log") for m in ("first", "second")
    ]


def test_unparsable_lines_keep_the_previous_time_and_the_process_fields_of_their_file(run):
    recs = merge_run(str(run))
    raw = [r for r in recs if not r.parsed]
    assert [r.message for r in raw] == [
        "Traceback (most recent call last):", '  File "worker/agent.py", line 1, in join', "RuntimeError: boom",
    ]
    first = next(r for r in recs if r.file == "worker-1.log" and r.parsed)
    for r in raw:
        assert (r.time, r.role, r.worker_id, r.phase, r.file) == (first.time, "worker", "worker-1", "join", "worker-1.log")
    assert [r.line for r in raw] == [2, 3, 4]


def test_raw_lines_before_any_record_take_the_first_records_time(tmp_path):
    (tmp_path / "chief.log").write_text("starting up\n" + text("09:00:01.000", "chief", "-", "-", "-", "serving"))
    recs = merge_run(str(tmp_path))
    assert [(r.message, r.parsed) for r in recs] == [("starting up", False), ("serving", True)]
    assert recs[0].time == recs[1].time and recs[0].role == "chief"


def test_a_file_without_any_record_uses_its_modification_time_and_its_name(tmp_path):
    (tmp_path / "chief.log").write_text(text("09:00:00.000", "chief", "-", "-", "join", "serving"))
    crashed = tmp_path / "worker-3.log"
    crashed.write_text("Traceback (most recent call last):\nImportError: no module named x\n")
    when = datetime(2026, 12, 2, 8, 59, 59, tzinfo=UTC).timestamp()
    os.utime(crashed, (when, when))
    recs = merge_run(str(tmp_path))
    assert [r.file for r in recs] == ["worker-3.log", "worker-3.log", "chief.log"]
    assert recs[0].time == datetime(2026, 12, 2, 8, 59, 59, tzinfo=UTC)
    assert (recs[0].role, recs[0].worker_id, recs[0].rank) == ("worker", "worker-3", "3")
    assert [r.message for r in merge_run(str(tmp_path), worker="worker-3")][1] == "ImportError: no module named x"


def test_json_and_text_lines_mix_within_a_run_and_within_a_file(tmp_path):
    (tmp_path / "chief.log").write_text(
        jline("10:00:00.100", "chief", "-", "-", "join", "json one")
        + text("10:00:00.300", "chief", "-", "-", "join", "text two")
    )
    (tmp_path / "worker-0.log").write_text(jline("10:00:00.200", "worker", "0", "worker-0", "join", "json worker"))
    recs = merge_run(str(tmp_path))
    assert [r.message for r in recs] == ["json one", "json worker", "text two"]
    assert all(r.parsed for r in recs)
    assert recs[1].rank == "0" and recs[1].worker_id == "worker-0"


def test_real_log_lines_from_both_formats_parse(tmp_path):
    for fmt, name in (("text", "chief.log"), ("json", "worker-0.log")):
        buf = io.StringIO()
        logs.configure("worker", fmt=fmt, stream=buf)
        logs.set_context(rank=0, worker_id="w0", phase="verify")
        try:
            logging.getLogger("t").warning("replica %s: digest %s", "x/replica_1", "ab:cd")
        finally:
            logging.getLogger().handlers[:] = []
            logs.set_context(role="-", rank=None, worker_id=None, phase=None)
        (tmp_path / name).write_text(buf.getvalue())
    recs = merge_run(str(tmp_path))
    assert [(r.level, r.role, r.rank, r.worker_id, r.phase, r.message) for r in recs] == [
        ("WARNING", "worker", "0", "w0", "verify", "replica x/replica_1: digest ab:cd")
    ] * 2


def test_mpiexec_log_mixes_ranks_and_its_own_lines_stay_unattributed(tmp_path):
    (tmp_path / "mpiexec.log").write_text(
        text("10:00:00.300", "worker", "1", "mpi-rank-2", "receive", "plan for rank 1")
        + text("10:00:00.100", "chief", "-", "-", "broadcast", "plan released")
        + "===   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
        + text("10:00:00.200", "worker", "0", "mpi-rank-1", "receive", "plan for rank 0")
        # two ranks' lines glued together by the launcher
        + text("10:00:00.400", "worker", "0", "mpi-rank-1", "verify", "verified").rstrip("\n")
        + jline("10:00:00.050", "worker", "1", "mpi-rank-2", "join", "joined")
    )
    recs = merge_run(str(tmp_path))
    assert [r.message for r in recs] == [
        "joined", "plan released", "===   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
        "plan for rank 0", "plan for rank 1", "verified",
    ]
    bad = recs[2]
    assert (bad.parsed, bad.role, bad.rank, bad.worker_id) == (False, "mpiexec", "-", "-")
    assert bad.time == recs[1].time  # the line above it in the file is the chief's, at .100
    assert [r.message for r in merge_run(str(tmp_path), worker="0")] == ["plan for rank 0", "verified"]


def test_filter_by_worker_id_or_rank_and_by_phase(run):
    by_id = merge_run(str(run), worker="worker-0")
    by_rank = merge_run(str(run), worker="0")
    assert by_id == by_rank
    assert {r.worker_id for r in by_id} == {"worker-0"} and len(by_id) == 2
    assert [r.message for r in merge_run(str(run), phase="failed")] == [
        "1/2 workers joined; missing rank(s) 1", "round aborted by the chief",
    ]
    both = merge_run(str(run), worker="worker-1", phase="join")
    assert [r.parsed for r in both] == [True, False, False, False]
    assert merge_run(str(run), worker="worker-0", phase="-") == []


def test_a_filter_naming_nothing_in_the_run_is_a_usage_error(run):
    with pytest.raises(UsageError, match=r"--worker 'worker-9'.*worker-1 \(no rank\), worker-0 \(rank 0\)$"):
        merge_run(str(run), worker="worker-9")
    with pytest.raises(UsageError, match=r"--phase 'verfy'.*phases in this run: -, join, failed$"):
        merge_run(str(run), phase="verfy")


def test_missing_directory_and_directory_without_logs_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist") as exc:
        merge_run(str(tmp_path / "nope"))
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    (tmp_path / "result.json").write_text("{}")
    with pytest.raises(UsageError, match=r"has no \*\.log files"):
        merge_run(str(tmp_path))
    with pytest.raises(UsageError, match="not a directory"):
        merge_run(str(tmp_path / "result.json"))


def test_text_format_aligns_columns_and_shows_the_date_once(run):
    out = format_records(merge_run(str(run))).splitlines()
    assert out[0] == "2026-12-02 (UTC)"
    assert sum(line.startswith("2026-") for line in out) == 1
    assert out[1] == "13:18:00.100 chief    rank=- id=-        -      | chief abc serving on 127.0.0.1:5000; waiting for 2 worker(s)"
    assert out[2] == "13:18:00.300 worker   rank=- id=worker-1 join   | chief not reachable yet; retrying"
    assert len({line.index("|") for line in out[1:]}) == 1
    assert out[-1].endswith("| ERROR round aborted by the chief")


def test_text_format_repeats_the_date_when_it_changes(tmp_path):
    (tmp_path / "chief.log").write_text(
        "2026-12-02T23:59:59.900Z INFO chief rank=- id=- phase=join: late\n"
        "2026-12-03T00:00:00.100Z INFO chief rank=- id=- phase=join: early\n"
    )
    out = format_records(merge_run(str(tmp_path))).splitlines()
    assert [line for line in out if "(UTC)" in line] == ["2026-12-02 (UTC)", "2026-12-03 (UTC)"]


def test_json_format_is_one_object_per_record(run):
    recs = merge_run(str(run))
    lines = format_records(recs, json=True).splitlines()
    assert len(lines) == len(recs)
    first = json.loads(lines[0])
    assert first == {"time": "2026-12-02T13:18:00.100Z", "level": "INFO", "role": "chief", "rank": "-",
                     "worker_id": "-", "phase": "-", "message": recs[0].message, "file": "chief.log",
                     "line": 1, "parsed": True}
    assert format_records([], json=True) == "" and format_records([]) == ""


def test_logs_command_prints_the_timeline_and_the_runs_outcome(run):
    out = io.StringIO()
    assert logs_command(str(run), worker="worker-1", out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "2026-12-02 (UTC)"
    assert lines[-1] == "result.json: FAILED: 1/2 workers joined; missing rank(s) 1 (exit codes chief=1, worker 0=1)"
    out = io.StringIO()
    logs_command(str(run), phase="failed", as_json=True, out=out)
    assert [json.loads(line)["phase"] for line in out.getvalue().splitlines()] == ["failed", "failed"]


def test_a_reader_that_stops_early_ends_the_command_quietly(run):
    """``collective logs D | head -1``: the closed pipe ends it with 141 and no traceback."""
    import subprocess
    import sys

    from tests.procs import ROOT

    with open(run / "chief.log", "a") as fh:  # more than a pipe holds, so writes meet the closed end
        for i in range(20000):
            fh.write(text("13:18:11.000", "chief", "-", "-", "failed", f"filler line {i}"))
    proc = subprocess.Popen([sys.executable, "-m", "collective.cli", "logs", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline()  # head -1
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(30) == 141, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
    assert err == ""
