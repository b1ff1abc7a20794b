"""collective/outfile.py: the new file has no name until it is complete (Linux's O_TMPFILE), so a
process killed while it writes leaves nothing behind; where O_TMPFILE is refused, the hidden
named file of before, removed on any failure."""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys

import pytest

from collective import outfile
from collective.outfile import OutputFile, written
from tests.procs import Proc, files_open_in, wait_for_file

# Writes 1 MiB through OutputFile, says so (a file in another directory), then keeps writing
# slowly: killed mid-write, never committed.
_SLOW_WRITER = """
import sys, time
from collective.outfile import OutputFile
out = OutputFile(sys.argv[1])
out.file.write(b"x" * (1 << 20))
out.file.flush()
open(sys.argv[2], "w").write("writing")
while True:
    out.file.write(b"y" * 4096)
    out.file.flush()
    time.sleep(0.05)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_TMPFILE and /proc are Linux's")
def test_a_writer_sigkilled_mid_write_leaves_nothing_in_the_directory(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "kept").write_bytes(b"already here\n")
    marker = tmp_path / "writing"
    writer = Proc(["-c", _SLOW_WRITER, str(folder / "state.npz"), str(marker)], tmp_path / "writer.log")
    try:
        wait_for_file(marker, writer, timeout=60)
        held = files_open_in(writer.pid, folder)
        assert len(held) == 1, held  # the file being written, 1 MiB and more in it
        writer.signal(signal.SIGKILL)
        rc = writer.wait(60)
    finally:
        writer.kill()
    assert rc == -signal.SIGKILL, (rc, writer.output())
    # Before: [".state.npz.<16 hex>.tmp", "kept"], the temp file of 1 MiB and more, left for ever.
    assert sorted(p.name for p in folder.iterdir()) == ["kept"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_TMPFILE and /proc are Linux's")
def test_the_new_file_has_no_name_until_commit(tmp_path):
    out = OutputFile(tmp_path / "state.safetensors")
    try:
        out.file.write(b"data")
        assert list(tmp_path.iterdir()) == []  # before: the hidden named temp file
        out.commit()
    finally:
        out.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]
    st = (tmp_path / "state.safetensors").lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and (tmp_path / "state.safetensors").read_bytes() == b"data"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(st.st_mode) == 0o666 & ~umask  # as open() makes a file


def _refused(code: int):
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args, **kwargs)

    return fake_open


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, "no /proc"])
def test_where_o_tmpfile_is_refused_a_hidden_named_file_is_used(tmp_path, monkeypatch, code):
    if code == "no /proc":  # nothing to name an unnamed file through at commit
        monkeypatch.setattr(outfile.os.path, "isdir", lambda path: path != "/proc/self/fd")
    else:
        monkeypatch.setattr(outfile.os, "open", _refused(code))
    with written(tmp_path / "a.npz") as f:
        f.write(b"a")
        hidden = [p.name for p in tmp_path.iterdir()]
        assert len(hidden) == 1 and hidden[0].startswith(".a.npz.") and hidden[0].endswith(".tmp"), hidden
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"] and (tmp_path / "a.npz").read_bytes() == b"a"
    with pytest.raises(RuntimeError), written(tmp_path / "b.npz") as f:
        f.write(b"b")
        raise RuntimeError("the write failed")
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]  # nothing left


def test_an_output_name_that_is_a_link_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    (tmp_path / "state.npz").symlink_to(victim)
    with written(tmp_path / "state.npz") as f:
        f.write(b"new")
    assert victim.read_bytes() == b"precious\n"
    assert not (tmp_path / "state.npz").is_symlink() and (tmp_path / "state.npz").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.npz", "victim"]
