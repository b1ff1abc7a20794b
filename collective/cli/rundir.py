"""A launch's run directory, safe against other local users (root included).

``collective launch`` may run as root in a directory another user named or made (``--run-dir
/tmp/myrun``). Whoever can write to that directory, or to a directory above it, could plant a
symlink (``.launch.lock -> /etc/passwd``) and have root truncate what it points to. So:

- The directory itself is checked by ``lstat``, then opened with ``O_NOFOLLOW`` and checked
  again on the open descriptor (``fstat``): it must be a directory (not a symlink to one), owned
  by this user, and not writable by group or others. Every directory above it must be owned by
  this user or root and, if others may write to it, sticky (as /tmp is), so no one else can
  rename or replace the path under us; a symlink on the way must belong to this user or root.
- Every file in it is created through the directory's descriptor (``openat``) with
  ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600; the previous run's files are unlinked through the
  descriptor first (``unlinkat`` removes a planted link, never what it points to). The lock file,
  which outlives a run (a new inode would let two launches lock different files), is opened with
  ``O_NOFOLLOW`` and must be a regular file owned by this user with one link.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from collective.errors import UsageError

LOCK_NAME = ".launch.lock"
STATUS_FILE = "status.json"  # the chief's address and token while a launch runs (`collective status --run-dir`)
RESULT_FILE = "result.json"  # the ended launch's summary
# What a launch leaves that the next launch in the same directory clears first.
RUN_FILES = ("chief.port", "chief.port.tmp", RESULT_FILE, "chief.log", "mpiexec.log", STATUS_FILE)


def _refuse(path: Path, why: str) -> UsageError:
    return UsageError(f"cannot use run directory {path}: {why}; pass another --run-dir")


def _trusted(uid: int) -> bool:
    return uid in (0, os.geteuid())


def check_ancestors(path: Path) -> None:
    """Refuse ``path`` when a directory (or symlink) above it is controlled by another user:
    they could swap the path for one of their own between our checks and our use."""
    parts = path.parts
    for i in range(1, len(parts)):
        above = Path(*parts[:i])
        try:
            st = os.lstat(above)
        except FileNotFoundError:
            return  # created by us below (mkdir), as this user
        except OSError as exc:
            raise _refuse(path, f"{above}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            if not _trusted(st.st_uid):
                raise _refuse(path, f"{above} is a symlink owned by another user (uid {st.st_uid})")
            continue  # the directory it points to is checked below, by its real path
        _check_parent(path, above, st)
    real = Path(os.path.realpath(path.parent))
    for i in range(1, len(real.parts) + 1):
        above = Path(*real.parts[:i])
        try:
            _check_parent(path, above, os.lstat(above))
        except FileNotFoundError:
            return


def _check_parent(path: Path, above: Path, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        return  # mkdir will say "Not a directory"
    if not _trusted(st.st_uid):
        raise _refuse(path, f"{above} belongs to another user (uid {st.st_uid}), who could replace the run directory")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"{above} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}) without "
                            f"the sticky bit, so they could replace the run directory")


def _check_dir(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "it is a symlink; name the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"it belongs to another user (uid {st.st_uid}, not {os.geteuid()})")
    if st.st_mode & 0o022:
        raise _refuse(path, f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                            f"chmod go-w it")


class RunDir:
    """The run directory, held open by descriptor. ``path=None``: a new private temporary one
    (``temporary`` is then True: removed after a successful run unless kept)."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.temporary = path is None
        self.path = Path(tempfile.mkdtemp(prefix="collective-run-")) if path is None else Path(os.path.abspath(path))
        self.fd: int | None = None
        self.lock_fd: int | None = None

    def open(self) -> None:
        """Make (0700) or check the directory and open it; refuse it in one line (UsageError)."""
        path = self.path
        if not self.temporary:
            check_ancestors(path)
            try:
                path.mkdir(mode=0o700)  # the directory only: a mistyped parent is not made
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise _refuse(path, f"its parent directory {path.parent} does not exist (create it first)") from None
            except OSError as exc:
                raise _refuse(path, f"{exc.strerror or exc}"
                              f"{f' ({exc.filename})' if exc.filename and str(exc.filename) != str(path) else ''}") from None
            try:
                _check_dir(path, os.lstat(path))
            except FileNotFoundError:
                raise _refuse(path, "it vanished while being made") from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _refuse(path, exc.strerror or str(exc)) from None
        try:
            _check_dir(path, os.fstat(fd))  # what we hold, not what the name points to now
        except UsageError:
            os.close(fd)
            raise
        self.fd = fd

    def open_lock(self) -> int:
        """The lock file's descriptor (created if missing, never followed through a link)."""
        assert self.fd is not None
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(LOCK_NAME, flags, 0o600, dir_fd=self.fd)
        except OSError as exc:
            why = "it is a symlink; remove it" if exc.errno == 40 else (exc.strerror or str(exc))  # ELOOP
            raise _refuse(self.path, f"{LOCK_NAME}: {why}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            raise _refuse(self.path, f"{LOCK_NAME} is not a regular file of this user with one link; remove it")
        self.lock_fd = fd
        return fd

    def clear(self) -> None:
        """Unlink the previous run's files (a planted link is removed, not followed)."""
        assert self.fd is not None
        for name in os.listdir(self.fd):
            if name in RUN_FILES or (name.startswith("worker-") and name.endswith(".log")):
                try:
                    os.unlink(name, dir_fd=self.fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:  # a directory of that name (EISDIR/EPERM), a read-only mount
                    raise _refuse(self.path, f"cannot remove the previous run's {name}: {exc.strerror or exc}") from None

    def create(self, name: str, *, binary: bool = False):
        """A new file ``name`` in the directory, 0600, opened for writing. Raises OSError (also
        when ``name`` exists: nothing is ever truncated or followed)."""
        assert self.fd is not None
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        return open(fd, "wb" if binary else "w")  # noqa: SIM115 - the caller closes it

    def unlink(self, name: str) -> None:
        if self.fd is not None:
            try:
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for attr in ("lock_fd", "fd"):
            fd = getattr(self, attr)
            if fd is not None:
                os.close(fd)  # the lock's flock goes with it; the file stays
                setattr(self, attr, None)

    def remove(self) -> None:
        """Delete the (temporary) directory and all in it; rmtree never follows a link."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
