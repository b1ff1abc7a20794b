"""What the attack on issue 36's changes found, each pinned by a real process on 127.0.0.1:
errors that name the phase they met (not ``None``), and ``--out`` names the file system refuses
ending in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}
    return subprocess.run([sys.executable, "-m", "collective.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", [
    ["status", "--chief"],
    ["fetch", "--step", "1", "--timeout", "5", "--out", "x.npz", "--from"],
])
def test_an_unreachable_peer_is_named_with_the_phase_of_the_call(command, tmp_path):
    """Issue 36's bounding of peer text (``limits.peer_error``) overwrote the call's phase with
    the peer's, None for a status gRPC made itself: every unreachable chief or holder read
    "unreachable during None"."""
    r = _cli(*command, f"127.0.0.1:{_closed_port()}", cwd=tmp_path)
    assert r.returncode != 0, r
    assert "unreachable during" in r.stderr, r.stderr
    assert "during None" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_an_out_name_too_long_for_the_file_system_is_one_line_before_the_fetch(tmp_path):
    """``--out`` with a 300-character file name (the limit is 255 bytes): a traceback (OSError
    File name too long), exit 1; now one line naming --out, exit 2, before any holder is asked."""
    r = _cli("fetch", "--step", "1", "--timeout", "5", "--from", f"127.0.0.1:{_closed_port()}",
             "--out", "a" * 300 + ".npz", cwd=tmp_path)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "--out" in r.stderr and "too long" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
