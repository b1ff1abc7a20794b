"""``collective logs RUN_DIR``: one timeline of a run's per-process logs.

``collective launch --run-dir DIR`` keeps ``chief.log``, ``worker-<i>.log`` (and, over MPI,
``mpiexec.log``, whose lines come from every rank). ``merge_run`` reads every ``*.log`` in the
directory and orders the lines by time, so a failed run reads top to bottom.

Rules:

- A line is a log record when it is the text format of ``collective.logs``
  (``TIME LEVEL ROLE rank=R id=W phase=P: message``) or one JSON object with at least ``time``
  and ``message`` (``--log-format json``). Both formats may be mixed, also within one file.
  Where several records were glued into one line (output of several ranks interleaved by
  mpiexec), the line is split at each record's start.
- Any other line (a Python traceback, mpiexec's own output, the summary) is kept as a *raw*
  record. It gets the time of the previous record of the same file (of the file's first record
  when it precedes them all; of the file's modification time when the file has no record), its
  role from the file name (``chief``, ``worker``, ``mpiexec``) and, in a file written by one
  process, that process's rank, worker id and phase. A ``worker-<i>.log`` without any record is
  taken to be worker ``worker-<i>``, rank ``i`` (the launcher's naming).
- Order: by time; equal times keep file order (``chief.log``, ``worker-<i>.log`` by ``i``, then
  the others by name), then line order.
"""

from __future__ import annotations

import argparse
import json as _json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from collective.errors import UsageError

_TEXT_START = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z [A-Z]+ \S+ rank=\S+ id=\S+ phase=\S*?:"
_TEXT = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z) (?P<level>[A-Z]+) (?P<role>\S+) "
    r"rank=(?P<rank>\S+) id=(?P<worker_id>\S+) phase=(?P<phase>\S*?):(?: (?P<message>.*))?$",
    re.DOTALL,
)
_RECORD_START = re.compile(rf"{_TEXT_START}|\{{\s*\"time\"\s*:")
_LAUNCH_LABEL = re.compile(r"\s*[A-Za-z][\w ]*\|\s*$")  # `worker 1 | ` as `collective launch` echoes
_WORKER_FILE = re.compile(r"worker-(\d+)$")


@dataclass(frozen=True)
class LogRecord:
    """One line of the timeline. ``parsed`` is False for a raw line (see the module doc)."""

    time: datetime  # timezone-aware, UTC
    level: str
    role: str
    rank: str
    worker_id: str
    phase: str
    message: str
    file: str  # the log file's name within the run directory
    line: int  # 1-based line number in that file
    parsed: bool = True

    def to_json(self) -> dict:
        out = asdict(self)
        out["time"] = _iso(self.time)
        return out


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _parse_time(text: object) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _field(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _parse_piece(piece: str) -> dict | None:
    """The fields of one record, or None when ``piece`` is not a record."""
    text = piece.strip()
    if text.startswith("{"):
        try:
            obj, end = _json.JSONDecoder().raw_decode(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or "message" not in obj or text[end:].strip():
            return None
        t = _parse_time(obj.get("time"))
        if t is None:
            return None
        return {
            "time": t,
            "level": _field(obj.get("level")),
            "role": _field(obj.get("role")),
            "rank": _field(obj.get("rank")),
            "worker_id": _field(obj.get("worker_id")),
            "phase": _field(obj.get("phase")),
            "message": str(obj.get("message")),
        }
    m = _TEXT.match(text)
    if m is None:
        return None
    t = _parse_time(m["time"])
    if t is None:
        return None
    fields = m.groupdict()
    fields["time"] = t
    fields["message"] = fields["message"] or ""
    fields["phase"] = fields["phase"] or "-"
    return fields


def _split(line: str) -> list[tuple[dict | None, str]]:
    """A line -> [(fields or None, text)]: one entry, or several when records were glued."""
    if line.lstrip().startswith("{"):
        whole = _parse_piece(line)
        if whole is not None:
            return [(whole, line)]
    starts = [m.start() for m in _RECORD_START.finditer(line)]
    if not starts:
        return [(None, line)]
    if starts == [0]:
        return [(_parse_piece(line), line)]
    out: list[tuple[dict | None, str]] = []
    head = line[: starts[0]]
    if head.strip() and not _LAUNCH_LABEL.fullmatch(head):
        out.append((None, head))
    for a, b in zip(starts, starts[1:] + [len(line)], strict=True):
        piece = line[a:b]
        out.append((_parse_piece(piece), piece))
    # Unparsable pieces next to each other are one raw line, as written.
    merged: list[tuple[dict | None, str]] = []
    for fields, text in out:
        if fields is None and merged and merged[-1][0] is None:
            merged[-1] = (None, merged[-1][1] + text)
        else:
            merged.append((fields, text))
    return merged


def _file_order(path: Path) -> tuple:
    stem = path.stem
    if stem == "chief":
        return (0, 0, path.name)
    m = _WORKER_FILE.fullmatch(stem)
    if m:
        return (1, int(m[1]), path.name)
    return (2, 0, path.name)


def _role_of_file(path: Path) -> str:
    return "worker" if _WORKER_FILE.fullmatch(path.stem) else path.stem


def _read_file(path: Path) -> list[LogRecord]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    entries: list[tuple[int, dict | None, str]] = []
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.rstrip()
        if not line.strip():
            continue
        for fields, piece in _split(line):
            entries.append((number, fields, piece.rstrip()))

    parsed = [f for _, f, _ in entries if f is not None]
    role = _role_of_file(path)
    # One process wrote the file when every record names the same role and worker id.
    one_process = bool(parsed) and len({(f["role"], f["worker_id"]) for f in parsed}) == 1
    worker_file = _WORKER_FILE.fullmatch(path.stem)
    if parsed:
        fallback = {"time": parsed[0]["time"], "rank": "-", "worker_id": "-", "phase": "-"}
        if one_process:
            fallback.update(rank=parsed[0]["rank"], worker_id=parsed[0]["worker_id"], phase=parsed[0]["phase"])
    else:
        mtime = datetime.fromtimestamp(path.stat().st_mtime, UTC)
        fallback = {"time": mtime, "rank": "-", "worker_id": "-", "phase": "-"}
        if worker_file:
            fallback.update(rank=worker_file[1], worker_id=path.stem)

    records: list[LogRecord] = []
    last = fallback
    for number, fields, piece in entries:
        if fields is not None:
            records.append(LogRecord(**fields, file=path.name, line=number))
            last = {"time": fields["time"], "rank": "-", "worker_id": "-", "phase": "-"}
            if one_process:
                last.update(rank=fields["rank"], worker_id=fields["worker_id"], phase=fields["phase"])
        else:
            records.append(LogRecord(
                time=last["time"], level="-", role=role, rank=last["rank"], worker_id=last["worker_id"],
                phase=last["phase"], message=piece, file=path.name, line=number, parsed=False,
            ))
    return records


def merge_run(run_dir: str, *, worker: str | None = None, phase: str | None = None) -> list[LogRecord]:
    """Every ``*.log`` line of ``run_dir`` as one timeline, optionally filtered.

    ``worker`` keeps the lines of one worker, named by worker id (``worker-1``) or rank (``1``);
    ``phase`` keeps the lines of one phase (``join``, ``receive``, ``failed``, ...). Raises
    ``UsageError`` when the directory does not exist, holds no ``*.log``, or a filter names a
    worker or phase that appears nowhere in the run.
    """
    root = Path(run_dir)
    if not root.exists():
        raise UsageError(f"run directory {run_dir} does not exist")
    if not root.is_dir():
        raise UsageError(f"{run_dir} is not a directory; pass the run directory that holds chief.log and worker-<i>.log")
    # Not through a link: a *.log planted as a symlink (or, where the kernel allows it, a hard
    # link) to another file must not show its contents. Every log launch writes has one link.
    files = sorted((p for p in root.glob("*.log") if p.is_file() and not p.is_symlink() and p.stat().st_nlink == 1),
                   key=_file_order)
    if not files:
        raise UsageError(f"run directory {run_dir} has no *.log files (expected chief.log and worker-<i>.log)")
    keyed: list[tuple[datetime, int, int, LogRecord]] = []
    for file_index, path in enumerate(files):
        for seq, rec in enumerate(_read_file(path)):
            keyed.append((rec.time, file_index, seq, rec))
    keyed.sort(key=lambda k: k[:3])
    records = all_records = [k[3] for k in keyed]

    if worker is not None:
        wanted = worker.strip()
        known: dict[str, set[str]] = {}
        for r in records:
            if r.worker_id != "-" or r.rank != "-":
                known.setdefault(r.worker_id, set()).add(r.rank)
        if wanted in ("", "-") or not any(wanted in ({wid} | ranks) for wid, ranks in known.items()):
            names = ", ".join(
                f"{wid} ({'rank ' + '/'.join(sorted(ranks - {'-'})) if ranks - {'-'} else 'no rank'})"
                for wid, ranks in known.items()
            ) or "none"
            raise UsageError(f"--worker {worker!r} names no worker id or rank in {run_dir}; workers in this run: {names}")
        records = [r for r in records if wanted in (r.worker_id, r.rank)]
    if phase is not None:
        wanted_phase = phase.strip()
        phases = list(dict.fromkeys(r.phase for r in all_records))
        if wanted_phase not in phases:
            raise UsageError(f"--phase {phase!r} appears nowhere in {run_dir}; phases in this run: {', '.join(phases) or 'none'}")
        records = [r for r in records if r.phase == wanted_phase]
    return records


def format_records(records: Sequence[LogRecord], json: bool = False) -> str:
    """One line per record: aligned text columns (the date once, then again when it changes),
    or with ``json=True`` one JSON object per line (the ``to_json`` fields). No final newline."""
    if json:
        return "\n".join(_json.dumps(r.to_json()) for r in records)
    if not records:
        return ""
    role_w = max(8, *(len(r.role) for r in records))
    rank_w = max(len(f"rank={r.rank}") for r in records)
    id_w = max(len(f"id={r.worker_id}") for r in records)
    phase_w = max(len(r.phase) for r in records)
    lines: list[str] = []
    day = None
    for r in records:
        if r.time.date() != day:
            day = r.time.date()
            lines.append(f"{day.isoformat()} (UTC)")
        clock = r.time.strftime("%H:%M:%S.") + f"{r.time.microsecond // 1000:03d}"
        message = r.message if r.level in ("INFO", "-") else f"{r.level} {r.message}"
        lines.append(
            f"{clock} {r.role:<{role_w}} {'rank=' + r.rank:<{rank_w}} {'id=' + r.worker_id:<{id_w}} "
            f"{r.phase:<{phase_w}} | {message}".rstrip()
        )
    return "\n".join(lines)


def logs_command(
    run_dir: str,
    *,
    worker: str | None = None,
    phase: str | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """What ``collective logs`` does: print the merged timeline; in text mode end with the run's
    outcome from ``result.json`` when there is one. Returns the exit code (0)."""
    out = out or sys.stdout
    records = merge_run(run_dir, worker=worker, phase=phase)
    text = format_records(records, json=as_json)
    if text:
        print(text, file=out)
    if not as_json:
        if not records:
            print("(no line matches the filters)", file=out)
        outcome = _outcome(Path(run_dir) / "result.json")
        if outcome:
            print(outcome, file=out)
    return 0


def _outcome(path: Path) -> str | None:
    try:
        result = _json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or "ok" not in result:
        return None
    if result["ok"]:
        return "result.json: ok (start released; every digest agrees)"
    line = f"result.json: FAILED: {result.get('error') or 'no reason recorded'}"
    if result.get("failed_processes"):
        line += " (exit codes " + ", ".join(f"{k}={v}" for k, v in result["failed_processes"].items()) + ")"
    return line


def command(args: argparse.Namespace) -> int:
    """``collective logs RUN_DIR`` (or ``--run-dir DIR``)."""
    run_dir = args.run_dir or args.run_dir_option
    if not run_dir:
        raise UsageError("pass the run directory: collective logs RUN_DIR (or --run-dir DIR)")
    return logs_command(run_dir, worker=args.worker, phase=args.phase, as_json=args.json)
