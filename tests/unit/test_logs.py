"""collective.logs: what a peer chose (ids, hosts, messages) cannot forge lines or drive a terminal."""

from __future__ import annotations

import io
import json
import logging

import pytest

from collective import logs

EVIL = "w1\n2026-01-01T00:00:00.000Z ERROR chief: forged line\x1b[2J\x1b[31m\r\x00\x9b"


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logs.set_context(role="-", rank="-", worker_id="-", phase="-")


def test_printable_escapes_every_control_character_and_cuts_long_text():
    safe = logs.printable(EVIL)
    assert "\n" not in safe and "\x1b" not in safe and "\r" not in safe and "\x00" not in safe and "\x9b" not in safe
    assert "\\x0a" in safe and "\\x1b[2J" in safe
    assert logs.printable("x" * 1000, limit=10) == "x" * 10 + "...(990 more)"
    assert logs.printable("plain id-3 ünïcode") == "plain id-3 ünïcode"


def test_printable_escapes_only_what_it_keeps(monkeypatch):
    # A peer's 20 MiB of control characters: escaping all of it (one call per character) took
    # 28 s on a quiet machine, and past pytest's 120 s beside three CPU-bound processes.
    seen = []
    real = logs._escape
    monkeypatch.setattr(logs, "_escape", lambda text: seen.append(len(text)) or real(text))
    out = logs.printable("m\x1b" * (10 << 20), limit=4000)
    assert max(seen) <= 4000, max(seen)  # before: 20,971,520
    assert out.startswith("m\\x1bm") and out.endswith(f"...({(20 << 20) - 1600} more)"), out[-40:]
    assert logs.printable("ab\x1bcd" * 3, limit=10) == "ab\\x1bcdab...(8 more)"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_logged_worker_id_with_newlines_and_escapes_stays_one_safe_line(restore_logging, fmt):
    out = io.StringIO()
    logs.configure("chief", fmt=fmt, stream=out)
    logs.set_context(worker_id=EVIL)
    logging.getLogger("chief.service").warning("refused worker %s: %s", EVIL, EVIL)
    text = out.getvalue()
    assert text.count("\n") == 1 and "\x1b" not in text and "\r" not in text
    if fmt == "json":
        record = json.loads(text)
        assert "\x1b" not in record["message"] and "\n" not in record["worker_id"]


@pytest.mark.parametrize(("named", "shown"), [("", False), ("debug", True), ("INFO", False)])
def test_collective_log_level_names_the_level_of_every_line(restore_logging, monkeypatch, named, shown):
    monkeypatch.setenv("COLLECTIVE_LOG_LEVEL", named)
    out = io.StringIO()
    logs.configure("chief", stream=out)
    logging.getLogger("collective.chief.supervise").debug("parked calls: 3 tried again")
    logging.getLogger("collective.chief.supervise").info("start released")
    assert ("parked calls" in out.getvalue()) is shown and "start released" in out.getvalue()


def test_a_collective_log_level_that_is_no_level_is_a_usage_error_naming_it(restore_logging, monkeypatch):
    from collective.errors import UsageError

    monkeypatch.setenv("COLLECTIVE_LOG_LEVEL", "loud\n")
    with pytest.raises(UsageError, match=r"^environment variable COLLECTIVE_LOG_LEVEL='loud\\n': not one of debug, info, warning, error$"):
        logs.configure("chief", stream=io.StringIO())


def test_first_of_names_the_first_n_and_counts_the_rest():
    names = [f"w{i}" for i in range(1024)]
    assert logs.first_of(names, 3, ", ") == "w0, w1, w2, and 1021 more"
    assert logs.first_of(names[:3], 3) == "w0; w1; w2"
    assert logs.first_of(["a", "b"], 1, what="more difference(s)") == "a; and 1 more difference(s)"
