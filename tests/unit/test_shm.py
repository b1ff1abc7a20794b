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
