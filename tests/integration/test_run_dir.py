"""`collective launch --run-dir`: no other local user can make it write through a link.

Root launching in a directory another user made (or planted links in) must refuse it in one
line, exit 2, and leave the file a planted link points to untouched."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_launch import _launch

pytestmark = pytest.mark.integration

PRECIOUS = "root's file, not to be truncated\n"


@pytest.fixture
def other_user():
    """A second local user, created for the test and removed after it: (uid, gid)."""
    if os.geteuid() != 0:
        pytest.skip("creating a second local user (useradd) needs root")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel not installed")
    name = f"coll{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True, timeout=30)
    try:
        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], check=True, timeout=30)


def _as(user, *cmd: str) -> None:
    uid, gid = user
    # user=/group=: the child drops to the other user before exec (no Python code runs forked).
    subprocess.run(list(cmd), check=True, timeout=30, user=uid, group=gid, extra_groups=[], cwd="/")


def _one_line_refusal(proc, *says: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for text in says:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("planted", [".launch.lock", "chief.log", "worker-0.log"])
def test_root_refuses_a_run_dir_another_user_made_and_planted_a_link_in(tmp_path, other_user, planted):
    target = tmp_path / "precious"
    target.write_text(PRECIOUS)
    run_dir = Path(f"/tmp/collective-planted-{secrets.token_hex(6)}")  # where the attacker made it
    try:
        _as(other_user, "mkdir", "-m", "777", str(run_dir))
        _as(other_user, "ln", "-s", str(target), str(run_dir / planted))
        proc = _launch(run_dir, "--workers", "2", "--quiet", "--join-timeout", "20")
        _one_line_refusal(proc, f"cannot use run directory {run_dir}: it belongs to another user (uid {other_user[0]}",
                          "pass another --run-dir")
        assert target.read_text() == PRECIOUS
        assert os.readlink(run_dir / planted) == str(target)  # not even the link was touched
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_root_refuses_a_run_dir_below_a_directory_another_user_controls(tmp_path, other_user):
    # The run dir would be root's, but its parent's owner could swap it for a link after the checks.
    parent = Path(f"/tmp/collective-parent-{secrets.token_hex(6)}")
    try:
        _as(other_user, "mkdir", "-m", "755", str(parent))
        proc = _launch(parent / "run", "--workers", "1", "--quiet")
        _one_line_refusal(proc, f"{parent} belongs to another user (uid {other_user[0]})")
        assert not (parent / "run").exists()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_link_planted_in_ones_own_run_dir_is_never_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_text(PRECIOUS)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    for name in ("chief.log", "worker-1.log", "result.json", "status.json"):
        (run_dir / name).symlink_to(target)
    proc = _launch(run_dir, "--workers", "2", "--quiet", "--join-timeout", "20")
    assert proc.returncode == 0, proc.stderr
    assert target.read_text() == PRECIOUS
    for name in ("chief.log", "worker-1.log", "result.json"):  # each link replaced by a new private file
        assert not (run_dir / name).is_symlink() and (run_dir / name).stat().st_mode & 0o777 == 0o600

    (run_dir / ".launch.lock").unlink()
    (run_dir / ".launch.lock").symlink_to(target)
    proc = _launch(run_dir, "--workers", "1", "--quiet")
    _one_line_refusal(proc, f"cannot use run directory {run_dir}: .launch.lock: it is a symlink; remove it")
    assert target.read_text() == PRECIOUS


@pytest.mark.parametrize("case", ["a symlink to a directory", "group-writable", "world-writable"])
def test_an_unsafe_run_dir_of_ones_own_is_refused_in_one_line(tmp_path, case):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    run_dir = real
    if case == "a symlink to a directory":
        run_dir = tmp_path / "link"
        run_dir.symlink_to(real)
        says = "it is a symlink; name the directory itself"
    else:
        real.chmod(0o770 if case == "group-writable" else 0o777)
        says = "it is writable by group or others (mode 0" + ("770" if case == "group-writable" else "777")
    proc = _launch(run_dir, "--workers", "1", "--quiet")
    _one_line_refusal(proc, f"cannot use run directory {run_dir}: {says}")
    assert list(real.iterdir()) == []
