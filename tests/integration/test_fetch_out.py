"""``collective fetch --out``: the file it writes, between real processes on 127.0.0.1 (a holder
process, tests/outputs_holder.py; the command run as ``python -m collective.cli``).

Written safely in a directory other users can write, as root too (a second local user plants
links; the test creates and removes that user); ``--out`` checked before the fetch; tensor names
that are no safe ``.npz`` member names refused; a hostile holder's unbounded text cut to a
bounded line; nothing left behind by a fetch or a write that fails."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from collective.limits import MAX_ERROR_CHARS, MAX_NAME_CHARS
from tests.clusters import TOKEN
from tests.procs import Proc, wait_for_file

pytestmark = pytest.mark.integration


@pytest.fixture
def holder(tmp_path):
    """start(*args, token=TOKEN) -> the address of a new tests/outputs_holder.py process (killed
    by pid after the test)."""
    started: list[Proc] = []

    def start(*args: str, token: str | None = TOKEN) -> str:
        folder = tmp_path / f"holder{len(started)}"
        folder.mkdir()
        proc = Proc(["-m", "tests.outputs_holder", "--address-file", str(folder / "address"), *args], folder / "log",
                    env={"COLLECTIVE_TOKEN": token} if token else {})
        started.append(proc)
        return wait_for_file(folder / "address", proc, timeout=60)

    yield start
    for proc in started:
        proc.kill()


def fetch(address: str, out: Path | str, *extra: str, token: str | None = TOKEN, step: int = 8,
          env: dict[str, str] | None = None):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}, **(env or {})}
    if token:
        env["COLLECTIVE_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "collective.cli", "fetch", "--from", address, "--step", str(step),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=120, env=env)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# --- item 4: links planted by another user --------------------------------------------------------


@pytest.fixture
def other_user():
    """(name, uid, gid) of a second local user, created for this test and removed after it."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a second local user (useradd) to plant links as another user")
    if shutil.which("useradd") is None or shutil.which("userdel") is None or shutil.which("setpriv") is None:
        pytest.skip("needs useradd, userdel and setpriv to act as a second local user")
    name = f"coll{secrets.token_hex(4)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True, timeout=60)
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield name, entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], check=False, timeout=60)


@pytest.fixture
def shared_dir():
    """A sticky world-writable directory (as /tmp is), which another user can reach."""
    folder = Path(tempfile.mkdtemp(prefix="collective-shared-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _as(user: tuple[str, int, int], *argv: str) -> None:
    _, uid, gid = user
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv], check=True, timeout=60)


@pytest.mark.parametrize("planted", ["state.safetensors.tmp", "state.safetensors", "state.npz"])
def test_a_link_another_user_plants_beside_the_output_is_never_followed(holder, other_user, shared_dir, tmp_path,
                                                                        planted):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    out = shared_dir / ("state.npz" if planted.endswith(".npz") else "state.safetensors")
    _as(other_user, "ln", "-s", str(victim), str(shared_dir / planted))
    assert (shared_dir / planted).is_symlink() and (shared_dir / planted).lstat().st_uid == other_user[1]
    address = holder()
    run = fetch(address, out)
    assert run.returncode == 0, run.stderr
    assert victim.read_bytes() == b"precious\n"  # before the fix: 1 MiB of the fetched state
    st = out.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_nlink == 1, (oct(st.st_mode), st.st_uid)
    assert _leftovers(shared_dir) == (["state.safetensors.tmp"] if planted.endswith(".tmp") else [])
    if planted.endswith(".tmp"):  # the other user's link stays theirs, untouched
        assert (shared_dir / planted).is_symlink()


def test_a_directory_link_of_another_user_on_the_way_to_the_output_is_refused(holder, other_user, shared_dir,
                                                                             tmp_path):
    # The other user points shared/out at a directory of their choosing (here one of root's):
    # root's write would land there, replacing any file of that name.
    target = tmp_path / "roots"
    target.mkdir()
    _as(other_user, "ln", "-s", str(target), str(shared_dir / "out"))
    address = holder()
    out = shared_dir / "out" / "state.npz"
    run = fetch(address, out)
    # Before: rc 0 and roots/state.npz written through the other user's link.
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"collective fetch: error: --out {out}: {shared_dir / 'out'} is a symbolic link of another user (uid "
        f"{other_user[1]}), who could point it anywhere; name the directory it leads to"], run.stderr
    assert list(target.iterdir()) == []
    own = shared_dir / "mine"  # a link of this user (or root) is followed as before
    own.symlink_to(target)
    assert fetch(address, own / "state.npz").returncode == 0 and [p.name for p in target.iterdir()] == ["state.npz"]


# --- item 4: member names an unzip would write outside its directory ------------------------------


@pytest.mark.parametrize("name", ["../../../../home/x", "/etc/x", "a\\..\\..\\x", "C:x", "a\x1b[2Jb"])
def test_a_tensor_whose_name_is_no_safe_npz_member_is_refused_and_nothing_written(holder, tmp_path, name):
    address = holder("--tensor", name)
    out = tmp_path / "state.npz"
    run = fetch(address, out)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert re.match(rf"collective fetch: error: --out {re.escape(str(out))}: tensor '.*': its name (holds a control "
                    r"character|is no safe archive member name .*unzipping the archive would write outside its "
                    r"directory); write a \.safetensors file, which keeps any name$", lines[0]), lines[0]
    assert not out.exists() and _leftovers(tmp_path) == []
    run = fetch(address, tmp_path / "state.safetensors")  # the name kept as it is
    assert run.returncode == 0, run.stderr
    from collective.sources import load_source

    assert [s.name for s in load_source(str(tmp_path / "state.safetensors")).specs()] == [name]


def test_an_npz_of_key_paths_holds_relative_members_only(holder, tmp_path):
    address = holder("--tensor", "model/layer.0/weight")
    out = tmp_path / "state.npz"
    run = fetch(address, out)
    assert run.returncode == 0, run.stderr
    with zipfile.ZipFile(out) as archive:
        assert archive.namelist() == ["model/layer.0/weight.npy"]


# --- item 5: unbounded text from a hostile holder -------------------------------------------------


def test_a_ten_mb_tensor_name_is_one_line_and_leaves_no_file(holder, tmp_path):
    address = holder("--long-name", str(10 << 20), "--mib", "0.01")
    for out in (tmp_path / "x.npz", tmp_path / "x.safetensors"):
        run = fetch(address, out)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr[:2000]
        assert len(lines[0]) < 1000, len(lines[0])  # before: a 35-line struct.error traceback, rc 1
        assert f"its name has {10 << 20:,} characters; the limit is {MAX_NAME_CHARS:,}" in lines[0], lines[0]
        assert not out.exists() and _leftovers(tmp_path) == []  # before: a 22-byte partial file


def test_a_holders_60_mib_error_frame_is_refused_unread(holder, tmp_path):
    address = holder("--error-chars", str(60 << 20))
    out = tmp_path / "x.npz"
    run = fetch(address, out)
    assert run.returncode == 1, run.stderr[:2000]
    # Before: 125,829,455 bytes of stderr (the 60 MiB message twice: the warning and the error).
    assert len(run.stderr) < 2000, len(run.stderr)
    assert re.fullmatch(rf"collective fetch: error: holder h0 at {address} was lost \(error frame of 62,914,\d\d\d "
                        r"bytes refused: an error is at most 65,536 bytes\); no holder is left for bytes 0\.\.1048628 "
                        r"\('w' \.\. '#tree'\)", run.stderr.strip().splitlines()[-1]), run.stderr
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("data_path", ["tcp", "grpc"])
def test_a_holders_long_error_is_cut_where_it_is_received(holder, tmp_path, data_path):
    # 40,000 characters and a 4,000-character culprit and phase: within the frame's limit, beyond
    # the message's; gRPC's own limit on trailers (16 KiB) keeps it in bounds over FetchRaw too.
    address = holder("--error-chars", "40000", "--error-field-chars", "4000")
    out = tmp_path / "x.npz"
    run = fetch(address, out, env={"COLLECTIVE_DATA_PATH": data_path})
    assert run.returncode == 1, run.stderr[:2000]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"collective fetch: error: holder h0 at {address} was lost ("), last[:300]
    assert len(last) < MAX_ERROR_CHARS + 400, len(last)  # before: 40,000 characters and more
    assert not out.exists() and _leftovers(tmp_path) == []


def test_an_mpi_outcome_error_is_bounded_in_every_field():
    import json

    pytest.importorskip("mpi4py")
    from collective import errors as E
    from collective._proto import collective_pb2 as pb
    from collective.limits import MAX_CULPRIT_CHARS
    from collective.transport import mpi

    # MPI's path: rank 0's error frame, as a hostile or buggy rank 0 could fill it.
    frame = bytes([mpi._ERR]) + json.dumps({"class": ["not", "a", "name"], "code": "ABORTED", "culprit": "c" * (10 << 20),
                                            "phase": "p\n" * 100, "message": "m\x1b" * (10 << 20)}).encode()
    with pytest.raises(E.AbortedError) as info:  # before: a TypeError (a list as the class name)
        mpi.decode_outcome(frame, pb.JoinReply)
    err = info.value
    assert len(str(err)) < MAX_ERROR_CHARS + 40 and "\x1b" not in str(err)
    assert len(err.culprit) < MAX_CULPRIT_CHARS + 40 and len(err.phase) < 64 + 40 and "\n" not in err.phase
    frame = bytes([mpi._ERR]) + json.dumps({"class": "ProtocolError", "code": "INVALID_ARGUMENT",
                                            "culprit": "c" * (10 << 20), "message": "m" * (10 << 20)}).encode()
    with pytest.raises(E.ProtocolError) as info:  # before: a 10,485,760-character error and culprit
        mpi.decode_outcome(frame, pb.JoinReply)
    assert len(str(info.value)) < MAX_ERROR_CHARS + 40 and len(info.value.culprit) < MAX_CULPRIT_CHARS + 40


def test_a_ten_mb_torchft_metadata_is_quoted_short():
    pytest.importorskip("torchft")
    from collective.errors import UsageError
    from collective.torchft import parse_metadata

    with pytest.raises(UsageError) as info:
        parse_metadata("x" * (10 << 20))
    # Before: a 10,485,888-character UsageError.
    assert len(str(info.value)) < 300 and "(10485760 characters)" in str(info.value), str(info.value)[:400]


def test_a_write_that_fails_midway_is_one_line_and_leaves_no_partial_file(holder, tmp_path):
    # The file system refuses past 100 kB (RLIMIT_FSIZE, as a full disk or quota would): the
    # 1 MiB state fails midway through the write.
    address = holder()
    limited = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000)); "
               "sys.argv = ['collective', *sys.argv[1:]]; runpy.run_module('collective.cli', run_name='__main__')")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVE_")}, "COLLECTIVE_TOKEN": TOKEN}
    for out in (tmp_path / "x.npz", tmp_path / "x.safetensors"):
        run = subprocess.run([sys.executable, "-c", limited, "fetch", "--from", address, "--step", "8", "--out",
                              str(out)], capture_output=True, text=True, timeout=120, env=env)
        # Before: an OSError traceback (rc 1) and a partial file of 100,000 bytes.
        assert run.returncode == 1 and run.stderr.strip().splitlines() == [
            f"collective fetch: error: --out {out}: cannot write: File too large; nothing was written"], run.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["holder0"]


# --- item 12: --out checked before the fetch ------------------------------------------------------


def test_an_out_in_a_missing_directory_is_one_line_before_any_fetch(tmp_path):
    # No holder at all: the command must not get as far as dialing one.
    out = tmp_path / "nonexistent" / "dir" / "state.npz"
    run = fetch("127.0.0.1:9", out)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"collective fetch: error: --out {out}: the directory {out.parent} does not exist; create it or write "
        f"elsewhere"], run.stderr
    file_parent = tmp_path / "afile"
    file_parent.write_text("")
    run = fetch("127.0.0.1:9", file_parent / "state.npz")
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"collective fetch: error: --out {file_parent / 'state.npz'}: {file_parent} is not a directory; write "
        f"elsewhere"], run.stderr
    (tmp_path / "d.npz").mkdir()
    run = fetch("127.0.0.1:9", tmp_path / "d.npz")
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"collective fetch: error: --out {tmp_path / 'd.npz'} is a directory; name a file in it"], run.stderr


def test_a_failed_fetch_leaves_no_file(holder, tmp_path):
    address = holder()
    out = tmp_path / "state.npz"
    run = fetch(address, out, step=9)
    assert run.returncode == 1 and "publishes step 8, not step 9" in run.stderr, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["holder0"]


# --- item 17: the success line --------------------------------------------------------------------


def test_the_success_line_gives_sizes_in_readable_units(holder, tmp_path):
    address = holder("--mib", "0.25")
    out = tmp_path / "state.safetensors"
    run = fetch(address, out)
    assert run.returncode == 0 and run.stderr == "", run.stderr  # a holder with the token: no warning
    # Before: "0.3 MiB" overall and "0 MiB" for the holder.
    assert re.match(rf"^fetched step 8 \(1 tensor, 256\.\d KiB, manifest \S+\) in \d+\.\d\d s from "
                    rf"{address} 256\.\d KiB -> {re.escape(str(out))}$", run.stdout.strip()), run.stdout


def test_a_token_given_to_a_holder_that_asks_for_none_is_warned_about(holder, tmp_path):
    address = holder(token=None)
    run = fetch(address, tmp_path / "a.safetensors")
    # Before: rc 0 and not a word.
    assert run.returncode == 0 and run.stderr.strip().splitlines() == [
        f"collective fetch: warning: holder at {address} asks for no token: the token given was not needed and "
        f"proves nothing about that holder, and anyone who can reach it can fetch its state; publish with a token "
        f"(publish(token=) or COLLECTIVE_TOKEN)"], run.stderr
    assert run.stdout.startswith("fetched step 8 "), run.stdout
    run = fetch(address, tmp_path / "b.safetensors", token=None)  # no token asked, none given: nothing to say
    assert run.returncode == 0 and run.stderr == "", run.stderr
