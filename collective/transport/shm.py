"""Same-host fast path: the chief's arena as a sealed memfd, handed to workers over a unix socket.

The chief materialises the model straight into an anonymous memory file (``memfd_create``),
seals it against writes, and serves it on an abstract unix socket whose name and a per-round
secret travel in the plan. A worker on the same host connects, proves it is a member (secret,
worker id, incarnation), receives the file descriptor (``SCM_RIGHTS``) and maps it private
(copy-on-write): no bytes are copied, replicas stay independent, and the worker still checks
every variable's digest before it reports ready.

Why this proves the segment is really shared: abstract unix sockets live in the network
namespace, and a descriptor can only be passed within one kernel, so a worker on another host
(or another container with its own network) cannot connect and falls back to the network
stream. Cleanup needs no one: the memory file has no name and is freed by the kernel when the
last process holding it exits, also when processes are killed.
"""

from __future__ import annotations

import fcntl
import hmac
import json
import logging
import mmap
import os
import secrets
import socket
import threading
from collections.abc import Callable

import numpy as np

from collective.logs import printable

log = logging.getLogger(__name__)

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


class SharedArena:
    """The chief's arena in a memfd. ``array`` is writable until ``seal()``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("collective-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, max(size, 1))
        self._map = mmap.mmap(self.fd, max(size, 1))
        self.array = np.frombuffer(self._map, dtype=np.uint8)[:size]

    def seal(self) -> None:
        """Make the segment read-only for everyone, this process included (F_SEAL_WRITE).

        Writable shared mappings forbid the seal, so ours is replaced by a read-only one.
        """
        data = self.array
        del data
        self.array = None  # type: ignore[assignment]
        self._map.close()
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        self._map = mmap.mmap(self.fd, max(self.size, 1), prot=mmap.PROT_READ)
        self.array = np.frombuffer(self._map, dtype=np.uint8)[: self.size]

    def close(self) -> None:
        os.close(self.fd)


_HELLO_FIELDS = ("secret", "worker_id", "incarnation")


def parse_hello(raw: bytes) -> dict[str, str] | str:
    """A worker's hello: a JSON object of string ``secret``, ``worker_id`` and ``incarnation``.
    Returns the fields, or what is wrong with it (for the refusal)."""
    try:
        req = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return f"malformed hello ({len(raw)} bytes, not JSON)"
    if not isinstance(req, dict) or not all(isinstance(req.get(k), str) for k in _HELLO_FIELDS):
        return f"malformed hello: expected an object with string fields {', '.join(_HELLO_FIELDS)}"
    return {k: req[k] for k in _HELLO_FIELDS}


class ShmServer:
    """Hands the arena's descriptor to authenticated members on an abstract unix socket."""

    def __init__(self, arena: SharedArena, admit: Callable[[str, str], str | None]) -> None:
        """``admit(worker_id, incarnation)`` returns None to admit, or the reason to refuse."""
        self.arena = arena
        self.admit = admit
        self.secret = secrets.token_hex(16)
        self.name = f"collective-shm-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(16)
        self._thread = threading.Thread(target=self._serve, name="shm-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Accept forever; each hello is answered on a thread of its own (at most 16 at once), so
        a local process that connects and says nothing delays no one, and nothing a peer sends
        can end this loop."""
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                with conn:
                    self._reply(conn, b"no: shared-memory server busy")
                continue
            threading.Thread(target=self._answer_and_close, args=(conn,), name="shm-hello", daemon=True).start()

    def _answer_and_close(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._answer(conn)
        except Exception as exc:  # noqa: BLE001 - a peer's hello must never end the server
            log.warning("shared-memory request failed: %s", printable(exc))
        finally:
            self._slots.release()

    @staticmethod
    def _reply(conn: socket.socket, msg: bytes) -> None:
        try:
            conn.sendall(msg)
        except OSError:
            pass

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        req = parse_hello(conn.recv(4096))
        if isinstance(req, str):
            log.warning("refused a shared-memory request: %s", req)
            self._reply(conn, f"no: {req}".encode())
            return
        if not hmac.compare_digest(req["secret"].encode(), self.secret.encode()):
            self._reply(conn, b"no: wrong shared-memory secret")
            return
        why = self.admit(req["worker_id"], req["incarnation"])
        if why is not None:
            self._reply(conn, f"no: {why}".encode())
            return
        socket.send_fds(conn, [b"ok"], [self.arena.fd])

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(2)


def attach(name: str, secret: str, worker_id: str, incarnation: str, size: int, timeout: float = 5.0) -> np.ndarray | None:
    """Map the chief's arena copy-on-write, or None when it is not reachable from here.

    None means another host (no such socket in this network namespace) or a refusal; the caller
    then takes the network stream. Never raises for those cases; the caller verifies digests.
    """
    if not name:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect("\0" + name)
            s.sendall(json.dumps({"secret": secret, "worker_id": worker_id, "incarnation": incarnation}).encode())
            msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    except OSError as exc:
        log.info("shared memory of the chief not reachable from here (%s); using the network", exc)
        return None
    if msg != b"ok" or not fds:
        for fd in fds:
            os.close(fd)
        log.warning("chief refused shared memory (%s); using the network", msg.decode(errors="replace"))
        return None
    fd = fds[0]
    try:
        if os.fstat(fd).st_size < size:
            log.warning("shared segment is smaller than the plan's arena; using the network")
            return None
        mm = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)[:size]
