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


def test_collective_logs_reads_no_log_through_a_link(tmp_path):
    """Root reading another user's run dir must not print a file a planted *.log points to."""
    import sys

    from tests.procs import ROOT

    secret = tmp_path / "secret"
    secret.write_text("2026-01-01T00:00:00.000Z INFO chief rank=- id=- phase=-: the secret\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "chief.log").write_text("2026-01-01T00:00:01.000Z INFO chief rank=- id=- phase=-: own line\n")
    (run_dir / "worker-0.log").symlink_to(secret)
    for how in ([str(run_dir)], ["--run-dir", str(run_dir)]):
        proc = subprocess.run([sys.executable, "-m", "collective.cli", "logs", *how], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        assert "own line" in proc.stdout and "secret" not in proc.stdout, proc.stdout


def test_a_good_runs_temporary_dir_is_removed_and_a_failed_ones_kept_and_named(tmp_path):
    """Every launch used to leave a /tmp/collective-run-* behind."""
    import json
    import sys

    from tests.procs import ROOT

    def launch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "collective.cli", "launch", "--workers", "1", "--json", *args],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL,
                              env={**os.environ, "TMPDIR": str(tmp_path)})  # where mkdtemp makes it

    good = launch("--quiet")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout.splitlines()[-1])["run_dir"] is None
    assert "logs        removed with the run's temporary directory" in good.stderr
    assert not list(tmp_path.glob("collective-run-*"))
    kept = launch("--keep-run-dir", "--quiet")
    [run_dir] = tmp_path.glob("collective-run-*")
    assert json.loads(kept.stdout.splitlines()[-1])["run_dir"] == str(run_dir) and (run_dir / "chief.log").exists()
    shutil.rmtree(run_dir)
    bad = launch("--model", str(tmp_path / "nope.yaml"))
    assert bad.returncode == 2, bad.stderr
    [run_dir] = tmp_path.glob("collective-run-*")
    assert f"  logs        {run_dir}  (collective logs {run_dir})" in bad.stderr and (run_dir / "chief.log").exists()


def test_status_takes_no_address_or_token_from_a_file_another_user_planted(tmp_path, other_user):
    import sys

    from tests.procs import ROOT

    run_dir = Path(f"/tmp/collective-status-{secrets.token_hex(6)}")
    try:
        _as(other_user, "mkdir", "-m", "755", str(run_dir))
        _as(other_user, "sh", "-c", f"echo '{{\"chief\": \"127.0.0.1:1\", \"token\": \"theirs\"}}' > {run_dir}/status.json")
        proc = subprocess.run([sys.executable, "-m", "collective.cli", "status", "--run-dir", str(run_dir), "--token",
                               "mine"], capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
        _one_line_refusal(proc, f"collective status: error: {run_dir}/status.json is not a regular file of this user",
                          "not trusting the address and token in it")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
