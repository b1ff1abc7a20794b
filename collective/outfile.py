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
- the bytes go to a new file with an unguessable name beside the output, created through the
  directory's descriptor with ``O_CREAT | O_EXCL | O_NOFOLLOW``: nothing that exists is ever opened;
- once complete it is renamed onto the output's name: a rename replaces a link at that name and
  never follows it. On any failure the new file is unlinked: no partial file is left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from collective.errors import CollectiveError, UsageError

_NAME_MAX = 255  # bytes of one file name on Linux file systems


class OutputFile:
    """``path`` about to be written: its directory open, a new hidden file in it open as ``file``.
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
            # Hidden, unguessable, and within one name's length: ".NAME.<16 hex>.tmp".
            prefix = os.fsencode(name)[: _NAME_MAX - 22].decode(errors="ignore")
            self._tmp: str | None = f".{prefix}.{secrets.token_hex(8)}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
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

    def _close_dir(self) -> None:
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None


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
