"""A file the user names for output (``collective fetch --out``, ``save_npz``, ``save_safetensors``),
written safely in any directory, as any user.

The output may lie in a directory other users can write (a shared scratch directory, /tmp), and
the command may run as root. A name another user planted there (``state.safetensors.tmp ->
/victim``, or the output's own name a link) must never be followed: root would overwrite what it
points to. So, as ``cli/rundir.py`` does for launch's run directory:

- the directory is opened once, by its path, before anything else (a symbolic link on the way
  that belongs to another user is refused: its owner could point it anywhere); every later
  step goes through that descriptor (a missing directory, or one this user cannot write, is a one-line UsageError
  before any work: ``collective fetch`` checks ``--out`` before it fetches);
- the bytes go to a new file in that directory that has no name yet (Linux's ``O_TMPFILE``, opened
  through the directory's descriptor): a process killed while it writes (SIGKILL, the OOM killer)
  leaves nothing behind, the kernel frees the file with its last descriptor. Where the file
  system refuses ``O_TMPFILE`` the file gets an unguessable hidden name beside the output at once,
  created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: nothing that exists is ever opened;
- once complete, an unnamed file is linked under a fresh unguessable name (``linkat`` of
  ``/proc/self/fd/N``, which fails rather than replace or follow anything at that name), then
  renamed onto the output's name: a rename replaces a link at that name and never follows it.
  On any failure the new file is closed and any name it got unlinked: no partial file is left.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from collective.errors import CollectiveError, UsageError

_NAME_MAX = 255  # bytes of one file name on Linux file systems


class OutputFile:
    """``path`` about to be written: its directory open, a new file in it (unnamed where the
    file system allows, else hidden) open as ``file``.
    ``commit()`` puts it in place; ``discard()`` removes it. ``what`` names the path in errors
    (``--out x.npz``)."""

    def __init__(self, path: str | os.PathLike[str], *, what: str | None = None) -> None:
        self.path = Path(path)
        self.what = what or str(path)
        name = self.path.name
        if not name or name in (".", ".."):
            raise UsageError(f"{self.what}: name a file, not a directory")
        parent = self.path.parent
        link = _foreign_link(parent)
        if link is not None:
            raise UsageError(f"{self.what}: {link} is a symbolic link of another user (uid {link.lstat().st_uid}), who "
                             f"could point it anywhere; name the directory it leads to")
        try:
            self._dir: int | None = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UsageError(f"{self.what}: the directory {parent} does not exist; create it or write elsewhere") from None
        except NotADirectoryError:
            raise UsageError(f"{self.what}: {parent} is not a directory; write elsewhere") from None
        except OSError as exc:
            raise UsageError(f"{self.what}: cannot open the directory {parent}: {exc.strerror or exc}") from None
        self.name = name
        try:
            try:
                st = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            except OSError as exc:  # a name too long for the file system (ENAMETOOLONG), say
                raise UsageError(f"{self.what}: {exc.strerror or exc}; name another file") from None
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise UsageError(f"{self.what} is a directory; name a file in it")
            self._tmp: str | None = None  # the new file's name in the directory, once it has one
            try:
                fd = _unnamed(self._dir)
                self._unnamed = fd is not None
                if fd is None:
                    self._tmp = self._tmp_name()
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                    fd = os.open(self._tmp, flags, 0o666, dir_fd=self._dir)  # the umask applies, as for open()
            except OSError as exc:
                self._tmp = None
                raise UsageError(f"{self.what}: cannot create a file in {parent}: {exc.strerror or exc}; "
                                 f"write elsewhere") from None
            self.file: BinaryIO = open(fd, "wb")  # noqa: SIM115 - closed by commit/discard
        except BaseException:
            os.close(self._dir)
            self._dir = None
            raise

    def commit(self) -> None:
        """The written bytes under the output's name (replacing whatever had the name, a link
        included, never what a link points to). CollectiveError (nothing left) if that fails."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            if self._unnamed:  # its first name: a new one, never one that exists (EEXIST)
                tmp = self._tmp_name()
                os.link(f"/proc/self/fd/{self.file.fileno()}", tmp, dst_dir_fd=self._dir, follow_symlinks=True)
                self._tmp = tmp
            self.file.close()
            os.replace(self._tmp, self.name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError as exc:
            raise self.failed(exc) from None
        self._tmp = None
        self._close_dir()

    def failed(self, exc: OSError) -> CollectiveError:
        """The one-line error of a write that failed (a full disk), the new file removed."""
        self.discard()
        return CollectiveError(f"{self.what}: cannot write: {exc.strerror or exc}; nothing was written")

    def discard(self) -> None:
        """Remove the new file (idempotent): a failed write leaves nothing behind."""
        with contextlib.suppress(OSError):
            self.file.close()
        if self._tmp is not None and self._dir is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp, dir_fd=self._dir)
            self._tmp = None
        self._close_dir()

    def _tmp_name(self) -> str:
        """Hidden, unguessable, and within one name's length: ".NAME.<16 hex>.tmp"."""
        prefix = os.fsencode(self.name)[: _NAME_MAX - 22].decode(errors="ignore")
        return f".{prefix}.{secrets.token_hex(8)}.tmp"

    def _close_dir(self) -> None:
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None


# What open(O_TMPFILE) fails with where the kernel or the file system has no unnamed files: the
# named file is made instead. (A kernel older than 3.11 sees O_DIRECTORY | O_WRONLY: EISDIR.)
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)


def _unnamed(directory: int) -> int | None:
    """A new file without a name in ``directory`` (a descriptor), open for writing; None where
    unnamed files are not to be had (no O_TMPFILE, or no /proc to name it through at commit)."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:  # no O_EXCL: that would forbid ever linking it. The umask applies, as for open().
        return os.open(".", flag | os.O_WRONLY | os.O_CLOEXEC, 0o666, dir_fd=directory)
    except OSError as exc:
        if exc.errno in _NO_TMPFILE:
            return None
        raise


def _foreign_link(directory: Path) -> Path | None:
    """The first symbolic link on the way to ``directory`` that belongs to a user other than this
    one or root (what the kernel's ``fs.protected_symlinks`` refuses in sticky directories), or
    None. Such a link in a shared directory would let its owner choose where the output goes."""
    parts = directory.parts
    for i in range(1, len(parts) + 1):
        above = Path(*parts[:i])
        try:
            st = os.lstat(above)
        except OSError:
            return None  # opening the directory says what is wrong
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
            return above
    return None


@contextlib.contextmanager
def written(target: str | os.PathLike[str] | OutputFile) -> Iterator[BinaryIO]:
    """The file to write ``target`` through (a path, or an ``OutputFile`` made earlier): put in
    place when the block ends, removed if it raises. An OSError while writing (a full disk) is a
    one-line CollectiveError naming the path."""
    out = target if isinstance(target, OutputFile) else OutputFile(target)
    try:
        yield out.file
    except OSError as exc:
        raise out.failed(exc) from None
    except BaseException:
        out.discard()
        raise
    out.commit()
