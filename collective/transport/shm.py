"""Same-host fast path: the chief's arena as a sealed memfd, handed to workers over a unix socket.

The chief materialises the model straight into an anonymous memory file (``memfd_create``),
seals it against writes, and serves it on an abstract unix socket whose name and a per-round
secret travel in the plan. A worker on the same host connects, proves it is a member (secret,
worker id, incarnation), receives the file descriptor (``SCM_RIGHTS``) and maps it private
(copy-on-write): no bytes are copied, replicas stay independent, and the worker still checks
every variable's digest before it reports ready. It maps only a memory file sealed against
write, shrink and grow (``F_GET_SEALS``, asked before mapping): what it checked cannot change
afterwards, nor be cut short under it (SIGBUS). Anything else (an unsealed memfd a hostile
holder or host leader keeps writable, or files from anyone but the chief) means the stream.

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
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable

import numpy as np

from collective.arena import SharedArena, map_private
from collective.logs import printable

log = logging.getLogger(__name__)

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
def peer_socket(chief_socket: str, rank: int) -> str:
    """The socket name on which worker ``rank`` serves its arena to its same-host peers: derived
    from the chief's (which is new every round), so it needs no field of its own in the plan."""
    return f"{chief_socket}-rank{rank}"


MAX_FDS = 253
"""The most descriptors one message passes (the kernel's SCM_MAX_FD): the most files an arena
served from its files (``sources.mapped.MappedFiles``) may have to be offered."""


class ShmServer:
    """Hands the arena's descriptor to authenticated members on an abstract unix socket.

    ``arena`` is a ``SharedArena`` or a ``sources.mapped.MappedFiles`` (the model's own files,
    with where each goes: the member maps them end to end, ``map_end_to_end``)."""

    def __init__(
        self, arena: SharedArena, admit: Callable[[str, str], str | None], *,
        name: str | None = None, secret: str | None = None, wait: float | None = None,
    ) -> None:
        """``admit(worker_id, incarnation)`` returns None to admit, or the reason to refuse.

        ``wait``: hand the descriptor out only once ``publish()`` was called (the arena is
        complete and sealed), keeping a member's request open up to ``wait`` seconds; None: the
        arena is complete already. ``name`` and ``secret`` default to new random ones."""
        self.arena = arena
        self.admit = admit
        self.secret = secret or secrets.token_hex(16)
        self.name = name or f"collective-shm-{secrets.token_hex(8)}"
        self._published = threading.Event()
        self._wait = wait
        if wait is None:
            self._published.set()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(16)
        self._unanswered = 0  # requests that failed or were refused (_warn), and those not yet logged
        self._unlogged = 0
        self._logged_at = 0.0
        self._count_lock = threading.Lock()
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
            self._warn("shared-memory request failed", printable(exc))
        finally:
            self._slots.release()

    # A local process that holds the slots (connects, says nothing, again) fails a request per
    # slot every 5 s: one WARNING, then a count at most this often and when the server closes.
    COUNT_EVERY = 60.0

    def _warn(self, what: str, detail: str) -> None:
        with self._count_lock:
            self._unanswered += 1
            self._unlogged += 1
            now = time.monotonic()
            first, due = self._unanswered == 1, now - self._logged_at >= self.COUNT_EVERY
            if first or due:
                unlogged, self._unlogged, self._logged_at = self._unlogged, 0, now
        if first:
            log.warning("%s: %s (more such are counted, not logged one by one)", what, detail)
        elif due:
            log.warning("%d more shared-memory request(s) failed or were refused (%d in all; the last: %s: %s)",
                        unlogged, self._unanswered, what, detail)
        else:
            log.debug("%s: %s", what, detail)

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
            self._warn("refused a shared-memory request", req)
            self._reply(conn, f"no: {req}".encode())
            return
        if not hmac.compare_digest(req["secret"].encode(), self.secret.encode()):
            self._reply(conn, b"no: wrong shared-memory secret")
            return
        why = self.admit(req["worker_id"], req["incarnation"])
        if why is not None:
            self._reply(conn, f"no: {why}".encode())
            return
        if not self._published.wait(self._wait):
            conn.sendall(f"no: the arena was not complete within {self._wait:g} s".encode())
            return
        if self._closed.is_set():
            conn.sendall(b"no: the arena is not served any more")
            return
        msg, fds = self.arena.handout()
        socket.send_fds(conn, [msg], fds)

    def publish(self) -> None:
        """The arena is complete and sealed: answer waiting and later members."""
        self._published.set()

    def close(self) -> None:
        self._closed.set()
        self._published.set()  # a member still waiting hears "no" now, not at its deadline
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(2)
        with self._count_lock:
            unlogged, self._unlogged = self._unlogged, 0
        if unlogged:
            log.warning("%d more shared-memory request(s) failed or were refused (%d in all)", unlogged,
                        self._unanswered)


class ServedArena:
    """A host leader's receive arena: a memfd it fills from the network and, once complete and
    sealed, hands to the peers on its host (``ShmServer`` on ``name``), which map it as the chief's.

    ``writable`` is where the bytes land (drop every view of it before ``complete``); ``reader()``
    is what a relay serves from meanwhile.
    """

    def __init__(self, size: int, *, name: str, secret: str, admit: Callable[[str, str], str | None], wait: float) -> None:
        self.shared = SharedArena(size, prefault=True)  # prefault: every page exists for reader()
        self.writable: np.ndarray | None = self.shared.array
        self.server = ShmServer(self.shared, admit, name=name, secret=secret, wait=wait)

    def reader(self) -> np.ndarray:
        return self.shared.reader()

    def complete(self) -> np.ndarray:
        """Seal the segment, answer the peers, and return this process's own copy-on-write
        mapping (its writes stay its own, as a peer's do). If the seal fails, the peers are
        refused (they take the network from this worker's relay) and the arena is returned."""
        arena, self.writable = self.writable, None
        try:
            del arena  # the seal needs every writable view gone
            self.shared.seal()
        except (BufferError, OSError) as exc:
            log.warning("cannot seal the received arena for same-host peers (%s); they take the network", exc)
            self.server.close()
            return self.shared.array if self.shared.array is not None else self.shared.private()
        self.server.publish()
        return self.shared.private()

    def close(self) -> None:
        self.server.close()
        self.shared.close()


_NEEDED_SEALS = {fcntl.F_SEAL_WRITE: "write", fcntl.F_SEAL_SHRINK: "shrink", fcntl.F_SEAL_GROW: "grow"}


def unsealed(fd: int) -> str | None:
    """None when ``fd`` is a memory file sealed against write, shrink and grow (its bytes and
    size can never change again, for anyone: seals are never removed); else what it lacks.

    ``F_SEAL_FUTURE_WRITE`` is not enough: it leaves the writable shared mappings that already
    exist (its sender's) writable, where ``F_SEAL_WRITE`` cannot be set while one exists."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:  # EINVAL: not a memfd (a file, a pipe, a socket)
        return f"not a sealable memory file ({exc.strerror or exc})"
    missing = [what for bit, what in _NEEDED_SEALS.items() if not seals & bit]
    return f"not sealed against {', '.join(missing)}" if missing else None


def attach(
    name: str, secret: str, worker_id: str, incarnation: str, size: int, timeout: float = 5.0,
    *, wait: float | None = None, whose: str = "the chief", cancelled: Callable[[], bool] = lambda: False,
    files: bool = False,
) -> np.ndarray | None:
    """Map ``whose`` arena copy-on-write, or None when it is not reachable from here.

    None means another host (no such socket in this network namespace) or a refusal; the caller
    then takes the network stream. Never raises for those cases; the caller verifies digests.
    ``wait``: how long to wait for the answer once connected (a host leader answers when its
    arena is complete); default ``timeout``. ``cancelled()``, asked a few times a second while
    waiting, gives up early (the round failed meanwhile).

    What the caller verifies must stay what it maps: a memory file is mapped only when sealed
    against write, shrink and grow (``unsealed``) and at least ``size`` bytes long, so its
    sender can neither change a byte after the check nor cut it short (SIGBUS here) later.
    ``files``: also accept the model's files (``--from-file``: one file like a memfd, several
    with their layout), which cannot be sealed: only from the chief, which the workers trust for
    the model anyway (SECURITY.md, "Shared memory").
    """
    if not name:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect("\0" + name)
            s.sendall(json.dumps({"secret": secret, "worker_id": worker_id, "incarnation": incarnation}).encode())
            deadline = time.monotonic() + (timeout if wait is None else wait)
            while True:
                s.settimeout(min(0.25, max(0.01, deadline - time.monotonic())))
                try:
                    msg, fds, _, _ = socket.recv_fds(s, 1 << 16, MAX_FDS)
                    break
                except TimeoutError:
                    if cancelled() or time.monotonic() >= deadline:
                        raise
    except OSError as exc:
        log.info("shared memory of %s not reachable from here (%s); using the network", whose, exc)
        return None
    if not (msg == b"ok" or msg.startswith(b"ok ")) or not fds:
        for fd in fds:
            os.close(fd)
        log.warning("%s refused shared memory (%s); using the network", whose,
                    printable(msg.decode(errors="replace")) or "no answer")  # the sender's text: bounded
        return None
    try:
        if msg == b"ok":
            why = unsealed(fds[0])  # first: once sealed, neither the bytes nor the size can change
            if why is not None and not (files and stat.S_ISREG(os.fstat(fds[0]).st_mode)):
                log.warning("%s offers shared memory %s: its bytes could change after they were checked; "
                            "using the network", whose, why)
                return None
            if os.fstat(fds[0]).st_size < size:
                log.warning("shared segment of %s is smaller than the plan's arena; using the network", whose)
                return None
            try:
                return map_private(fds[0], size)
            except OSError as exc:  # e.g. a huge-page file and no huge page to back it (ENOMEM)
                log.warning("cannot map the shared memory %s offers (%s); using the network", whose, exc)
                return None
        if not files:
            log.warning("%s offers files, which cannot be sealed, not a sealed memory file; using the network",
                        whose)
            return None
        return _map_files(msg[3:], fds, size, whose)
    finally:
        for fd in fds:
            os.close(fd)


def _map_files(layout: bytes, fds: list[int], size: int, whose: str) -> np.ndarray | None:
    """The model's files, as the chief serves them (``--from-file``), mapped copy-on-write end to
    end where ``layout`` puts each; None (the network then) when they do not make the arena."""
    from collective.sources.mapped import map_end_to_end

    try:
        places = [tuple(int(x) for x in p) for p in json.loads(layout)["maps"]]
        fits = len(places) == len(fds) and places and places[-1][0] + places[-1][2] == size and all(
            len(p) == 3 and min(p) >= 0 and os.fstat(fd).st_size >= p[1] + p[2] for fd, p in zip(fds, places, strict=False))
        if not fits:
            log.warning("the files %s offers do not make the plan's arena; using the network", whose)
            return None
        return map_end_to_end(fds, places, size, writable=True)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        log.warning("cannot map the files %s offers (%s); using the network", whose, exc)
        return None
