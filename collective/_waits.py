"""What a call of the API (``collective.sync`` / ``serve`` / ``join``) says while it waits, and
how it ends on SIGTERM / SIGINT: one line naming the phase and whom the round waited for."""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from collective.errors import AbortedError, CollectiveError, StopSignal

log = logging.getLogger("collective")


class Awaited:
    """While an API call waits, a WARNING naming whom the round still waits for: after
    ``first`` s (``Timeouts.straggler_log``), then every ``3 * first`` s. Python's last-resort
    handler prints it on stderr without any logging set-up, so a script that seems to hang
    says why. ``who``: this process in the line; ``awaited()``: whom it waits for, or None
    when there is nothing to say (the round is over)."""

    def __init__(self, who: str, awaited: Callable[[], str | None], first: float) -> None:
        self._who, self._awaited, self._first = who, awaited, first
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="collective-awaited", daemon=True)

    def __enter__(self) -> Awaited:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        started, every = time.monotonic(), self._first
        while not self._done.wait(every):
            every = 3 * self._first
            try:
                awaited = self._awaited()
            except Exception as exc:  # noqa: BLE001 - a line about waiting must never fail the call
                awaited = f"an answer ({type(exc).__name__}: {exc})"
            if awaited and not self._done.is_set():
                log.warning("%s: still waiting after %.0f s for %s", self._who, time.monotonic() - started, awaited)


def chief_awaits(pending) -> Callable[[], str | None]:
    def awaited() -> str | None:
        status = pending.status()
        return status.waiting_for or None

    return awaited


def worker_awaits(link, chief_name: str, timeout: float) -> Callable[[], str | None]:
    """Whom a worker waits for: whom its chief still waits for, or the chief itself."""
    def awaited() -> str | None:
        try:
            status = link.status(timeout, brief=True)
        except CollectiveError:
            return f"{chief_name} to answer"
        if status.phase in ("started", "failed"):
            return None
        return f"{status.waiting_for or 'the round'} ({chief_name} waits for them)"

    return awaited


def on_stop_signals(pending) -> dict[int, Any]:
    """On the main thread, SIGTERM / SIGINT fail the round: while the model loads, by raising
    here (the workers are told by ``pending``); once the round exists, by failing it, so every
    worker is told by the chief rather than a KeyboardInterrupt tearing the server down.
    Returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum, frame) -> None:
        service = pending.service
        if service is None:
            what = "interrupted" if signum == signal.SIGINT else "shutting down"
            err = AbortedError(f"chief {what} ({signal.Signals(signum).name}) while loading the model", phase="load")
            if signum == signal.SIGINT:
                err.exit_code = 130  # as every command exits on Ctrl-C
            pending.stopped = err  # should anything still swallow what follows, serving begins failed
            raise StopSignal(err)
        # Outside the handler: fail() takes the service lock, which this thread may hold.
        threading.Thread(target=stopped_by_signal, args=(service, signum), daemon=True).start()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


def stopped_by_signal(service, signum: int) -> None:
    """Fail the round on SIGTERM / SIGINT in one line naming the signal, the phase and whom the
    round still waited for (a scancel: who was still receiving)."""
    name = signal.Signals(signum).name
    try:
        status = service.status()
        phase, waiting = status.phase, status.waiting_for
    except Exception:  # noqa: BLE001 - the line must come out whatever the state
        phase, waiting = "?", ""
    what = "interrupted" if signum == signal.SIGINT else "shutting down"
    err = AbortedError(f"chief {what} ({name}) while {phase}" + (f"; still waiting for {waiting}" if waiting else ""),
                       phase=phase)
    if signum == signal.SIGINT:
        err.exit_code = 130  # as every command exits on Ctrl-C
    service.fail(err)  # logs "round aborted: ..." when it is the round's first failure
    if service.error is not err:  # the round had ended already (a scancel reaches every task at once)
        log.error("%s (the round had already %s)", err, "failed" if service.error is not None else "started")


def stop_on_sigterm(who: str, culprit: str | None) -> dict[int, Any]:
    """On the main thread, SIGTERM (``scancel``, ``kill``, a supervisor) ends the call in one
    line naming the phase, "worker w0 stopped by SIGTERM while receiving", and exit status 143,
    not a bare "Terminated": the error is raised where the call waits, so the worker tells the
    chief why it goes, as for any failure. Raised as ``StopSignal`` (the caller raises its
    ``error``): an ``Exception`` raised from the handler was swallowed by whatever ``except
    Exception`` the main thread was in, such as logging's own, and the worker carried on.
    Returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum, frame) -> None:
        from collective import logs

        phase = logs.current("phase")
        err = AbortedError(logs.stop_message(who, signum, phase), culprit=culprit, phase=phase)
        err.exit_code = 128 + signum
        raise StopSignal(err)

    return {signal.SIGTERM: signal.signal(signal.SIGTERM, on_signal)}


# The handlers ``stopped_from_the_start`` replaced, the innermost call's last (main thread only).
_replaced: list[dict[int, Any]] = []


def stopped_from_the_start(call: Callable) -> Callable:
    """Decorate an API call (``collective.sync``) so SIGTERM ends it in one line from its first
    statement: ``AbortedError`` "collective.sync stopped by SIGTERM while starting", exit status
    143. Without it a ``scancel`` in the call's first half second, before its role's handler is
    installed (the chief's ``on_stop_signals`` once its port is bound, the worker's
    ``stop_on_sigterm`` once its relay is up), kills the process without a word. Those handlers
    take over when installed and give this one back when they end. Main thread only."""

    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return call(*args, **kwargs)
        name = call.__module__.split(".")[0] + "." + call.__name__

        def on_signal(signum, frame) -> None:
            from collective import logs

            phase = logs.current("phase")  # "-" before a phase began: "while starting"
            err = AbortedError(logs.stop_message(name, signum, phase), phase=None if phase == "-" else phase)
            err.exit_code = 128 + signum
            raise StopSignal(err)

        from collective import logs

        logs.phase(None)  # a new call has no phase yet: not the last call's in this process
        _replaced.append({signal.SIGTERM: signal.signal(signal.SIGTERM, on_signal)})
        try:
            return call(*args, **kwargs)
        except StopSignal as stop:
            raise stop.error from None
        finally:
            for sig, handler in _replaced.pop().items():
                signal.signal(sig, handler)

    return wrapper


@contextmanager
def handlers_before_the_call():
    """Inside a ``stopped_from_the_start`` call: the handlers it replaced, back for this block.
    Under mpiexec: a Python handler runs only between bytecodes, so a rank blocked in an MPI
    collective would never act on it, where the default ends the process and mpiexec the job."""
    if not _replaced or threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = {sig: signal.signal(sig, handler) for sig, handler in _replaced[-1].items()}
    try:
        yield
    finally:
        for sig, handler in ours.items():
            signal.signal(sig, handler)
