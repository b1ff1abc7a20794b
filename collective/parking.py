"""Long waits parked off the server's threads: a call that waits for the round (the plan, the
prepared barrier, start, a worker's presence) holds no thread while it waits.

The chief's logic waits on its condition variable with ``wait_for`` (below) and signals with
``Condition.notify_all``. Called normally (the MPI drive, tests, the chief's own replicas) a
wait blocks as ever. A server that must not give a thread per waiting call (1,024 workers each
hold four such calls for the whole round) calls the same function in *poll* mode instead: a
wait whose predicate is false raises ``NotYet`` at once, and the server hands the call to a
``Parker``, whose one thread calls it again each time a ``Condition`` was notified, and once
more at its deadline in *expired* mode (the wait returns False without blocking, so the logic
words its own DeadlineError as it always did). One copy of the logic; the transport decides
how its calls wait.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable

_local = threading.local()
_listeners: list[Callable[[], None]] = []
_generation = itertools.count(1)
generation = 0  # bumped by every notify_all of a Condition: a parked call tried before a bump is tried again


class NotYet(Exception):  # noqa: N818 - not an error: "ask again when something changed"
    """Raised by ``wait_for`` in poll mode when its predicate is still false."""


class Condition(threading.Condition):
    """A condition variable whose ``notify_all`` also wakes the parked calls (``Parker``)."""

    def notify_all(self) -> None:
        global generation
        super().notify_all()
        generation = next(_generation)
        for listener in list(_listeners):
            listener()


def wait_for(cond: threading.Condition, predicate: Callable[[], bool], timeout: float) -> bool:
    """``cond.wait_for(predicate, timeout)`` (call with ``cond`` held), or in poll mode: True at
    once if ``predicate()``, else ``NotYet`` (a wait of 0 s answers at once, as ever); in expired
    mode: ``predicate()``, without waiting."""
    mode = getattr(_local, "mode", None)
    if mode is None:
        return cond.wait_for(predicate, timeout=max(0.0, timeout))
    if predicate():
        return True
    if mode == "poll" and timeout > 0:
        raise NotYet
    return False


@contextlib.contextmanager
def mode(name: str | None):
    """Run the block's waits in ``name`` mode ("poll", "expired"; None: blocking) on this thread."""
    previous = getattr(_local, "mode", None)
    _local.mode = name
    try:
        yield
    finally:
        _local.mode = previous


def retrying() -> bool:
    """Whether this thread is the Parker's, asking a parked call again: no news from its
    caller (a frozen worker's parked calls must not count as signs of life)."""
    return getattr(_local, "retry", False)


def poll(fn: Callable, *args):
    """``fn(*args)`` in poll mode: its result, or ``NotYet``."""
    with mode("poll"):
        return fn(*args)


class Parker:
    """One thread that answers parked calls: each is tried again (poll mode) after a
    ``Condition`` changed, and answered at its deadline (expired mode). ``done(result, error)``
    is called on this thread, once per call, unless the call was ``unpark``ed first.

    Tries come in batches: after one, the thread rests as long as it took (at least
    ``MIN_REST`` s), so 1,024 parked calls woken by 1,024 joins cost at most half a core."""

    MIN_REST = 0.01
    MAX_WAIT = 0.25

    def __init__(self, name: str = "parked-calls") -> None:
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._parked: dict[int, tuple[Callable, float, Callable]] = {}
        self._keys = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _listeners.append(self._notified)

    def __len__(self) -> int:
        return len(self._parked)

    def _notified(self) -> None:
        # A try of a parked call may notify (await_start marks its worker told): that is no
        # news for the other parked calls, and would make the thread spin.
        if threading.current_thread() is not self._thread:
            self._changed.set()

    def park(self, fn: Callable[[], object], deadline: float, done: Callable, tried_at: int) -> int:
        """Park ``fn`` (it raised NotYet when tried at ``tried_at``, the then ``generation``)."""
        with self._lock:
            key = next(self._keys)
            self._parked[key] = (fn, deadline, done)
        if generation != tried_at:  # it changed since that try: try again now
            self._changed.set()
        return key

    def unpark(self, key: int) -> None:
        with self._lock:
            self._parked.pop(key, None)

    def _run(self) -> None:
        _local.retry = True
        while not self._closed:
            with self._lock:
                nearest = min((d for _, d, _ in self._parked.values()), default=None)
            # At most MAX_WAIT: a call parked meanwhile is answered that late past its deadline at worst.
            wait = self.MAX_WAIT if nearest is None else min(max(nearest - time.monotonic(), 0.0), self.MAX_WAIT)
            self._changed.wait(wait)
            self._changed.clear()
            t0 = time.monotonic()
            with self._lock:
                batch = list(self._parked.items())
            for key, (fn, deadline, done) in batch:
                self._try(key, fn, deadline, done)
            if batch:
                time.sleep(max(time.monotonic() - t0, self.MIN_REST))

    def _try(self, key: int, fn: Callable, deadline: float, done: Callable) -> None:
        with self._lock:
            if key not in self._parked:
                return  # ended meanwhile (the client went)
        try:
            with mode("expired" if time.monotonic() >= deadline else "poll"):
                result = fn()
        except NotYet:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the call, which answers with it
            self.unpark(key)
            done(None, exc)
            return
        self.unpark(key)
        done(result, None)

    def close(self) -> None:
        self._closed = True
        self._changed.set()
        with contextlib.suppress(ValueError):
            _listeners.remove(self._notified)
        self._thread.join(2.0)


_parker: Parker | None = None
_parker_lock = threading.Lock()


def parker() -> Parker:
    """The process's one Parker (every server in it parks there), started on first use."""
    global _parker
    with _parker_lock:
        if _parker is None:
            _parker = Parker()
        return _parker
