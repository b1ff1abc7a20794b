"""Logging for entry points: one line per event naming time, role, rank, worker id and phase.

Library modules only call ``logging.getLogger(__name__)``; ``configure`` is called once by each
entry point. ``set_context`` updates the fields every later line carries (the worker learns its
rank at join and moves through phases).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time

_context = {"role": "-", "rank": "-", "worker_id": "-", "phase": "-"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(role)s rank=%(rank)s id=%(worker_id)s phase=%(phase)s: %(message)s"


# C0 and C1 control characters and DEL: newlines would forge log lines, ESC would drive the terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _escape(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def printable(value: object, limit: int = 300) -> str:
    """``value`` as one safe line: control characters (newline, ESC, ...) escaped as ``\\xNN``,
    cut to ``limit`` characters. For anything a peer chose: worker ids, hosts, failure messages."""
    raw = str(value)
    text = _escape(raw[:limit])  # no more than is kept: a peer's 60 MiB is never escaped whole
    if len(raw) <= limit and len(text) <= limit:
        return text
    shown = pos = 0  # the characters of ``raw`` the first ``limit`` of ``text`` show
    while pos < limit:
        pos += len(_escape(raw[shown]))
        shown += 1
    return text[:limit] + f"...({len(raw) - shown} more)"


def quoted_text(value: str | bytes, limit: int = 80) -> str:
    """``value``'s repr as an error quotes a rejected text: whole up to ``limit`` characters,
    else its first ``limit`` and its length, so a 5,000-digit number or a pasted file is not
    echoed whole (``model.quoted`` for any value)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}...({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"


def first_of(items: list[str], n: int, sep: str = "; ", what: str = "more") -> str:
    """The first ``n`` of ``items`` joined by ``sep``, and how many were left out: a message
    about 1,024 workers or 20,000 variables stays one line a person can read."""
    left = len(items) - n
    return sep.join(items[:n]) + (f"{sep}and {left} {what}" if left > 0 else "")


def set_context(**fields: object) -> None:
    """Set role/rank/worker_id/phase for every later log line of this process."""
    for key, value in fields.items():
        if key not in _context:
            raise KeyError(f"unknown log context field {key!r}")
        _context[key] = "-" if value is None else _escape(str(value))


def current(field: str) -> str:
    return _context[field]


def phase(name: str) -> None:
    set_context(phase=name)


# What a worker is doing in each phase of its log context: the words its own line on a stop
# signal and the chief's line on its failure report both use.
_DOING = {"join": "joining", "receive": "receiving", "verify": "verifying", "ready": "waiting for start",
          "started": "starting"}


def doing(phase: str | None) -> str:
    """What a worker was doing in ``phase``, as a clause: "while waiting for start" (ready),
    "while starting" before its first phase, "during <phase>" for any other."""
    if phase in (None, "", "-"):
        return "while starting"
    return f"while {_DOING[phase]}" if phase in _DOING else f"during {phase}"


def stop_message(who: str, signum: int, phase: str | None) -> str:
    """"worker w0 stopped by SIGTERM while receiving": the line a stop signal leaves, and what a
    stopped worker reports to its chief (with the signal, ``stopped_by``)."""
    return f"{who} {stopped_by(signum, phase)}"


def stopped_by(signum: int, phase: str | None) -> str:
    """"stopped by SIGTERM while receiving", or "" for ``signum`` 0 (no signal): a worker's
    failure report carries the signal (``FailureReport.stop_signal``), from which the chief names
    a stopped worker as the worker names itself, whatever its message says."""
    if not signum:
        return ""
    try:
        name = signal.Signals(signum).name
    except ValueError:  # a peer's number: bounded, named as it came
        name = f"signal {signum}"
    return f"stopped by {name} {doing(phase)}"


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.items():
            setattr(record, key, value)
        # One line per event whatever a peer put in a name or message (tracebacks stay as they are).
        message = record.getMessage()
        safe = _escape(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


class _UTCFormatter(logging.Formatter):
    converter = time.gmtime

    def formatTime(self, record, datefmt=None):  # noqa: N802 - logging's API name
        t = time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created))
        return f"{t}.{int(record.msecs):03d}Z"


class _JSONFormatter(_UTCFormatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname}
        out.update({k: getattr(record, k, "-") for k in _context})
        out["message"] = record.getMessage()
        return json.dumps(out)


def configure(role: str, *, fmt: str = "text", level: int = logging.INFO, stream=None) -> None:
    """Route the project's log lines to ``stream`` (stderr) in ``fmt`` (text or json), at
    ``level`` or the one ``COLLECTIVE_LOG_LEVEL`` names (debug, info, warning, error)."""
    from collective.errors import UsageError, env_error

    if fmt not in ("text", "json"):
        raise UsageError(f"--log-format {fmt!r} is not one of text, json")
    given = os.environ.get("COLLECTIVE_LOG_LEVEL", "")
    named = given.strip().upper()
    if named:
        if named not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise env_error("COLLECTIVE_LOG_LEVEL", given, "not one of debug, info, warning, error")
        level = getattr(logging, named)
    set_context(role=role)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(_JSONFormatter() if fmt == "json" else _UTCFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
