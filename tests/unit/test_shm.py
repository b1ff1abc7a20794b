"""collective.transport.shm: handshake, refusal and sealing, without a cluster."""

from __future__ import annotations

import numpy as np
import pytest

from collective.transport.shm import SharedArena, ShmServer, attach


@pytest.fixture
def served():
    arena = SharedArena(4096)
    arena.array[:] = np.arange(4096) % 251
    arena.seal()
    server = ShmServer(arena, lambda wid, inc: None if (wid, inc) == ("w0", "i0") else "not a member")
    yield arena, server
    server.close()
    arena.close()


def test_a_member_maps_the_arena_copy_on_write(served):
    arena, server = served
    view = attach(server.name, server.secret, "w0", "i0", 4096)
    assert view is not None and np.array_equal(view, np.arange(4096) % 251)
    view[0] = 200  # private: the chief's arena is untouched
    assert arena.array[0] == 0


def test_a_non_member_or_a_wrong_secret_is_refused_and_falls_back(served):
    _, server = served
    assert attach(server.name, server.secret, "stranger", "i0", 4096) is None
    assert attach(server.name, "wrong", "w0", "i0", 4096) is None


def test_a_socket_that_is_not_here_means_another_host(served):
    assert attach("collective-shm-no-such-socket", "x", "w0", "i0", 4096) is None


def test_the_sealed_arena_cannot_be_written_even_by_the_chief(served):
    """The seal itself, not just our read-only view: a new writable shared mapping of the memfd
    and a write through its descriptor are refused by the kernel (F_SEAL_WRITE)."""
    import errno
    import fcntl
    import mmap
    import os

    arena, _ = served
    seals = fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(PermissionError):
        mmap.mmap(arena.fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError) as info:
        os.pwrite(arena.fd, b"\x01", 0)
    assert info.value.errno == errno.EPERM
    assert arena.array[0] == 0


def test_an_unsealed_arena_is_writable_through_a_second_mapping():
    """The check above can fail: the same attempt succeeds on an arena that was never sealed."""
    import mmap

    arena = SharedArena(4096)
    try:
        second = mmap.mmap(arena.fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        second[0] = 7
        assert arena.array[0] == 7
        second.close()
    finally:
        arena.close()


def test_a_segment_smaller_than_the_plan_says_is_not_used(served):
    _, server = served
    assert attach(server.name, server.secret, "w0", "i0", 8192) is None


def _hello(name: str, raw: bytes) -> bytes:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect("\0" + name)
        s.sendall(raw)
        return s.recv(4096)


@pytest.mark.parametrize("raw", [b"[]", b"null", b'"w0"', b"\xff\xfe", b"{", b'{"secret": 1, "worker_id": [], "incarnation": {}}'])
def test_a_malformed_hello_is_refused_and_the_server_keeps_serving_members(served, raw):
    _, server = served
    assert _hello(server.name, raw).startswith(b"no: malformed hello")
    assert attach(server.name, server.secret, "w0", "i0", 4096) is not None


def test_a_local_client_that_connects_and_says_nothing_does_not_hold_up_a_member(served):
    import socket

    _, server = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect("\0" + server.name)
        # The silent client holds its connection for the server's whole 5 s read timeout.
        assert attach(server.name, server.secret, "w0", "i0", 4096, timeout=2.0) is not None


class _Offer:
    """What a hostile holder or host leader hands out instead of a sealed arena (``handout``)."""

    def __init__(self, msg: bytes, fds: list[int]) -> None:
        self.msg, self.fds = msg, fds

    def handout(self) -> tuple[bytes, list[int]]:
        return self.msg, self.fds


def _offered(msg: bytes, fd: int, size: int = 4096, **kwargs):
    server = ShmServer(_Offer(msg, [fd]), lambda wid, inc: None)
    try:
        return attach(server.name, server.secret, "w0", "i0", size, **kwargs)
    finally:
        server.close()


F_SEAL_FUTURE_WRITE = 0x0010  # linux/fcntl.h (Linux 5.1); not in Python's fcntl module


@pytest.mark.parametrize("seals", ["none", "future-write", "no-shrink", "no-grow", "not-allowed"])
def test_only_a_memory_file_sealed_against_write_shrink_and_grow_is_mapped(seals, caplog):
    """Its sender could change what the caller checked (write), or cut it short under the caller's
    mapping (SIGBUS): F_GET_SEALS is asked before mapping. F_SEAL_FUTURE_WRITE leaves the sender's
    own writable mapping writable, so it does not count as F_SEAL_WRITE."""
    import fcntl
    import mmap
    import os

    flags = os.MFD_CLOEXEC | (0 if seals == "not-allowed" else os.MFD_ALLOW_SEALING)
    fd = os.memfd_create("offer", flags)
    os.ftruncate(fd, 4096)
    keep = mmap.mmap(fd, 4096)  # the sender's writable shared mapping
    add, missing = {"none": (0, "write, shrink, grow"), "not-allowed": (0, "write, shrink, grow"),
                    "future-write": (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, "write"),
                    "no-shrink": (fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW, "shrink"),
                    "no-grow": (fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK, "grow")}[seals]
    if add & fcntl.F_SEAL_WRITE:
        keep.close()  # F_SEAL_WRITE cannot be set while a writable shared mapping exists
    try:
        if add:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, add)
        assert _offered(b"ok", fd, whose="holder h0") is None
        assert f"holder h0 offers shared memory not sealed against {missing}: its bytes could change" in caplog.text
    finally:
        if not keep.closed:
            keep.close()
        os.close(fd)


def test_a_sealed_memory_file_is_mapped_and_a_pipe_is_not(served, caplog):
    import os

    arena, _ = served
    view = _offered(b"ok", arena.fd)
    assert view is not None and view[1] == 1
    r, w = os.pipe()
    try:
        assert _offered(b"ok", r) is None
        assert "offers shared memory not a sealable memory file" in caplog.text
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("msg", [b"ok", b'ok {"maps": [[0, 0, 4096]]}'], ids=["one file", "files"])
def test_files_are_mapped_only_where_the_caller_accepts_them(tmp_path, caplog, msg):
    """The model's files (--from-file: one is offered as a memfd is) cannot be sealed: a worker
    maps them from the chief (``files=True``), never from a fetch's holder or a host leader."""
    import os

    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)) * 16)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _offered(msg, fd, whose="holder h0") is None
        assert "holder h0 offers " in caplog.text and "using the network" in caplog.text
        view = _offered(msg, fd, files=True)
        assert view is not None and view[255] == 255
    finally:
        os.close(fd)


def test_nothing_changes_a_sealed_arena_a_hole_punched_included(served):
    """What the check relies on: with F_SEAL_WRITE the kernel also refuses to punch a hole in
    the file (fallocate), the one write that needs no mapping and no write()."""
    import ctypes
    import errno

    arena, _ = served
    libc = ctypes.CDLL(None, use_errno=True)
    punch_hole, keep_size = 0x02, 0x01  # linux/falloc.h
    assert libc.fallocate(arena.fd, punch_hole | keep_size, ctypes.c_long(0), ctypes.c_long(4096)) == -1
    assert ctypes.get_errno() == errno.EPERM
    assert arena.array[1] == 1


def test_a_sealed_memory_file_that_cannot_be_mapped_means_the_stream_not_an_exception(caplog):
    """A sealed huge-page memory file with no huge pages to back it: mmap fails (ENOMEM). A
    hostile sender's choice must not end the caller with an OSError: the stream instead."""
    import fcntl
    import os

    try:
        fd = os.memfd_create("offer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        os.ftruncate(fd, 2 << 20)
    except (OSError, AttributeError) as exc:
        pytest.skip(f"no huge-page memory file here: {exc}")
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        try:
            import mmap

            mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
            pytest.skip("huge pages are available here: the mapping would succeed")
        except OSError:
            pass
        assert _offered(b"ok", fd, whose="holder h0") is None
        assert "cannot map the shared memory holder h0 offers" in caplog.text
    finally:
        os.close(fd)


def test_a_senders_refusal_is_logged_as_one_bounded_safe_line(caplog):
    """The refusal is the sender's text: 60 KiB of it with a terminal escape is cut and escaped."""
    import os

    r, w = os.pipe()
    try:
        assert _offered(b"no: \x1b[2J" + b"A" * 60_000, r, whose="holder h0") is None
    finally:
        os.close(r)
        os.close(w)
    [line] = [rec.getMessage() for rec in caplog.records if "refused shared memory" in rec.getMessage()]
    assert len(line) < 1000 and "\x1b" not in line and "\\x1b[2J" in line
