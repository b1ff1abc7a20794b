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
import heapq
import itertools
import threading
import time
from collections.abc import Callable

_local = threading.local()
_listeners: list[Callable[[], None]] = []
_generation = itertools.count(1)
generation = 0  # bumped by every notify_all of a Condition: a parked call tried before a bump is tried again


class NotYet(Exception):  # noqa: N818 - not an error: "ask again when something changed"
    """Raised by ``wait_for`` in poll mode when its predicate is still false. With a ``key``,
    it carries the wait (its condition, predicate and key), so a ``Parker`` can ask the
    predicate alone, once for every call parked on the same key, instead of each call again."""

    def __init__(self, cond: threading.Condition | None = None, predicate: Callable[[], bool] | None = None,
                 key: str | None = None) -> None:
        super().__init__()
        self.cond, self.predicate, self.key = cond, predicate, key

    @property
    def group(self) -> tuple[int, str] | None:
        return None if self.key is None else (id(self.cond), self.key)


class Condition(threading.Condition):
    """A condition variable whose ``notify_all`` also wakes the parked calls (``Parker``)."""

    def notify_all(self) -> None:
        global generation
        super().notify_all()
        generation = next(_generation)
        for listener in list(_listeners):
            listener()


def wait_for(cond: threading.Condition, predicate: Callable[[], bool], timeout: float, key: str | None = None) -> bool:
    """``cond.wait_for(predicate, timeout)`` (call with ``cond`` held), or in poll mode: True at
    once if ``predicate()``, else ``NotYet`` (a wait of 0 s answers at once, as ever); in expired
    mode: ``predicate()``, without waiting.

    ``key``: a name for what the wait waits for, the same for every wait on ``cond`` whose
    predicate is the same (reads only shared state, not the caller's): a parked call is then
    tried again only once that predicate holds (or at its deadline), not at every notify."""
    mode = getattr(_local, "mode", None)
    if mode is None:
        return cond.wait_for(predicate, timeout=max(0.0, timeout))
    if predicate():
        return True
    if mode == "poll" and timeout > 0:
        raise NotYet(cond, predicate, key)
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


class _Parked:
    __slots__ = ("fn", "deadline", "done", "waiting", "group")

    def __init__(self, fn: Callable, deadline: float, done: Callable, waiting: NotYet | None) -> None:
        self.fn, self.deadline, self.done, self.waiting = fn, deadline, done, waiting
        self.group = waiting.group if waiting is not None else None


class Parker:
    """One thread that answers parked calls: each is tried again (poll mode) after a
    ``Condition`` changed, and answered at its deadline (expired mode). ``done(result, error)``
    is called on this thread, once per call, unless the call was ``unpark``ed first.

    A call whose wait has a key (``wait_for``) is tried again only when its predicate holds:
    the predicate is asked once per key and notify, so 1,024 calls parked on "start" cost one
    look at the round per notify, not 1,024 tries (each takes the lock and looks up its
    worker; the prepared barrier's predicate reads every member: 1,024 x 1,024 per notify).
    The calls are filed by key and their deadlines kept in a heap, so a batch looks only at
    the keys, the calls without one, the calls of a key whose predicate holds and those whose
    deadline passed: its work follows what changed, not how many calls are parked (issue 39:
    every batch went through every parked call, about N^2 work a round at N workers).
    Tries come in batches: after one, the thread rests as long as it took (at least
    ``MIN_REST`` s), so a storm of notifies costs at most half a core. ``tries``, ``checks``
    and ``looked`` count the calls tried again, the predicates asked and the parked calls a
    batch looked at (tried, or found answered meanwhile)."""

    MIN_REST = 0.001
    MAX_WAIT = 0.25

    def __init__(self, name: str = "parked-calls") -> None:
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._parked: dict[int, _Parked] = {}
        self._groups: dict[tuple[int, str], dict[int, NotYet]] = {}  # key's group -> its calls, each with its wait
        self._loose: dict[int, None] = {}  # calls without a key: tried at every notify
        self._deadlines: list[tuple[float, int]] = []  # heap; a call answered meanwhile is skipped when met
        self._keys = itertools.count()
        self._closed = False
        self.tries = self.checks = self.looked = 0
        self._ended = threading.Condition()  # notified at the end of every batch (``settle``)
        self._batches, self._in_batch = 0, False
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

    def park(self, fn: Callable[[], object], deadline: float, done: Callable, tried_at: int,
             waiting: NotYet | None = None) -> int:
        """Park ``fn`` (it raised ``waiting``, a NotYet, when tried at ``tried_at``, the then ``generation``)."""
        if waiting is not None:
            waiting.__traceback__ = None  # its frames (the pool thread's, the handler's) are no use here
        with self._lock:
            key = next(self._keys)
            p = self._parked[key] = _Parked(fn, deadline, done, waiting)
            self._file(key, p)
            heapq.heappush(self._deadlines, (deadline, key))
        if generation != tried_at:  # it changed since that try: try again now
            self._changed.set()
        return key

    def _file(self, key: int, p: _Parked) -> None:
        """File ``p`` under its wait's group (with the lock held)."""
        if p.group is None:
            self._loose[key] = None
        else:
            self._groups.setdefault(p.group, {})[key] = p.waiting

    def _unfile(self, key: int, p: _Parked) -> None:
        if p.group is None:
            self._loose.pop(key, None)
            return
        calls = self._groups.get(p.group)
        if calls is not None:
            calls.pop(key, None)
            if not calls:
                del self._groups[p.group]

    def unpark(self, key: int) -> None:
        with self._lock:
            p = self._parked.pop(key, None)
            if p is not None:
                self._unfile(key, p)

    def _nearest(self) -> float | None:
        """The nearest deadline of a parked call (with the lock held); answered ones dropped on the way."""
        while self._deadlines and self._deadlines[0][1] not in self._parked:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _run(self) -> None:
        _local.retry = True
        while not self._closed:
            with self._lock:
                nearest = self._nearest()
            # At most MAX_WAIT: a call parked meanwhile is answered that late past its deadline at worst.
            wait = self.MAX_WAIT if nearest is None else min(max(nearest - time.monotonic(), 0.0), self.MAX_WAIT)
            news = self._changed.wait(wait)
            self._changed.clear()
            t0 = time.monotonic()
            with self._ended:
                self._in_batch = True
            try:
                due = self._batch(news, t0)
            finally:
                with self._ended:
                    self._in_batch = False
                    self._batches += 1
                    self._ended.notify_all()
            if due:
                time.sleep(max(time.monotonic() - t0, self.MIN_REST))

    def settle(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` s, until the thread has looked at every parked call once
        since now, and is not in the middle of a batch. A call it is answering holds the
        service the call waited on (its predicate reads it): a round that has just ended, whose
        objects hold each other, is only freed by a collection after that (``release_freed_memory``).
        True if it settled in time."""
        if threading.current_thread() is self._thread:
            return False
        with self._ended:
            target = self._batches + (2 if self._in_batch else 1)
            self._changed.set()
            return self._ended.wait_for(lambda: self._batches >= target or self._closed, timeout)

    def _batch(self, news: bool, t0: float) -> bool:
        """Try the calls due: those past their deadline; on news also every call without a key,
        and those of each key whose predicate holds (asked once per key). True if any was
        looked at. A method of its own: the batch (each call's wait, its predicate, the service
        it reads) must not stay alive in ``_run``'s locals while the thread waits for the next
        notify, or a finished round's service outlives its call until then."""
        with self._lock:
            expired = []
            while self._nearest() is not None and self._deadlines[0][0] <= t0:
                expired.append(heapq.heappop(self._deadlines)[1])
            groups = [(group, next(iter(calls.values()))) for group, calls in self._groups.items()] if news else []
            loose = list(self._loose) if news else []
        for key in expired:
            self._try(key)
        asked = False
        for group, waiting in groups:
            asked = True
            if self._holds(waiting):
                with self._lock:
                    calls = list(self._groups.get(group, ()))
                for key in calls:
                    self._try(key)
        for key in loose:
            self._try(key)
        return bool(expired or loose or asked)

    def _holds(self, waiting: NotYet) -> bool:
        self.checks += 1
        try:
            with waiting.cond:
                return bool(waiting.predicate())
        except Exception:  # noqa: BLE001 - the call itself will say what is wrong
            return True

    def _try(self, key: int) -> None:
        with self._lock:
            p = self._parked.get(key)
        self.looked += 1
        if p is None:
            return  # ended meanwhile (the client went, or answered earlier in this batch)
        self.tries += 1
        try:
            with mode("expired" if time.monotonic() >= p.deadline else "poll"):
                result = p.fn()
        except NotYet as again:
            again.__traceback__ = None
            with self._lock:  # it may wait for something else now: filed under that
                if key in self._parked:
                    self._unfile(key, p)
                    p.waiting, p.group = again, again.group
                    self._file(key, p)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the call, which answers with it
            self.unpark(key)
            p.done(None, exc)
            return
        self.unpark(key)
        p.done(result, None)

    def close(self) -> None:
        self._closed = True
        self._changed.set()
        with self._ended:
            self._ended.notify_all()
        with contextlib.suppress(ValueError):
            _listeners.remove(self._notified)
        self._thread.join(2.0)


_parker: Parker | None = None
_parker_lock = threading.Lock()


def stats() -> dict[str, int]:
    """The process's Parker's counts (none started: zeros): calls parked now, tried again, predicates asked, calls looked at."""
    p = _parker
    return {"parked": len(p), "tries": p.tries, "checks": p.checks, "looked": p.looked} if p is not None else \
        {"parked": 0, "tries": 0, "checks": 0, "looked": 0}


def settle(timeout: float) -> bool:
    """``Parker.settle`` of the process's Parker, if one was started."""
    p = _parker
    return p.settle(timeout) if p is not None else True


def parker() -> Parker:
    """The process's one Parker (every server in it parks there), started on first use."""
    global _parker
    with _parker_lock:
        if _parker is None:
            _parker = Parker()
        return _parker
